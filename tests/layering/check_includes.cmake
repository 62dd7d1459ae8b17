# The layering between subsystems is enforced by the build: each subsystem compiles against a
# view of include/fsdp that holds only the headers it may use (CMakeLists.txt, fsdp_subsystem),
# and models/, formats/ and trainer/ see only their own folder and those below. The one way
# around that is a relative #include ("../engine/param_group.h"); this check, run by CTest,
# refuses any. Run with -DSOURCE_DIR=<repository>.
file(GLOB_RECURSE files
  "${SOURCE_DIR}/src/*.h" "${SOURCE_DIR}/src/*.cpp" "${SOURCE_DIR}/include/*.h"
  "${SOURCE_DIR}/models/*.h" "${SOURCE_DIR}/models/*.cpp"
  "${SOURCE_DIR}/formats/*.h" "${SOURCE_DIR}/formats/*.cpp"
  "${SOURCE_DIR}/trainer/*.h" "${SOURCE_DIR}/trainer/*.cpp")
set(bad "")
foreach(f IN LISTS files)
  file(STRINGS "${f}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*[\"<][.][.]/")
  foreach(l IN LISTS lines)
    file(RELATIVE_PATH rel "${SOURCE_DIR}" "${f}")
    string(APPEND bad "\n  ${rel}: ${l}")
  endforeach()
endforeach()
list(LENGTH files n)
if(bad)
  message(FATAL_ERROR "relative #include across folders (use the subsystem's public header):${bad}")
endif()
message(STATUS "${n} files, no relative #include")
