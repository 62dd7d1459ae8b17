// The NCCL backend for CUDA tensors, in the separate target fsdp::cuda so that CPU-only users
// never load CUDA libraries. Link fsdp::cuda and call register_nccl_backend() once before
// init_process_group(ProcessGroupOptions().backend("nccl")).
//
// Run on one GPU (an H200: NCCL at world size 1, docs/gpu.md); several GPUs have not been
// tried yet.
#pragma once

namespace fsdp {

/// Registers "nccl" with init_process_group(). Each rank uses CUDA device LOCAL_RANK.
void register_nccl_backend();

}  // namespace fsdp
