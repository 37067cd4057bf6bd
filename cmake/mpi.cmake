# The MPI communicator (host memory, one process per rank) and its mpirun tests.
if(DCPMLA_MPI STREQUAL "OFF")
  return()
endif()
if(DCPMLA_MPI STREQUAL "ON")
  find_package(MPI REQUIRED COMPONENTS CXX)
else()
  find_package(MPI QUIET COMPONENTS CXX)
  if(NOT MPI_CXX_FOUND)
    message(STATUS "dcpmla: MPI not found; the MPI communicator is not built")
    return()
  endif()
endif()

add_library(dcpmla_mpi STATIC src/comm_mpi.cpp)
add_library(dcpmla::dcpmla_mpi ALIAS dcpmla_mpi)
target_link_libraries(dcpmla_mpi PUBLIC dcpmla MPI::MPI_CXX)
target_compile_options(dcpmla_mpi PRIVATE -Wall -Wextra)

if(DCPMLA_TESTS)
  add_executable(test_mpi tests/mpi/test_mpi.cpp)
  target_link_libraries(test_mpi PRIVATE dcpmla_mpi)
  foreach(np 2 4)
    add_test(NAME mpi_np${np}
      COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} --oversubscribe ${MPIEXEC_PREFLAGS}
              $<TARGET_FILE:test_mpi> ${MPIEXEC_POSTFLAGS})
    # CI runs as root; Open MPI refuses root unless told. One thread per process: the
    # ranks already share the two cores. One mpirun at a time (RESOURCE_LOCK): two starting
    # together raced for Open MPI's session directory ("/tmp/ompi.<host>.0: File exists").
    set_tests_properties(mpi_np${np} PROPERTIES RESOURCE_LOCK mpirun
      ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMP_NUM_THREADS=1"
      PASS_REGULAR_EXPRESSION " 0 failed" FAIL_REGULAR_EXPRESSION "FAILED" TIMEOUT 300)
  endforeach()
endif()
