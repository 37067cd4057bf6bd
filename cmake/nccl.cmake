# The NCCL communicator, included by the top-level CMakeLists.txt right after
# cmake/cuda.cmake (which builds the DCP step and the device in-process communicator into
# dcpmla_cuda): the static library dcpmla_nccl, built when NCCL is found
# (DCPMLA_NCCL = AUTO | ON | OFF); with the MPI communicator library it also has the
# mpirun start-up (the unique id shared with MPI_Bcast); and the NCCL tests.
# NCCL is looked for beside the CUDA toolkit (its headers and libnccl ship there on our
# machines), then under NCCL_ROOT (a CMake or environment variable).
if(NOT TARGET dcpmla_cuda)
  return()
endif()

set(DCPMLA_NCCL "AUTO" CACHE STRING "Build the NCCL communicator: ON, OFF or AUTO (when NCCL is found)")
string(TOUPPER "${DCPMLA_NCCL}" _dcpmla_nccl_mode)
if(_dcpmla_nccl_mode STREQUAL "OFF")
  message(STATUS "dcpmla: NCCL communicator off (DCPMLA_NCCL=OFF)")
  return()
endif()

set(_dcpmla_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_LIBRARY_ROOT} ${CUDAToolkit_TARGET_DIR})
find_path(DCPMLA_NCCL_INCLUDE_DIR nccl.h
  HINTS ${CUDAToolkit_INCLUDE_DIRS} ${_dcpmla_nccl_hints} PATH_SUFFIXES include)
find_library(DCPMLA_NCCL_LIBRARY NAMES nccl libnccl.so.2
  HINTS ${CUDAToolkit_LIBRARY_DIR} ${_dcpmla_nccl_hints} PATH_SUFFIXES lib lib64)
if(NOT DCPMLA_NCCL_INCLUDE_DIR OR NOT DCPMLA_NCCL_LIBRARY)
  if(_dcpmla_nccl_mode STREQUAL "ON")
    message(FATAL_ERROR "DCPMLA_NCCL=ON but nccl.h / libnccl were not found (set NCCL_ROOT)")
  endif()
  message(STATUS "dcpmla: NCCL not found; the NCCL communicator is not built")
  return()
endif()
message(STATUS "dcpmla: NCCL communicator on (${DCPMLA_NCCL_LIBRARY})")

add_library(dcpmla_nccl STATIC src/cuda/comm/comm_nccl.cpp)
add_library(dcpmla::dcpmla_nccl ALIAS dcpmla_nccl)
set_target_properties(dcpmla_nccl PROPERTIES EXPORT_NAME dcpmla_nccl)
target_include_directories(dcpmla_nccl PRIVATE ${DCPMLA_NCCL_INCLUDE_DIR} ${CMAKE_CURRENT_SOURCE_DIR}/src/cuda)
# The library path itself (not an imported target) so that the installed package needs
# no find module for NCCL.
target_link_libraries(dcpmla_nccl PUBLIC dcpmla::dcpmla_cuda ${DCPMLA_NCCL_LIBRARY})
target_compile_options(dcpmla_nccl PRIVATE -Wall -Wextra)
if(TARGET dcpmla_mpi)
  target_link_libraries(dcpmla_nccl PUBLIC dcpmla_mpi)
  target_compile_definitions(dcpmla_nccl PRIVATE DCPMLA_NCCL_WITH_MPI)
endif()

if(DCPMLA_CUDA_TESTS)
  find_package(GTest REQUIRED)  # tests/cuda's import is scoped to that directory
  include(GoogleTest)
  # Registered here rather than in tests/cuda/CMakeLists.txt: that directory is read
  # before this file finds NCCL. Each NCCL case starts its own process (ctest), with
  # NVLink multicast off.
  add_executable(test_cuda_nccl tests/cuda/test_cuda_nccl.cpp)
  target_link_libraries(test_cuda_nccl PRIVATE dcpmla_nccl GTest::gtest_main)
  target_compile_options(test_cuda_nccl PRIVATE -Wall -Wextra)
  gtest_discover_tests(test_cuda_nccl
    DISCOVERY_MODE PRE_TEST
    DISCOVERY_TIMEOUT 60
    PROPERTIES LABELS gpu ENVIRONMENT "NCCL_NVLS_ENABLE=0" TIMEOUT 60)
  if(TARGET dcpmla_mpi)
    # The mpirun start-up: one process per GPU. -np 1 runs NCCL where a GPU is; with
    # fewer GPUs than processes (CI: none) every rank must fail with the same clear error.
    add_executable(test_nccl_mpi tests/cuda/test_nccl_mpi.cpp)
    target_link_libraries(test_nccl_mpi PRIVATE dcpmla_nccl)
    target_compile_options(test_nccl_mpi PRIVATE -Wall -Wextra)
    foreach(np 1 2)
      add_test(NAME nccl_mpi_np${np}
        COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} --oversubscribe ${MPIEXEC_PREFLAGS}
                $<TARGET_FILE:test_nccl_mpi> ${MPIEXEC_POSTFLAGS})
      set_tests_properties(nccl_mpi_np${np} PROPERTIES
        LABELS gpu RESOURCE_LOCK mpirun
        ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMP_NUM_THREADS=1;NCCL_NVLS_ENABLE=0"
        PASS_REGULAR_EXPRESSION "nccl mpi: all ranks ok" FAIL_REGULAR_EXPRESSION "FAILED" TIMEOUT 120)
    endforeach()
  endif()
endif()
