// Gradient clipping by the norm of the whole model's gradient, when each rank holds a shard.
//
// torch::nn::utils::clip_grad_norm_ would clip each rank's shard by that shard's norm, which is
// a different (and rank-dependent) operation; here the squared norms of the shards are summed
// across the group first, so every rank scales by the same factor as one process would.
// GradNormSum computes the same norm from pieces (a unit's grads at a time, e.g. inside
// backward when the optimizer steps there, where no whole-model gradient ever exists).
#pragma once

#include <torch/types.h>

#include <utility>
#include <vector>

#include <fsdp/distributed/process_group.h>

namespace fsdp {

/// Tensor parallelism's parameters for the norm: those split over a tensor-parallel group of
/// `ways` ranks hold a different part on each of them (the others, norms and biases kept whole,
/// the same values on all of them), so their elements have `ways` times fewer holders.
struct TensorParallelParams {
  std::vector<torch::Tensor> split;  // the parameter objects (before or after fully_shard)
  int ways = 1;
};

/// Scales the grads of `params` (this rank's shards, e.g. model->parameters()) so the global
/// L2 norm is at most `max_norm`, and returns the global norm before clipping. Every rank of
/// `group` must call it, and `group` must be the group the units were given (their shard and
/// replicate groups span it). Elements held by several ranks (kNoShard, kHybridShard, and
/// parameters of no unit, which every rank holds whole) are counted once. When every parameter
/// is in a unit sharded over one rank (kNoShard), whose reduced grads are the same on every
/// rank, the norm is computed locally and no collective is issued: call it after a synced
/// backward (not after a no_sync pass, whose grads differ between ranks).
/// With tensor parallelism, `group` spans both axes of the mesh (the world) and `tp` names the
/// split parameters.
double clip_grad_norm_(const std::vector<torch::Tensor>& params, double max_norm,
                       ProcessGroup& group, const TensorParallelParams& tp = {});

/// The global L2 norm of gradients added a few parameters at a time: add() takes this rank's
/// local squared norms of their grads (no collective), reduce() sums the pieces across the
/// group and returns the norm clip_grad_norm_ would return for all the parameters added
/// (bitwise when they are added in one call; otherwise the same terms summed in another order,
/// within a few ulps of double). clip_grad_norm_'s rules hold: `group` is the units' group,
/// and reduce() issues its one all-reduce unless every parameter added was in a unit sharded
/// over one rank, so every rank must add() parameters of the same units.
class GradNormSum {
 public:
  explicit GradNormSum(ProcessGroup& group, TensorParallelParams tp = {})
      : group_(&group), tp_(std::move(tp)) {}
  /// Adds the squared norms of the grads of `params` (parameters without a grad count zero).
  void add(const std::vector<torch::Tensor>& params);
  /// The global norm of everything added since the last reduce(), which starts a new sum.
  /// Every rank of the group calls it.
  double reduce();

 private:
  ProcessGroup* group_;
  TensorParallelParams tp_;
  torch::Tensor weighted_;  // squares, an element held by R ranks weighed 1/R (double, [1])
  torch::Tensor whole_;     // the same unweighed: the norm when every grad is replicated
  bool replicated_everywhere_ = true;
};

}  // namespace fsdp
