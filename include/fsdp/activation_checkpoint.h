// Activation checkpointing: run a region without keeping its intermediate activations, and run
// it again in backward to get them back (LibTorch has no torch.utils.checkpoint).
//
// Per unit, it is an option: FullyShardOptions::activation_checkpointing. The unit's forward
// then keeps only its inputs (and, with kSelective, the outputs of its matrix products); when
// backward reaches the unit, the unit is gathered for its backward as usual and the forward runs
// again on those gathered parameters before the unit's backward: the recomputation costs no
// all-gather of its own (2 gathers per unit per step under kFullShard, 1 under kShardGradOp,
// with or without checkpointing). Random ops (dropout) draw the same numbers in the
// recomputation: the generators' states are saved before the forward and restored around the
// recomputation (the caller's random stream is left as it was).
//
// Modes:
//   kFull       keep the inputs only; the backward runs one more forward of the region.
//   kSelective  also keep the outputs of matrix products (mm, addmm, bmm, baddbmm) and of CPU
//               flash attention, recompute the rest (elementwise ops, norms, softmax...):
//               most of the compute of a transformer block is not repeated, most of its
//               activation memory still is not kept (torchtitan's "op" selective AC). The kept
//               outputs are copies (one memcpy per product in forward), so a region that
//               changes a product in place afterwards (linear adding its bias) is still exact.
//
// "Every k-th block" is a choice of which units get the option (fsdp-train's
// fsdp.ac_every). A unit nested inside a checkpointed unit is gathered once more for the
// recomputation (checkpoint the inner units instead).
#pragma once

#include <torch/types.h>

#include <array>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <fsdp/detail/enum_names.h>

namespace fsdp {

enum class CheckpointMode {
  kNone,
  kFull,
  kSelective,
};
template <>
struct EnumNames<CheckpointMode> {
  static constexpr const char* what = "activation checkpointing mode";
  static constexpr std::array<std::pair<CheckpointMode, const char*>, 3> names{{
      {CheckpointMode::kNone, "none"},
      {CheckpointMode::kFull, "full"},
      {CheckpointMode::kSelective, "selective"},
  }};
};

/// Runs fn(inputs) keeping only `inputs` (kFull) or also the matmul outputs (kSelective) for
/// backward; the backward runs fn again, with grad. fn must compute the same thing when run
/// again (the same module state; random ops are replayed). Parameters used inside fn get their
/// gradients as without checkpointing. When grad mode is off, or with kNone, it is fn(inputs).
/// If no input requires grad, the outputs still do (fn may use parameters).
std::vector<torch::Tensor> checkpoint(
    const std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>& fn,
    std::vector<torch::Tensor> inputs, CheckpointMode mode = CheckpointMode::kFull);

namespace detail {

using CheckpointFn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

/// The checkpointed region as an autograd node: `first` runs now (without grad), `again` in
/// backward. Returns first's outputs, connected to `inputs` through the node. `name`: whose
/// region it is (the unit), for the recomputation's trace span.
std::vector<torch::Tensor> checkpoint_apply(const CheckpointFn& first, CheckpointFn again,
                                            std::vector<torch::Tensor> inputs, CheckpointMode mode,
                                            std::string name = {});

}  // namespace detail
}  // namespace fsdp
