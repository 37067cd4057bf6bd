# dcpmla/build_info.h (DCPMLA_VERSION_STRING, DCPMLA_GIT_COMMIT), refreshed at every build
# rather than at configure time, so that results files name the commit actually built.
# dcpmla_use_build_info(target) makes a target see it.
set(_dcpmla_build_info "${PROJECT_BINARY_DIR}/generated/dcpmla/build_info.h")
add_custom_target(dcpmla_build_info
  COMMAND ${CMAKE_COMMAND} -DSOURCE_DIR=${PROJECT_SOURCE_DIR} -DOUT=${_dcpmla_build_info}
          -DVERSION=${PROJECT_VERSION} -P ${PROJECT_SOURCE_DIR}/cmake/write_build_info.cmake
  BYPRODUCTS ${_dcpmla_build_info}
  VERBATIM)

function(dcpmla_use_build_info target)
  add_dependencies(${target} dcpmla_build_info)
  target_include_directories(${target} PRIVATE "${PROJECT_BINARY_DIR}/generated")
endfunction()
