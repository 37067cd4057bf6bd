# The CUDA backend (sm_90a): the static library dcpmla_cuda, its GPU tests (ctest label
# `gpu`) and the benchmark. Included by the top-level CMakeLists.txt, which defines
# DCPMLA_CUDA = AUTO (build when nvcc is found) | ON (required) | OFF.
#
# The GPU tests build wherever the backend builds (CI compiles them without a GPU); they
# skip themselves when no device is present, and a CPU-only run can leave them out with
# `ctest -LE gpu`. On a GPU machine: `ctest -L gpu` (or scripts/device.sh).

set(_dcpmla_cuda_modes AUTO ON OFF)
string(TOUPPER "${DCPMLA_CUDA}" _dcpmla_cuda_mode)
# pip install . passes the environment's DCPMLA_CUDA, where 1 and 0 read naturally.
if(_dcpmla_cuda_mode STREQUAL "1")
  set(_dcpmla_cuda_mode ON)
elseif(_dcpmla_cuda_mode STREQUAL "0")
  set(_dcpmla_cuda_mode OFF)
endif()
if(NOT _dcpmla_cuda_mode IN_LIST _dcpmla_cuda_modes)
  message(FATAL_ERROR "DCPMLA_CUDA = '${DCPMLA_CUDA}': expected AUTO, ON (1) or OFF (0)")
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
# src/cuda by role: common (checks, device queries, RAII owners, launch-side params),
# attention, write, merge, comm (the device communicators), dcp (the DCP step), conformance
# (the CUDA rank of mla_attention). The NCCL communicator is its own library (cmake/nccl.cmake).
add_library(dcpmla_cuda STATIC
  src/cuda/common/device.cpp
  src/cuda/attention/attention.cpp
  src/cuda/attention/variants.cpp
  src/cuda/attention/kv_box_maps.cpp
  src/cuda/attention/combine.cu
  ${_dcpmla_attention_variants}
  src/cuda/write/write_kv.cu
  src/cuda/write/write.cpp
  src/cuda/merge/merge.cu
  src/cuda/merge/merge.cpp
  src/cuda/comm/comm_device.cpp
  src/cuda/dcp/dcp_step.cpp
  src/cuda/dcp/dcp_kernels.cu
  src/cuda/conformance/rank_engine.cpp)
target_include_directories(dcpmla_cuda PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src/cuda)
add_library(dcpmla::dcpmla_cuda ALIAS dcpmla_cuda)
set_target_properties(dcpmla_cuda PROPERTIES
  CUDA_ARCHITECTURES OFF
  POSITION_INDEPENDENT_CODE ON
  EXPORT_NAME dcpmla_cuda)
separate_arguments(_dcpmla_gencode UNIX_COMMAND "${DCPMLA_CUDA_GENCODE}")
target_compile_options(dcpmla_cuda PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:${_dcpmla_gencode} -lineinfo --expt-relaxed-constexpr -Xcompiler=-Wall>
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>)
# A measuring build (bench/NOTES.md, sixteenth session): the bf16 producers that stream tiles
# (stream_bf16_tiles: the 64-row wgmma kernel, the bf16 swap kernel) issue no copy and release
# each stage at once, so the bench times the consumers' own pace with every tile in place. Its
# results are wrong: never for use, and the tests fail on it. The bench's records say so
# (meta.probe_no_fill) and the perf record skips them.
option(DCPMLA_PROBE_NO_FILL "Measuring only: the bf16 tile streams load nothing (wrong results)" OFF)
if(DCPMLA_PROBE_NO_FILL)
  message(WARNING "dcpmla: DCPMLA_PROBE_NO_FILL is on: the bf16 kernels skip their KV loads, results are wrong")
  target_compile_definitions(dcpmla_cuda PUBLIC DCPMLA_PROBE_NO_FILL=1)
