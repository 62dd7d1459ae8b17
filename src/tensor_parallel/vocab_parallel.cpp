// See fsdp/tensor_parallel/vocab_parallel.h.
#include <fsdp/tensor_parallel/vocab_parallel.h>

#include <torch/autograd.h>

#include <ATen/ops/embedding.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

#include <fsdp/distributed/collectives.h>
#include <fsdp/tensor_parallel/tp_ops.h>

#include "group_capsule.h"

namespace fsdp::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The targets this rank holds, as local columns (0 where another rank holds them), and which.
struct LocalTargets {
  torch::Tensor column;  // (N) int64
  torch::Tensor here;    // (N) bool
};

LocalTargets local_targets(const torch::Tensor& targets, const VocabShard& shard) {
  const auto here = targets.ge(shard.first).logical_and(targets.lt(shard.first + shard.size));
  return {(targets - shard.first).masked_fill(here.logical_not(), 0), here};
}

void check_logits(const torch::Tensor& logits, const torch::Tensor& targets,
                  const VocabShard& shard, const char* what) {
  if (logits.dim() != 2 || logits.size(1) != shard.size)
    throw std::invalid_argument(std::string(what) + ": logits must be (N, " +
                                std::to_string(shard.size) + "), this rank's words");
  if (targets.dim() != 1 || targets.size(0) != logits.size(0) ||
      targets.scalar_type() != torch::kLong)
    throw std::invalid_argument(std::string(what) + ": targets must be int64 (N)");
}

struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits,
                               const torch::Tensor& targets, const torch::Tensor& ignored,
                               VocabShard shard, std::shared_ptr<ProcessGroup> group) {
    const auto f = logits.to(torch::kFloat);
    auto r = vocab_parallel_lse(f, targets, shard, group);
    auto loss = (r.lse - r.target).masked_fill(ignored, 0.0);
    ctx->save_for_backward({f, targets, ignored, r.lse});
    ctx->saved_data["first"] = shard.first;
    ctx->saved_data["size"] = shard.size;
    ctx->saved_data["dtype"] = logits.scalar_type();
    return loss;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &f = saved[0], &targets = saved[1], &ignored = saved[2], &lse = saved[3];
    VocabShard shard;
    shard.first = ctx->saved_data["first"].toInt();
    shard.size = ctx->saved_data["size"].toInt();
    // d loss_i / d logit_ij = softmax_ij - [j is target i], on this rank's columns.
    auto d = (f - lse.unsqueeze(1)).exp();
    const auto t = local_targets(targets, shard);
    d.scatter_add_(1, t.column.unsqueeze(1), -t.here.to(torch::kFloat).unsqueeze(1));
    const auto g = grads[0].to(torch::kFloat).masked_fill(ignored, 0.0);
    d.mul_(g.unsqueeze(1));
    return {d.to(ctx->saved_data["dtype"].toScalarType()), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

VocabShard VocabShard::of(int64_t total, int rank, int n) {
  if (total < 1 || n < 1 || rank < 0 || rank >= n)
    throw std::invalid_argument("VocabShard::of: a vocabulary of " + std::to_string(total) +
                                " words, rank " + std::to_string(rank) + " of " +
                                std::to_string(n));
  VocabShard s;
  s.total = total;
  const int64_t each = (total + n - 1) / n;
  for (int r = 0; r < n; ++r) {
    const int64_t first = std::min(total, r * each);
    s.sizes.push_back(std::min(total, first + each) - first);
  }
  s.first = std::min(total, rank * each);
  s.size = s.sizes[static_cast<size_t>(rank)];
  return s;
}

VocabSplit VocabSplit::over(int64_t total, std::shared_ptr<ProcessGroup> group) {
  if (!group)
    throw std::invalid_argument("VocabSplit::over: no group given");
  auto shard = VocabShard::of(total, group->rank(), group->size());
  return {std::move(shard), std::move(group)};
}

torch::Tensor vocab_parallel_embedding(const torch::Tensor& weight, const torch::Tensor& ids,
                                       const VocabShard& shard,
                                       const std::shared_ptr<ProcessGroup>& group,
                                       int64_t scatter_dim) {
  if (weight.dim() != 2 || weight.size(0) != shard.size)
    throw std::invalid_argument("tp::vocab_parallel_embedding: the table must hold this rank's " +
                                std::to_string(shard.size) + " rows");
  const auto t = local_targets(ids, shard);
  auto rows = at::embedding(weight, t.column);
  rows = rows.masked_fill(t.here.logical_not().unsqueeze(-1), 0.0);
  return scatter_dim >= 0 ? reduce_scatter_to_group(rows, scatter_dim, group)
                          : reduce_from_group(rows, group);
}

LogSumExpAndTarget vocab_parallel_lse(const torch::Tensor& logits, const torch::Tensor& targets,
                                      const VocabShard& shard,
                                      const std::shared_ptr<ProcessGroup>& group) {
  check_logits(logits, targets, shard, "tp::vocab_parallel_lse");
  const int64_t n = logits.size(0);
  const auto f = logits.to(torch::kFloat);
  // The largest logit of each position over the whole vocabulary (-inf on a rank with none).
  auto top = shard.size > 0 ? std::get<0>(f.max(1)).contiguous()
                            : at::full({n}, -std::numeric_limits<float>::infinity(), f.options());
  if (group->size() > 1)
    all_reduce(*group, top, ReduceOp::kMax, "tp vocab_parallel_lse max")->wait();
  // Each rank's sum of exp(logit - top) and its target logits (0 where another holds the
  // target), summed over the group in one all-reduce.
  const auto t = local_targets(targets, shard);
  auto sums = at::zeros({2, n}, f.options());
  if (shard.size > 0) {
    sums[0] = (f - top.unsqueeze(1)).exp().sum(1);
    sums[1] = f.gather(1, t.column.unsqueeze(1)).squeeze(1).masked_fill(t.here.logical_not(), 0.0);
  }
  if (group->size() > 1)
    all_reduce(*group, sums, ReduceOp::kSum, "tp vocab_parallel_lse sums")->wait();
  return {sums[0].log() + top, sums[1]};
}

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits,
                                           const torch::Tensor& targets, const VocabShard& shard,
                                           const std::shared_ptr<ProcessGroup>& group,
                                           int64_t ignore_index) {
  check_logits(logits, targets, shard, "tp::vocab_parallel_cross_entropy");
  const auto ignored = targets.eq(ignore_index);
  const auto valid = targets.ge(0).logical_and(targets.lt(shard.total));
  if (!valid.logical_or(ignored).all().item<bool>())
    throw std::invalid_argument("tp::vocab_parallel_cross_entropy: a target is outside [0, " +
                                std::to_string(shard.total) + ")");
  return VocabParallelCrossEntropy::apply(logits, targets.masked_fill(ignored, 0), ignored, shard,
                                          group);
}

}  // namespace fsdp::tp
