// Tensor parallelism's collectives in a training step, as the planner (fsdp::plan) counts them:
// what each piece of the chain (activations.h: the part before the blocks, one block, the rest
// with the loss) issues on the tensor-parallel group in one micro-batch, forward and backward.
//
// Counted, not written down: the split layers' forwards issue them (Megatron's f and g, sequence
// parallelism's gathers and reduce-scatters, the vocabulary's all-reduces per chunk of the
// loss, the norms' weight gradients summed over the group), and which ones depends on the
// model, the options and the loss. The activation calibration runs each piece at three sizes
// on a model split over a fsdp::local_group of the tensor-parallel size, whose CommStats count
// each call with the bytes the real group's would have (CalibrationPieces::group), and fits the
// counts as it fits the bytes it keeps (TrafficScaling).
#pragma once

#include <array>
#include <cstdint>

#include <fsdp/activation_checkpoint.h>
#include <fsdp/distributed/comm_stats.h>

namespace fsdp::plan {

/// One piece's collectives on the tensor-parallel group in one micro-batch.
struct PieceTraffic {
  CommStats forward;
  /// Its backward: a checkpointed block's includes what its recomputation issues again.
  CommStats backward;
};

struct TensorParallelTraffic {
  /// The tensor-parallel group's size; 1: no tensor parallelism (and no traffic).
  int ways = 1;
  PieceTraffic pre, post;
  std::array<PieceTraffic, 3> block;  // indexed by CheckpointMode
  const PieceTraffic& block_with(CheckpointMode mode) const {
    return block[static_cast<size_t>(mode)];
  }
};

/// Bytes of a CommStats as fsdp-train's tp_bytes counts them (each collective's buffer once:
/// the all-reduce's tensor, the all-gather's output, the reduce-scatter's input).
int64_t buffer_bytes(const CommStats& stats);

/// The calls and bytes of the three kinds of collective (all-reduce, all-gather,
/// reduce-scatter), each c + p·T + a·B·T in the micro-batch's rows B and sequence T: a
/// collective's tensor is per position (B·T: the hidden states, the loss's per-position sums),
/// per position of one sequence (T: a position table split along the sequence) or of the
/// weights alone (a norm's gradient), never per pair of positions. Three measurements at (b, t),
/// (2b, t) and (b, 2t) give the three coefficients exactly. (Calls follow the same form where
/// they are per piece; the loss's all-reduces per chunk of positions, ceil(B·T / chunk) of them,
/// do not, and are then counted at the calibration's sizes: their bytes stay exact.)
struct TrafficScaling {
  struct Line {
    double c = 0, p = 0, a = 0;
    int64_t at(int64_t b, int64_t t) const;
  };
  // all-reduce calls, bytes; all-gather calls, bytes; reduce-scatter calls, bytes.
  std::array<Line, 6> counts;

  CommStats at(int64_t b, int64_t t) const;
  static TrafficScaling fit(int64_t b, int64_t t, const CommStats& at_bt, const CommStats& at_2b,
                            const CommStats& at_2t);
  /// The six counts of `stats`, in the order of `counts`.
  static std::array<int64_t, 6> values(const CommStats& stats);
};

}  // namespace fsdp::plan