endif()
# Register spills (checked when the kernels are compiled, also on machines without a GPU):
# ptxas reports spills and local memory, and for every kernel the library runs by default
# they are errors, so that a change that spills fails the build. The opt-in variants listed
# here spill a few bytes today (two CTAs per SM cap them at 128 registers; the mma.sync
# kernel at 64 rows x 64 tokens): their warnings stay warnings (docs/reliability.md).
option(DCPMLA_SPILL_CHECK "Fail the build when a default CUDA kernel spills registers" ON)
target_compile_options(dcpmla_cuda PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:-Xptxas=--warn-on-spills,--warn-on-local-memory-usage>)
if(DCPMLA_SPILL_CHECK)
  set(_dcpmla_spilling_variants m16_n32_cps2_bf16.cu m16_n32_cps2_fp8.cu m64_n64_bf16.cu)
  foreach(_src ${_dcpmla_attention_variants} src/cuda/attention/combine.cu src/cuda/write/write_kv.cu
               src/cuda/merge/merge.cu src/cuda/dcp/dcp_kernels.cu)
    get_filename_component(_name "${_src}" NAME)
    if(NOT _name IN_LIST _dcpmla_spilling_variants)
      set_property(SOURCE "${_src}" APPEND PROPERTY COMPILE_OPTIONS -Xptxas=--warning-as-error)
    endif()
  endforeach()
endif()
# The warp-specialised kernels' register split, in their SASS (scripts/check_register_split.py):
# ptxas drops a setmaxnreg split without a word when a region needs more than its share, and
# the kernel then runs on the launch allocation; and it may serialise their wgmma. The bf16
# swap kernel has no split (its one consumer warpgroup fits the launch allocation): only its
# pipelining is checked. In the swap kernels' cubins (both kernels, every form), the softmax must
# read its tile maxima before its P^T stores. The cubins are kept from the normal compile
# (-keep), so the check costs no extra compilation; it runs without a GPU.
if(DCPMLA_TESTS)
  set(_dcpmla_split_kernels wg64_bf16 wg64_fp8 fp8_swap_e4m3 fp8_swap_e5m2 fp8_swap32_e4m3 fp8_swap32_e5m2)
  set(_dcpmla_unsplit_kernels bf16_swap_m16 bf16_swap_m32)
  set(_dcpmla_cubins "${CMAKE_BINARY_DIR}/cubins")
  file(MAKE_DIRECTORY "${_dcpmla_cubins}")
  foreach(_kernel ${_dcpmla_split_kernels} ${_dcpmla_unsplit_kernels})
    set_property(SOURCE "${CMAKE_CURRENT_SOURCE_DIR}/src/cuda/attention/instantiations/${_kernel}.cu" APPEND
                 PROPERTY COMPILE_OPTIONS -keep "-keep-dir=${_dcpmla_cubins}")
  endforeach()
  list(TRANSFORM _dcpmla_split_kernels PREPEND "${_dcpmla_cubins}/" OUTPUT_VARIABLE _dcpmla_split_cubins)
  list(TRANSFORM _dcpmla_split_cubins APPEND ".cubin")
  list(TRANSFORM _dcpmla_unsplit_kernels PREPEND "${_dcpmla_cubins}/" OUTPUT_VARIABLE _dcpmla_unsplit_cubins)
  list(TRANSFORM _dcpmla_unsplit_cubins APPEND ".cubin")
  # The project's interpreter (the Makefile passes the .venv's, which has nvdisasm), else any.
  set(_dcpmla_python "${Python_EXECUTABLE}")
  if(NOT _dcpmla_python)
    find_package(Python3 COMPONENTS Interpreter QUIET)
    set(_dcpmla_python "${Python3_EXECUTABLE}")
  endif()
  if(_dcpmla_python)
    add_test(NAME register_split
      COMMAND "${_dcpmla_python}" "${CMAKE_CURRENT_SOURCE_DIR}/scripts/check_register_split.py" ${_dcpmla_split_cubins}
              --unsplit ${_dcpmla_unsplit_cubins})
    # 77: no nvdisasm on this machine (neither the toolkit's nor the pip package's).
    set_tests_properties(register_split PROPERTIES SKIP_RETURN_CODE 77 LABELS "ptx")
  endif()
endif()
if(DCPMLA_CUDART_STATIC)
  target_link_libraries(dcpmla_cuda PUBLIC dcpmla::dcpmla CUDA::cudart_static)
else()
  target_link_libraries(dcpmla_cuda PUBLIC dcpmla::dcpmla CUDA::cudart)
endif()

option(DCPMLA_CUDA_TESTS "Build the CUDA backend's tests (ctest label gpu)" ${DCPMLA_TESTS})
option(DCPMLA_BENCH "Build the CUDA benchmark dcpmla_bench" ON)
if(DCPMLA_CUDA_TESTS)
  enable_testing()
  add_subdirectory(tests/cuda)
endif()
# bench/ (the DCP benchmark's core, which `dcpmla bench` links too, and the bench binaries)
# is added by the top-level CMakeLists.txt once the NCCL part below is configured.
