# fsdp_libtorch: the CPU half of LibTorch (torch_cpu + c10, with the C++ API headers).
# The wheel's `torch` target also drags in CUDA runtime libraries; the CPU library does not need
# them, so it links the CPU libraries directly and the CUDA path lives in fsdp::cuda.
add_library(fsdp_libtorch INTERFACE)
target_include_directories(fsdp_libtorch SYSTEM INTERFACE
  $<TARGET_PROPERTY:torch,INTERFACE_INCLUDE_DIRECTORIES>)
target_link_libraries(fsdp_libtorch INTERFACE torch_cpu c10)

# fmt: LibTorch's include directory carries fmt 12 headers, which shadow Debian's libfmt 9
# headers on the include path; linking Debian's libfmt.so against them would mismatch. So code
# that formats uses LibTorch's copy header-only.
add_library(fsdp_fmt INTERFACE)
target_compile_definitions(fsdp_fmt INTERFACE FMT_HEADER_ONLY)
target_link_libraries(fsdp_fmt INTERFACE fsdp_libtorch)

# OpenMP: ATen's at::parallel_for is an OpenMP region written in its headers
# (ATen/ParallelOpenMP.h). Compiled without -fopenmp the pragma is ignored and every
# at::parallel_for in our code runs on one thread whatever at::set_num_threads says. The wheel
# ships its libgomp.so.1 beside libtorch_cpu.so; with the same soname only one OpenMP runtime
# is loaded (the wheel's, found first through the RUNPATH), so one thread pool and one thread
# count serve ATen and us.
find_package(OpenMP REQUIRED COMPONENTS CXX)
target_link_libraries(fsdp_libtorch INTERFACE OpenMP::OpenMP_CXX)

# LibTorch's headers, precompiled: nearly every translation unit includes torch/torch.h, whose
# parse is most of a compile without them. Two precompiled headers serve every target, because
# GCC uses one only under the same code-generation flags: fsdp_distributed's (-fPIC: the
# library's subsystems) and fsdp_models' (no -fPIC: models, formats, the trainer and its
# programs, the tests, benchmarks and examples). Each costs ~65 s of CPU to build (a 725 MB
# .gch), so sharing them beats one per target. Definitions that LibTorch's headers never test
# (FMT_HEADER_ONLY, TOML_*, GTEST_HAS_PTHREAD, FSDP_VERSION) may differ; -Winvalid-pch (CMake
# adds it) warns if GCC ever refuses one. ccache needs CCACHE_SLOPPINESS for them
# (scripts/setup.sh sets it). FSDP_PCH=OFF turns them off.
option(FSDP_PCH "Precompile LibTorch's headers for the larger targets" ON)
function(fsdp_precompile_torch target)
  cmake_parse_arguments(P "" "REUSE_FROM" "" ${ARGN})
  if(NOT FSDP_PCH)
    return()
  elseif(P_REUSE_FROM)
    target_precompile_headers(${target} REUSE_FROM ${P_REUSE_FROM})
  else()
    target_precompile_headers(${target} PRIVATE <torch/torch.h>)
  endif()
endfunction()
