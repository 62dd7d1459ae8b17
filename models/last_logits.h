// What sampling the next token needs from a model's forward: the logits of the last positions
// only. The head's matmul over every position of a prompt is most of a small model's forward
// (SmolLM2's 49,152-word head against 2 blocks), and a sampler reads one row of it.
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

  template <typename F>
  void visit_tensors(F&&) {}
};

/// idx (B, T) padded with zeros on the right to a multiple of the sequence-parallel group's
/// size (null: as it is). Sequence parallelism splits T evenly, and no earlier position of a
/// causal model attends to the padding: forwards then keep the first T positions' logits.
torch::Tensor pad_to_group(const torch::Tensor& idx,
                           const std::shared_ptr<fsdp::ProcessGroup>& sequence_group);

}  // namespace fsdp_models
