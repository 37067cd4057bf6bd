# Installs the C++ library so that another CMake project can do
#   find_package(dcpmla REQUIRED)
#   target_link_libraries(app PRIVATE dcpmla::dcpmla)
# A wheel build (pip install .) sets DCPMLA_INSTALL=OFF: the wheel carries only the
# Python package, not the static library, headers and CMake files.
option(DCPMLA_INSTALL "Install the C++ library, headers and CMake package files" ON)
if(NOT DCPMLA_INSTALL)
  return()
endif()

include(CMakePackageConfigHelpers)

set(DCPMLA_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/dcpmla")

# Optional parts (cmake/cuda.cmake, cmake/mpi.cmake) are installed when they were
# built; consumers then also need their dependencies, and only then their headers.
set(_dcpmla_install_targets dcpmla)
set(_dcpmla_header_excludes)
set(DCPMLA_CONFIG_NEEDS_CUDA OFF)
if(TARGET dcpmla_cuda)
  list(APPEND _dcpmla_install_targets dcpmla_cuda)
  set(DCPMLA_CONFIG_NEEDS_CUDA ON)
else()
  list(APPEND _dcpmla_header_excludes PATTERN "cuda.h" EXCLUDE)  # includes cuda_runtime_api.h
  list(APPEND _dcpmla_header_excludes PATTERN "comm_device.h" EXCLUDE PATTERN "dcp.h" EXCLUDE)
endif()
if(TARGET dcpmla_nccl)
  list(APPEND _dcpmla_install_targets dcpmla_nccl)  # links libnccl by its path
else()
  list(APPEND _dcpmla_header_excludes PATTERN "comm_nccl.h" EXCLUDE)
endif()
set(DCPMLA_CONFIG_NEEDS_MPI OFF)
if(TARGET dcpmla_mpi)
  list(APPEND _dcpmla_install_targets dcpmla_mpi)
  set(DCPMLA_CONFIG_NEEDS_MPI ON)
else()
  list(APPEND _dcpmla_header_excludes PATTERN "comm_mpi.h" EXCLUDE)
endif()

install(TARGETS ${_dcpmla_install_targets}
  EXPORT dcpmlaTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})

install(DIRECTORY include/dcpmla
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  FILES_MATCHING PATTERN "*.h" ${_dcpmla_header_excludes})

install(EXPORT dcpmlaTargets
  NAMESPACE dcpmla::
  DESTINATION ${DCPMLA_INSTALL_CMAKEDIR})

configure_package_config_file(
  ${CMAKE_CURRENT_LIST_DIR}/dcpmlaConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/dcpmlaConfig.cmake
  INSTALL_DESTINATION ${DCPMLA_INSTALL_CMAKEDIR})
# 0.x: a minor release may change the API, so only the same minor version matches.
write_basic_package_version_file(
  ${CMAKE_CURRENT_BINARY_DIR}/dcpmlaConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMinorVersion)

install(FILES
  ${CMAKE_CURRENT_BINARY_DIR}/dcpmlaConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/dcpmlaConfigVersion.cmake
  DESTINATION ${DCPMLA_INSTALL_CMAKEDIR})
