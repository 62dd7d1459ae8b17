// Gradient clipping by the norm of the whole model's gradient, when each rank holds a shard.
//
// torch::nn::utils::clip_grad_norm_ would clip each rank's shard by that shard's norm, which is
// a different (and rank-dependent) operation; here the squared norms of the shards are summed
// across the group first, so every rank scales by the same factor as one process would.
#pragma once

#include <torch/types.h>

#include <vector>

#include <fsdp/distributed/process_group.h>

namespace fsdp {

/// Scales the grads of `params` (this rank's shards, e.g. model->parameters()) so the global
/// L2 norm is at most `max_norm`, and returns the global norm before clipping. Every rank of
/// `group` must call it, and `group` must be the group the units were given (their shard and
/// replicate groups span it). Elements held by several ranks (kNoShard, kHybridShard, and
/// parameters of no unit, which every rank holds whole) are counted once. When every parameter
/// is in a unit sharded over one rank (kNoShard), whose reduced grads are the same on every
/// rank, the norm is computed locally and no collective is issued: call it after a synced
/// backward (not after a no_sync pass, whose grads differ between ranks).
double clip_grad_norm_(const std::vector<torch::Tensor>& params, double max_norm,
                       ProcessGroup& group);

}  // namespace fsdp
