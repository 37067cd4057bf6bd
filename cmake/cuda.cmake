# The CUDA backend (sm_90a): the static library dcpmla_cuda, its GPU tests (ctest label
# `gpu`) and the benchmark. Included by the top-level CMakeLists.txt, which defines
# DCPMLA_CUDA = AUTO (build when nvcc is found) | ON (required) | OFF.
#
# The GPU tests build wherever the backend builds (CI compiles them without a GPU); they
# skip themselves when no device is present, and a CPU-only run can leave them out with
# `ctest -LE gpu`. On a GPU machine: `ctest -L gpu` (or scripts/device.sh).

set(_dcpmla_cuda_modes AUTO ON OFF)
string(TOUPPER "${DCPMLA_CUDA}" _dcpmla_cuda_mode)
if(NOT _dcpmla_cuda_mode IN_LIST _dcpmla_cuda_modes)
  message(FATAL_ERROR "DCPMLA_CUDA = '${DCPMLA_CUDA}': expected AUTO, ON or OFF")
endif()
if(_dcpmla_cuda_mode STREQUAL "OFF")
  message(STATUS "dcpmla: CUDA backend off (DCPMLA_CUDA=OFF)")
  return()
endif()

include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  if(_dcpmla_cuda_mode STREQUAL "ON")
    message(FATAL_ERROR "DCPMLA_CUDA=ON but no CUDA compiler (nvcc) was found; set CMAKE_CUDA_COMPILER")
  endif()
  message(STATUS "dcpmla: no CUDA compiler found, CUDA backend off (DCPMLA_CUDA=AUTO)")
  return()
endif()

# The architecture is passed explicitly below: sm_90a (wgmma / setmaxnreg class features)
# cannot be expressed through CUDA_ARCHITECTURES on every CMake version we support.
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES OFF)
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
# The project's CXX_STANDARD 20 also sets the CUDA dialect; CMake < 3.26 does not know
# nvcc's flag for it (nvcc >= 12 takes -std=c++20).
if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  list(APPEND CMAKE_CUDA20_COMPILE_FEATURES cuda_std_20)
  list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
endif()
message(STATUS "dcpmla: CUDA backend on (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, sm_90a)")

set(DCPMLA_CUDA_GENCODE "-gencode=arch=compute_90a,code=sm_90a" CACHE STRING
    "nvcc target flags of the CUDA backend (the kernels need sm_90a)")

# One attention variant per file (rows per CTA x tile tokens x CTAs per SM x dtype).
file(GLOB _dcpmla_attention_variants CONFIGURE_DEPENDS
  ${CMAKE_CURRENT_SOURCE_DIR}/src/cuda/attention/instantiations/*.cu)
add_library(dcpmla_cuda STATIC
  src/cuda/runner.cpp
  src/cuda/engine.cpp
  src/cuda/attention/launch.cu
  ${_dcpmla_attention_variants}
  src/cuda/merge/merge.cu
  src/cuda/merge/merge.cpp
  src/cuda/write/write_kv.cu
  src/cuda/write/write.cpp)
add_library(dcpmla::dcpmla_cuda ALIAS dcpmla_cuda)
set_target_properties(dcpmla_cuda PROPERTIES
  CUDA_ARCHITECTURES OFF
  POSITION_INDEPENDENT_CODE ON
  EXPORT_NAME dcpmla_cuda)
separate_arguments(_dcpmla_gencode UNIX_COMMAND "${DCPMLA_CUDA_GENCODE}")
target_compile_options(dcpmla_cuda PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:${_dcpmla_gencode} -lineinfo --expt-relaxed-constexpr -Xcompiler=-Wall>
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>)
target_link_libraries(dcpmla_cuda PUBLIC dcpmla::dcpmla CUDA::cudart)

option(DCPMLA_CUDA_TESTS "Build the CUDA backend's tests (ctest label gpu)" ${DCPMLA_TESTS})
option(DCPMLA_BENCH "Build the CUDA benchmark dcpmla_bench" ON)
if(DCPMLA_CUDA_TESTS)
  enable_testing()
  add_subdirectory(tests/cuda)
endif()
if(DCPMLA_BENCH)
  # The bench binaries parse arguments with CLI11 and write results with nlohmann-json.
  find_package(CLI11 REQUIRED)
  find_package(nlohmann_json REQUIRED)
  add_subdirectory(bench)
endif()
