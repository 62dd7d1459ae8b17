// The language-model head and its cross-entropy, fused and computed over chunks of positions,
// so that the [positions x vocab] logits and their softmax are never alive at once.
//
// Why: unfused, the fp32 logits, their softmax and its gradient are alive at once: for SmolLM2's
// 49,152 words and 4 conversations of ~110 tokens, 3 x 83 MiB. Fused, forward computes a
// chunk's logits, its loss and, when gradients are wanted, its gradients (the loss is a scalar:
// backward only scales them by its upstream gradient), then drops the chunk. No matmul is done
// twice: the cost against the unfused head is only the weight read once per chunk, which is why
// chunks are not made smaller than auto_loss_chunk().
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
/// positions at a time (>= 1); positions of weight 0 are left out before chunking (no logits,
/// a zero gradient). With `split` (tensor parallelism), weight holds this rank's words
/// of a vocabulary of split->shard.total, targets are in [0, total), and each chunk's softmax
/// is taken over every rank's logits through two all-reduces of its positions
/// (fsdp::tp::vocab_parallel_lse), never gathering them; hidden's gradient is then this rank's
/// part (pass tp::copy_to_group(hidden), whose backward sums the parts).
torch::Tensor chunked_linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                           const torch::Tensor& targets,
                                           const torch::Tensor& weights, double denominator,
                                           int64_t chunk, int64_t ignore_index = -100,
                                           const fsdp::tp::VocabSplit* split = nullptr);

/// The default chunk for a vocabulary of `vocab` words: the positions whose float32 logits take
/// 16 MiB, but at least 64 (SmolLM2: 85 positions, 16 MiB). Measured on the 49,152-word head
/// (440 positions, forward and backward, one thread, AMD EPYC with AVX-512 BF16): chunks of
/// 64-256 positions take 0.72-0.77x the unfused time in bf16 and 0.95-1.03x in fp32; 32 take
/// 0.94x (bf16), 8 take 2.1x: each chunk reads the whole weight twice.
int64_t auto_loss_chunk(int64_t vocab);

/// What a model's loss forward (forward(idx, LossSpec)) computes: the loss above over every
/// position of the batch, targets (B, T) and weights (B, T) or undefined (neither requires
/// grad). fsdp::forward sees its tensors through visit_tensors.
struct LossSpec {
  torch::Tensor targets;
  torch::Tensor weights;
  double denominator = 1;
  int64_t chunk = 0;  // positions per chunk; 0: auto_loss_chunk(vocab)

  template <typename F>
  void visit_tensors(F&& f) {
    f(targets);
    f(weights);
  }
};

/// The loss of LossSpec from the normalised hidden states (B, T, C) and the model's head: the
/// tied matrix `tied` (V, C) when defined, else `head`. Chunked when the head is a plain matrix;
/// a head with LoRA adapters, NF4 storage or a bias gives its whole logits, then the loss (the
/// same value). `split`: the vocabulary's split over a tensor-parallel group (the tied table's
/// or the head's vocab_split()), or nullptr. `sequence_gathered` (sequence parallelism):
/// `normed` was gathered from the ranks' positions by tp::gather_from_group, whose backward
/// already sums the parts of its gradient that each rank's words give.
torch::Tensor head_loss(const torch::Tensor& normed, const torch::Tensor& tied, Linear& head,
                        const LossSpec& spec, const fsdp::tp::VocabSplit* split = nullptr,
                        bool sequence_gathered = false);

}  // namespace fsdp_models
