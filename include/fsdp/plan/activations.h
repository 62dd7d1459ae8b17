// The activation memory of a training step, as the planner (fsdp::plan, issue 26) models it: the
// model's forward is a chain of pieces (the root's part before the blocks, each block, the root's
// part after them, loss included), and each piece is described by four byte counts, measured by
// running that piece once at a small size with the tracking allocator and scaled in micro-batch
// rows B and sequence length T.
//
// Why measured rather than derived from the module's code: what autograd keeps for backward
// depends on every op's derivative formula and on the kernels ATen picks (CPU flash attention
// keeps its output and log-sum-exp, a bias add keeps nothing, a .contiguous() keeps a copy), so a
// formula written from the model's source is right only until someone edits the model. One
// forward and backward of one piece at three sizes (B,T), (2B,T), (B,2T) gives the three
// coefficients of bytes = c + a·B·T + q·B·T², which is exact for everything a transformer keeps
// (per-token tensors, and attention scores where a kernel materialises them).
#pragma once

#include <torch/types.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <fsdp/activation_checkpoint.h>
#include <fsdp/plan/tp_traffic.h>

namespace fsdp {
class ProcessGroup;
}

namespace fsdp::plan {

/// bytes(B, T) = c + a·B·T + q·B·T², rounded to the byte.
struct Scaling {
  double c = 0, a = 0, q = 0;
  int64_t at(int64_t b, int64_t t) const;
  /// The coefficients through three measurements at (b, t), (2b, t) and (b, 2t).
  static Scaling fit(int64_t b, int64_t t, double at_bt, double at_2b, double at_2t);
};

/// One piece of the chain at one size, in bytes of the activations category (gradients of
/// parameters apart: the engine counts those as kGrads).
struct PieceBytes {
  /// Live after its forward, above what was live before it: what it keeps for backward, its
  /// output included (the next piece reads it; its own input is the previous piece's output).
  int64_t saved = 0;
  /// The forward's high-water mark above what was live before it.
  int64_t forward_peak = 0;
  /// The output's bytes (part of saved).
  int64_t output = 0;
  /// The backward, cut where each parameter gradient is accumulated: in each segment the
  /// activations' high-water mark above what was live when the backward began (the gradient of
  /// the output included), and the bytes of the gradients accumulated before it. Gradients grow
  /// while activations shrink, so the highest sum can be in any segment; the activations of a
  /// segment scale with the micro-batch, its gradients do not, which is why they are kept apart.
  struct Segment {
    int64_t activations = 0;
    int64_t grads = 0;
  };
  std::vector<Segment> backward;
  /// How many of those segments run before the gradient reaches the piece's unit output (the
  /// post piece: the loss's backward, before the root's backward hook issues its prefetch).
  int64_t segments_before_output = 0;
  /// Freed by its backward: what was live when it began (saved, the output's gradient) minus
  /// what it leaves (the gradient of its input).
  int64_t backward_release = 0;
  /// The segment with the highest activations + gradients ({0, 0} if none).
  Segment backward_peak() const;
  /// What it issued on the pieces' tensor-parallel group (CalibrationPieces::group; zeros
  /// without one).
  PieceTraffic traffic;
};

/// A piece's counts as functions of (B, T) (a segment's gradients are the same at every size).
struct PieceScaling {
  Scaling saved, forward_peak, output, backward_release;
  std::vector<std::pair<Scaling, int64_t>> backward;
  int64_t segments_before_output = 0;
  TrafficScaling forward_traffic, backward_traffic;
  PieceBytes at(int64_t b, int64_t t) const;
};

/// The chain of a model whose forward is pre -> block 0 -> ... -> block L-1 -> post (loss), all
/// blocks alike: the shape of every model sharded one unit per block (fsdp_models' GPT and Llama,
/// torchtitan's). Blocks have one entry per CheckpointMode, as the unit's option changes what its
/// forward keeps.
struct ActivationModel {
  PieceScaling pre, post;
  /// The parameters (by name) whose gradients the post piece makes: the root's gradients that
  /// exist from the start of backward (the head's); the root's others come with the pre piece.
  std::vector<std::string> post_parameters;
  /// The parameters whose gradients the pre piece makes (the embeddings). One in both lists is
  /// tied (the head reuses the embedding matrix): autograd holds its head gradient in the
  /// backward's buffers (not yet a .grad, so counted as activations) until the embedding's adds
  /// to it.
  std::vector<std::string> pre_parameters;
  std::array<PieceScaling, 3> block;  // indexed by CheckpointMode
  const PieceScaling& block_with(CheckpointMode mode) const {
    return block[static_cast<size_t>(mode)];
  }
  /// The size of the tensor-parallel group the pieces were split over (1: none).
  int tp_ways = 1;
  /// What each piece issues on that group in one micro-batch of b rows of t tokens.
  TensorParallelTraffic tp_traffic(int64_t b, int64_t t) const;
};

/// How to run each piece for calibration, on real tensors at the caller's width. Each function
/// runs under the caller's grad mode and must use the module's real parameters (requiring grad
/// where they train), so that autograd keeps what it keeps in training.
struct CalibrationPieces {
  /// (B, T) -> the input of the first block (e.g. the embeddings of random token ids).
  std::function<torch::Tensor(int64_t b, int64_t t)> pre;
  /// One block: its input -> its output. `t` is the sequence length (position tables).
  std::function<torch::Tensor(const torch::Tensor& x, int64_t t)> block;
  /// The last block's output -> the root's output (the logits): the rest of the root's forward.
  std::function<torch::Tensor(const torch::Tensor& x, int64_t t)> head;
  /// The root's output -> the scalar loss the trainer calls backward on (outside every unit).
  std::function<torch::Tensor(const torch::Tensor& out, int64_t t)> loss;
  /// The model's parameters, named as in the model the planner describes (the root's names
  /// must match): their gradients are counted as gradients (retagged while measuring).
  std::vector<std::pair<std::string, torch::Tensor>> parameters;
  /// The tensor-parallel group the pieces' split layers communicate on (a fsdp::local_group of
  /// the run's tensor-parallel size when planning), or null: its collectives are counted per
  /// piece, forward and backward (PieceBytes::traffic, ActivationModel::tp_traffic).
  std::shared_ptr<ProcessGroup> group;
};

/// The input of a block or of the head at (b, t), as the chain gives it: a block's output (in the
/// blocks' dtype), detached into a leaf that requires grad (its gradient is the "gradient of the
/// input" a piece leaves behind).
torch::Tensor calibration_input(const CalibrationPieces& pieces, int64_t b, int64_t t);

/// Measures the pieces at (b, t), (2b, t) and (b, 2t) and fits each count. The sizes must be
/// large enough for ATen's kernels to take their general paths: below ~128 tokens (b·t) some
/// backward kernels keep fewer temporaries, and a fit from there under-predicts larger sizes
/// (measured: a 512-token GPT step's loss backward 1.5 MB low from (1, 16); exact from (2, 64)).
/// Needs the tracking
/// allocator (fsdp::memory::install_tracking_allocator); block checkpoint modes are measured
/// through fsdp::checkpoint, the function the engine uses for a unit's option. Throws if the
/// allocator is not installed.
ActivationModel calibrate_activations(const CalibrationPieces& pieces, int64_t b = 2,
                                      int64_t t = 64);

/// The calibration's measurements at one size: each piece run once at (b, t), blocks in every
/// checkpoint mode (calibrate_activations takes three of these and fits them).
struct ActivationSample {
  int64_t b = 0, t = 0;
  PieceBytes pre, post;
  std::array<PieceBytes, 3> block;                           // indexed by CheckpointMode
  std::vector<std::string> pre_parameters, post_parameters;  // as in ActivationModel
  int tp_ways = 1;                                           // as in ActivationModel
};
ActivationSample measure_activations(const CalibrationPieces& pieces, int64_t b, int64_t t);

/// A calibration of a narrowed copy of the model: every width (the model dimension, the
/// feed-forward width, each head's dimension; the vocabulary where it divides) divided by
/// `narrowing`, the head counts kept.
struct NarrowedCalibration {
  int64_t narrowing = 1;
  ActivationModel model;
};

/// The calibration at full width (narrowing 1) from narrowed copies of the model: a sample of the
/// widest (narrowing k1, at one size) and calibrations of two narrower ones (k2, k3).
///
/// Why: a one-block model of Llama-70B's widths has 1.4 G parameters, and a calibration runs
/// ~20 passes of it at a few hundred tokens; in bf16 on a CPU without AVX-512 BF16 (matmuls
/// ~10-36x slower than fp32's) that took more than 10 minutes for 13B's widths. Narrowed 16x and
/// more it takes seconds, and nothing is lost, because of what the counts are made of. With the
/// head counts kept, every tensor a transformer piece allocates is a product of at most two
/// widths: a parameter's gradient or a weight-sized temporary (two: dim x ffn), a per-token
/// tensor (one: B x T x dim, B x T x vocab), or none (the attention scores B x H x T x T and
/// log-sum-exp B x H x T, RoPE's tables are per head dimension: one). In the narrowing's inverse
/// u = 1/k each count is then x0 + x1 u + x2 u^2, and the per-token parts (the coefficients of
/// B·T and B·T² in Scaling) have no u^2: they are straight lines in u, which the two narrower
/// calibrations give exactly; the widest sample, less those lines at its u, gives the constant
/// there, the third point of its parabola. The widest copy, the costly one, runs at one size
/// instead of three. The pieces must take the same path at each narrowing (same backward
/// segments and parameters with gradients; checked). tests/test_plan.cpp holds the result to a
/// calibration at full width, count by count, where narrowing_is_exact().
ActivationModel extrapolate_to_full_width(const ActivationSample& widest, int64_t widest_narrowing,
                                          const NarrowedCalibration& narrower,
                                          const NarrowedCalibration& narrowest);

/// Whether extrapolate_to_full_width is exact for pieces computing in `dtype` on this CPU. fp32:
/// yes. bf16 and fp16: only where ATen runs its own kernels for them (CPUs without AVX-512, or
/// ONEDNN_MAX_CPU_ISA=AVX2). Where ATen hands them to oneDNN (AVX-512 CPUs), oneDNN's copies in
/// its blocked layouts are padded to its block sizes, which no polynomial in the width follows:
/// a bf16 Llama block of width 128 narrowed 2x, 4x and 8x extrapolated up to 234 kB of 1.78 MB
/// off on such a CPU (AVX-512 BF16, 2026-11-28).
bool narrowing_is_exact(torch::ScalarType dtype);

/// One piece measured once: runs forward(x0) where x0 = make_input() (not counted), keeps the
/// output, then backward from a gradient of ones (none if the output needs no gradient, e.g.
/// frozen embeddings: then it has no backward segments and releases what it saved). Exposed for
/// tests.
/// `with_grads` receives the names of the parameters that got a gradient; `group`'s collectives
/// in the forward and the backward are counted (PieceBytes::traffic).
PieceBytes measure_piece(const std::function<torch::Tensor()>& make_input,
                         const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                         const std::vector<std::pair<std::string, torch::Tensor>>& parameters,
                         std::vector<std::string>* with_grads = nullptr,
                         ProcessGroup* group = nullptr);

}  // namespace fsdp::plan
