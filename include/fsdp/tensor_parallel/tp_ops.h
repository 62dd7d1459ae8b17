// The communication of tensor parallelism (Megatron-LM's layout, Shoeybi et al. 2019), as
// autograd operations on a tensor-parallel group: each is one collective of
// fsdp/distributed/collectives.h in one direction and its adjoint in the other.
//
// A column-parallel Linear (its output features split over the group) takes
// copy_to_group(x) and gives each rank its slice of the output; a row-parallel Linear (its input
// features split) gives a partial sum that reduce_from_group() adds up. An MLP or an attention
// block is column then row: one all-reduce in forward, one in backward. With sequence
// parallelism the residual stream between blocks is split along the sequence instead of
// replicated: gather_from_group() before the column-parallel layer and
// reduce_scatter_to_group() after the row-parallel one replace the two all-reduces (the same
// bytes as one all-reduce, and the norms compute on 1/tp of the positions).
//
// Every rank of the group calls each operation in the same order, forward and backward, as for
// any collective. The graph keeps the group alive until its backward has run.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <vector>

#include <fsdp/distributed/process_group.h>

namespace fsdp::tp {

/// Forward: x itself. Backward: the gradient summed over the group (an all-reduce). Put before
/// a layer whose parameters are split over the group and whose input is the same on every rank:
/// each rank's gradient of x is the part its slice contributes.
torch::Tensor copy_to_group(const torch::Tensor& x, const std::shared_ptr<ProcessGroup>& group);

/// Forward: x summed over the group (an all-reduce). Backward: the gradient itself. Put after a
/// layer whose every rank computes a partial sum of the same output (a row-parallel Linear).
torch::Tensor reduce_from_group(const torch::Tensor& x, const std::shared_ptr<ProcessGroup>& group);

/// Forward: the ranks' x concatenated along `dim` in group-rank order (an all-gather; every
/// rank's x has the same shape). Backward: the gradient's sum over the group, this rank's piece
/// of it along `dim` (a reduce-scatter). Sequence parallelism: the split residual stream made
/// whole before a column-parallel layer.
torch::Tensor gather_from_group(const torch::Tensor& x, int64_t dim,
                                const std::shared_ptr<ProcessGroup>& group);

/// Forward: x summed over the group, this rank's piece of the sum along `dim` (a
/// reduce-scatter; x.size(dim) a multiple of the group's size). Backward: the ranks' gradients
/// concatenated along `dim` (an all-gather). Sequence parallelism: a row-parallel layer's
/// partial sums, added up and split along the sequence.
torch::Tensor reduce_scatter_to_group(const torch::Tensor& x, int64_t dim,
                                      const std::shared_ptr<ProcessGroup>& group);

/// Forward: this rank's piece of x along `dim` (x the same on every rank, x.size(dim) a
/// multiple of the group's size; no communication). Backward: the ranks' gradients
/// concatenated along `dim` (an all-gather). Where a replicated tensor enters a split region.
torch::Tensor split_to_group(const torch::Tensor& x, int64_t dim,
                             const std::shared_ptr<ProcessGroup>& group);

/// Forward: the ranks' pieces along the last dimension concatenated in group-rank order, rank r
/// contributing sizes[r] columns (x.size(-1) == sizes[rank]; the pieces may differ, as a
/// vocabulary that the group's size does not divide). Backward: this rank's columns of the
/// gradient (no communication: the gathered tensor is the same on every rank, so is its
/// gradient). The whole logits of a vocabulary-parallel head, for code that wants them.
torch::Tensor gather_last_dim(const torch::Tensor& x, const std::vector<int64_t>& sizes,
                              const std::shared_ptr<ProcessGroup>& group);

}  // namespace fsdp::tp
