# Installs the build tree into a scratch prefix, then configures and builds the consumer project
# against it. Run by the build (tests/CMakeLists.txt: the fsdp_consumer target) with BUILD_DIR,
# SOURCE_DIR, WORK_DIR, TORCH_PREFIX and LAUNCHER defined; CTest runs the consumer it builds.
file(REMOVE_RECURSE "${WORK_DIR}")
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}")
  endif()
endfunction()
run(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
# The environment form of the search path: a ';' list would be split into separate arguments.
set(ENV{CMAKE_PREFIX_PATH} "${WORK_DIR}/prefix:${TORCH_PREFIX}")
# No build type (no -O flags): what is checked is that the package is found and links, not the
# consumer's speed. Unoptimised, and including only the LibTorch headers it uses, its one file
# compiles in 22 s of CPU (2-core EPYC); at -O2 with torch/torch.h it took 37.
run(${CMAKE_COMMAND} -S "${SOURCE_DIR}" -B "${WORK_DIR}/build" -G Ninja
    -DCMAKE_BUILD_TYPE= -DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER})
run(${CMAKE_COMMAND} --build "${WORK_DIR}/build")
