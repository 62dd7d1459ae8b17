// The language-model head and its cross-entropy, fused and computed over chunks of positions,
// so that the [positions x vocab] logits and their softmax are never alive at once.
//
// Why: in fine-tuning most of the activation peak is the fp32 logits and their softmax (49,152
// words for SmolLM2: 410-430 MiB of a 558 MiB QLoRA peak, docs/trainer.md). Forward keeps only
// each position's log-sum-exp (one float); backward recomputes a chunk's logits from the hidden
// states and the head's weight, turns them into that chunk's gradient, and drops them. The cost
// is the head's matmul done twice.
#pragma once

#include <torch/types.h>

#include "layers.h"

namespace fsdp_models {

/// sum_i w_i * CE(hidden_i . weight^T, targets_i) / denominator, over the N positions of
/// hidden (N, C) against weight (V, C), targets (N) int64 in [0, V) or ignore_index (weight 0),
/// weights (N) float (undefined: all 1). With weights undefined and denominator N it is
/// torch::nn::functional::cross_entropy's mean; with a 0/1 mask and the number of answer
/// tokens it is the fine-tuning loss. The logits are computed in hidden's dtype (as the head's
/// Linear would) and taken to float32 for the softmax; gradients flow to hidden and weight
/// (whichever requires them), the weight's accumulated over the chunks in float32. `chunk`
/// positions at a time (>= 1).
torch::Tensor chunked_linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                           const torch::Tensor& targets,
                                           const torch::Tensor& weights, double denominator,
                                           int64_t chunk, int64_t ignore_index = -100);

/// What a model's loss forward (forward(idx, LossSpec)) computes: the loss above over every
/// position of the batch, targets (B, T) and weights (B, T) or undefined (neither requires
/// grad). fsdp::forward sees its tensors through visit_tensors.
struct LossSpec {
  torch::Tensor targets;
  torch::Tensor weights;
  double denominator = 1;
  int64_t chunk = 1;

  template <typename F>
  void visit_tensors(F&& f) {
    f(targets);
    f(weights);
  }
};

/// The loss of LossSpec from the normalised hidden states (B, T, C) and the model's head: the
/// tied matrix `tied` (V, C) when defined, else `head`. Chunked when the head is a plain matrix;
/// a head with LoRA adapters, NF4 storage or a bias gives its whole logits, then the loss (the
/// same value).
torch::Tensor head_loss(const torch::Tensor& normed, const torch::Tensor& tied, Linear& head,
                        const LossSpec& spec);

}  // namespace fsdp_models
