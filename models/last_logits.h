// The models' logits forwards (GPT and Llama alike): which positions' logits a forward computes,
// and the padding and gather both apply under sequence parallelism. Sampling the next token needs
// the last position's logits only: the head's matmul over every position of a prompt is most of a
// small model's forward (SmolLM2's 49,152-word head against 2 blocks), and a sampler reads one row.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>

namespace fsdp {
class ProcessGroup;
}

namespace fsdp_models {

/// forward(idx, LastLogits{k}): the logits (B, k, vocab) of idx's last k positions (1 <= k <= T),
/// the same values as forward(idx)'s last k up to the matmul's rounding. A forward argument
/// without tensors (fsdp/detail/tensor_visit.h).
struct LastLogits {
  int64_t positions = 1;

  /// The first of the last `positions` of t: t - positions, once 1 <= positions <= t is
  /// checked (a c10::Error naming `model` otherwise).
  int64_t first_of(int64_t t, const char* model) const;

  template <typename F>
  void visit_tensors(F&&) {}
};

/// idx (B, T) padded with zeros on the right to a multiple of the sequence-parallel group's
/// size (null: as it is). Sequence parallelism splits T evenly, and no earlier position of a
/// causal model attends to the padding: forwards then keep the first T positions' logits.
at::Tensor pad_to_group(const at::Tensor& idx,
                        const std::shared_ptr<fsdp::ProcessGroup>& sequence_group);

/// Positions [from, from + count) of the normed hidden states (B, T', C) a logits forward
/// projects: this rank's T' positions gathered over the sequence-parallel group first (null:
/// all of them already), then narrowed, so that the head's matmul runs on those alone.
at::Tensor positions_of(const at::Tensor& normed,
                        const std::shared_ptr<fsdp::ProcessGroup>& sequence_group, int64_t from,
                        int64_t count);

}  // namespace fsdp_models
