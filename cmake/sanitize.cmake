# DCPMLA_SANITIZE=ON: AddressSanitizer (with LeakSanitizer) and UndefinedBehaviorSanitizer
# on every target of this build, library and tests alike (`make sanitize`).
# -fno-sanitize-recover=all turns every UBSan report into a failing exit, so a test run
# cannot print a report and still pass. _GLIBCXX_ASSERTIONS adds libstdc++'s bounds checks
# on std::span / std::vector operator[], which ASan misses inside a vector's capacity.
# Included before any target is created: add_compile_options only reaches later targets.
# The flags stay PRIVATE to this build (not in the exported package config).
option(DCPMLA_SANITIZE "Build with -fsanitize=address,undefined (GCC or Clang)" OFF)
if(DCPMLA_SANITIZE)
  set(_dcpmla_sanitize_flags -fsanitize=address,undefined -fno-omit-frame-pointer
                             -fno-sanitize-recover=all)
  add_compile_options(${_dcpmla_sanitize_flags} -D_GLIBCXX_ASSERTIONS)
  add_link_options(${_dcpmla_sanitize_flags})
  message(STATUS "dcpmla: sanitizers on (address, undefined, leak)")
endif()
