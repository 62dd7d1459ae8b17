// A vocabulary split over a tensor-parallel group: the embedding table's rows, the head's
// logits and the cross-entropy over them, without ever gathering the logits.
//
// Rank r holds words [first, first + size): ceil(V / n) of them, the last rank fewer when n
// does not divide V (so no padding rows exist anywhere). The cross-entropy of a position needs
// three numbers from every rank: the largest logit (for a stable softmax), the sum of the
// exponentials, and the target's logit from the rank that holds it: two all-reduces of N
// values, instead of the N x V logits.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <vector>

#include <fsdp/distributed/process_group.h>

namespace fsdp::tp {

/// The words one rank of a vocabulary-parallel group holds.
struct VocabShard {
  int64_t total = 0;  // V
  int64_t first = 0;  // the first word of this rank
  int64_t size = 0;   // how many (0 for a rank past the end, when n > V)
  /// Every rank's size, in group-rank order.
  std::vector<int64_t> sizes;

  /// Rank `rank` of `n`'s words of a vocabulary of `total`.
  static VocabShard of(int64_t total, int rank, int n);
};

/// A vocabulary split over a group: the words this rank holds, and the group.
struct VocabSplit {
  VocabShard shard;
  std::shared_ptr<ProcessGroup> group;

  /// `group`'s rank's words of a vocabulary of `total`.
  static VocabSplit over(int64_t total, std::shared_ptr<ProcessGroup> group);
};

/// Rows of the embedding table for `ids` (any shape, int64 in [0, V)), with the table split by
/// words: each rank looks up the ids it holds (zeros for the others) and the results are
/// summed over the group (reduce_from_group). (..., C), the same on every rank. With
/// `scatter_dim` >= 0 (sequence parallelism: the sequence's dimension) the sum is
/// reduce-scattered along it instead (reduce_scatter_to_group): this rank's piece of the rows.
torch::Tensor vocab_parallel_embedding(const torch::Tensor& weight, const torch::Tensor& ids,
                                       const VocabShard& shard,
                                       const std::shared_ptr<ProcessGroup>& group,
                                       int64_t scatter_dim = -1);

/// Per position: logsumexp of the whole vocabulary's logits and the target's logit, from this
/// rank's columns `logits` (N, shard.size; float32) and the targets (N) in [0, V). Two
/// all-reduces (max, then the sums and the picked logits together). No autograd: what a fused
/// loss uses inside its own forward.
struct LogSumExpAndTarget {
  torch::Tensor lse;     // (N) float32
  torch::Tensor target;  // (N) float32
};
LogSumExpAndTarget vocab_parallel_lse(const torch::Tensor& logits, const torch::Tensor& targets,
                                      const VocabShard& shard,
                                      const std::shared_ptr<ProcessGroup>& group);

/// Cross-entropy of each position (N) from this rank's columns of the logits (N, shard.size),
/// the same on every rank; computed in float32. The gradient flows to this rank's logits only
/// (softmax minus the one-hot target, on its columns). Targets equal to ignore_index give 0.
torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits,
                                           const torch::Tensor& targets, const VocabShard& shard,
                                           const std::shared_ptr<ProcessGroup>& group,
                                           int64_t ignore_index = -100);

}  // namespace fsdp::tp
