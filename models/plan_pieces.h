// Our model families run piece by piece for the planner's activation calibration
// (fsdp/plan/activations.h): the embeddings, one block, the head with the trainer's loss.
#pragma once

#include <torch/types.h>

#include <functional>
#include <optional>

#include <fsdp/plan/activations.h>
#include <fsdp/plan/hardware.h>

#include "gpt.h"
#include "llama.h"

namespace fsdp_models {

/// The loss the trainer takes of fp32 logits (B, T, V) for a micro-batch of b rows of t tokens.
using PlanLoss = std::function<torch::Tensor(const torch::Tensor& logits, int64_t b, int64_t t)>;

/// The trainer's loss computed by the model's fused head (loss(), chunked_loss.h), for runs
/// with training.loss_chunk >= 0. The calibration uses the run's chunk (capped at the run's
/// `positions` per micro-batch) as it is: what one chunk holds does not grow with the
/// positions, and the fit takes it as a constant, right at every length the run's batches
/// have. (Scaling the chunk with the calibration's positions, as before, was right at the
/// planned length only: fine-tuning's batches, padded to their own longest conversation, came
/// out 19-24 MB low on SmolLM2.) Where the calibration has fewer positions than the chunk, the
/// chunk is all of them, and the fit is approximate.
struct PlanFusedLoss {
  /// The loss of a micro-batch of b rows of t tokens (random targets of the vocabulary).
  std::function<LossSpec(int64_t b, int64_t t)> spec;
  int64_t chunk = 0;      // the run's (0: auto_loss_chunk of the vocabulary)
  int64_t positions = 1;  // the run's positions per micro-batch
};

/// The pieces of `model` (its first block stands for every block): blocks compute in
/// `block_dtype` (their input cast on entry, as fsdp::forward casts a unit's inputs) and return
/// `block_output` if set (MixedPrecisionPolicy::output_dtype), the root's parts in the dtype of
/// its parameters, the logits cast to fp32 before `loss`. With `fused`, the head piece is the
/// fused head and loss instead (`loss` is then unused). The model must hold real tensors (not
/// the meta device) and at least one block; its parameters are used as they are (convert them
/// to the compute dtypes first).
fsdp::plan::CalibrationPieces calibration_pieces(
    GPT& model, torch::ScalarType block_dtype, PlanLoss loss,
    std::optional<torch::ScalarType> block_output = std::nullopt,
    std::optional<PlanFusedLoss> fused = std::nullopt);
fsdp::plan::CalibrationPieces calibration_pieces(
    Llama& model, torch::ScalarType block_dtype, PlanLoss loss,
    std::optional<torch::ScalarType> block_output = std::nullopt,
    std::optional<PlanFusedLoss> fused = std::nullopt);

/// The largest power of two by which the planner's calibration may narrow `cfg`
/// (fsdp::plan::extrapolate_to_full_width): it divides the model and feed-forward widths and
/// leaves each head at least 2 dimensions (an even number: RoPE rotates pairs). 1 if none does.
int64_t max_narrowing(const GPTConfig& cfg);
int64_t max_narrowing(const LlamaConfig& cfg);

/// `cfg` with its widths divided by `k` (at most max_narrowing(cfg)): the model dimension, so
/// each head's dimension (the head counts are kept), the feed-forward width, and the vocabulary
/// if `vocab` (the caller checks that k divides it). Depth, context and the rest unchanged.
GPTConfig narrowed(GPTConfig cfg, int64_t k, bool vocab);
LlamaConfig narrowed(LlamaConfig cfg, int64_t k, bool vocab);

/// Forward FLOPs of a micro-batch of b rows of t tokens through each piece, for the planner's
/// data-sheet time model (fsdp/plan/hardware.h): the matrix products only, 2 per multiply-add,
/// attention's two products over the whole t x t (causal masking saves nothing in the kernels
/// we time). Selective checkpointing keeps every product, so it recomputes none of these.
/// `tp`: one rank's share under tensor parallelism over tp ranks (tensor_parallel.h: its heads,
/// its part of the MLP's width and of the vocabulary; Llama's kv heads whole where they do not
/// divide by tp).
fsdp::plan::PieceFlops piece_flops(const GPTConfig& cfg, int64_t b, int64_t t, int64_t tp = 1);
fsdp::plan::PieceFlops piece_flops(const LlamaConfig& cfg, int64_t b, int64_t t, int64_t tp = 1);

}  // namespace fsdp_models
