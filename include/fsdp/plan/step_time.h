// A training step's time on one rank, predicted (fsdp::plan, issue 26), by the phases
// fsdp::StepProfiler measures: forward, backward (recomputation included), the all-gather and
// gradient-reduction waits compute did not hide, the optimizer step, offload I/O; with the bytes
// each kind of collective moves per step, counted as CommStats counts them.
//
// The compute of each piece of the chain (fsdp/plan/activations.h) is measured by running it at
// the run's micro-batch on this machine (time_pieces), the collectives by timing them on the
// run's own groups (measure_link): a model of the engine's schedule on top of measured rates,
// not a FLOP count, because on a CPU the non-matmul ops (norms, softmax over the vocabulary,
// attention) are a large, model-dependent share of a step.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <fsdp/distributed/process_group.h>
#include <fsdp/plan/activations.h>
#include <fsdp/plan/step_memory.h>
#include <fsdp/plan/tp_traffic.h>
#include <fsdp/plan/unit_overhead.h>
#include <fsdp/plan/units.h>

namespace fsdp::plan {

/// Seconds of one piece's forward and backward (the backward of a checkpointed block includes
/// its recomputation).
struct PieceTime {
  double forward = 0;
  double backward = 0;
};

struct ComputeTimes {
  PieceTime pre, post;
  std::array<PieceTime, 3> block;  // indexed by CheckpointMode
};

/// Times each piece at micro-batch (b, t): forward, then backward from a gradient of ones; the
/// mean of `repeats` runs after one warm-up. Run it where the job runs, at the same time on
/// every rank of a machine (ranks share its cores, caches and memory bandwidth).
ComputeTimes time_pieces(const CalibrationPieces& pieces, int64_t b, int64_t t, int repeats = 3);

/// time_pieces on each of `copies` at once, one thread each (each copy with parameters of its
/// own), the mean over them: what one process predicts for the ranks of a machine, which
/// compute at the same time and share its caches and memory bandwidth (a block's forward ran
/// 10-35% slower beside another than alone on this project's 2-core machines). Call with one
/// intra-op thread (at::set_num_threads(1)), so that each thread runs its ops itself.
ComputeTimes time_pieces_together(
    const std::vector<std::shared_ptr<const CalibrationPieces>>& copies, int64_t b, int64_t t,
    int repeats = 3);

/// One kind of collective on one group: seconds = calls x latency + bytes / bandwidth, bytes as
/// CommStats counts them (an all-gather's output, a reduce-scatter's input, an all-reduce's
/// tensor).
struct LinkCost {
  double latency_s = 0;
  double bytes_per_s = 0;
  double seconds(int64_t bytes, int64_t calls = 1) const;
};

struct LinkProfile {
  LinkCost all_gather, reduce_scatter, all_reduce;
};

/// Times each kind of collective on `group` at two sizes (the slowest rank's time, the median
/// of `repeats`) and fits latency and bandwidth. Every rank of the group calls it; a group of
/// one returns zeros.
LinkProfile measure_link(ProcessGroup& group, int64_t large_bytes = int64_t{4} << 20,
                         int repeats = 7);

/// The bytes one unit's collectives move on `rank` per gather and per reduction (as CommStats
/// counts them: the gather's output, the reduce-scatter's input).
struct UnitTraffic {
  int64_t gather_bytes = 0;
  int64_t reduce_bytes = 0;
};
UnitTraffic unit_traffic(const UnitInfo& unit, const StepOptions& options, int rank);

/// What a unit's collectives cost while a block computes, as a multiple of their time alone
/// (TimeInputs::comm_factor): every rank issues a gather and a reduction of the unit's sizes,
/// runs a block's forward and backward meanwhile, then waits; the time beyond the block's
/// compute alone (`compute_s`), over the collectives' time alone. 0: compute hides them; 1:
/// they cost what they cost alone; above 1: they slow the compute down more than that (on a CPU
/// whose cores run every rank, Gloo's copies and the compute compete for the same cores). Every
/// rank of `group` calls it at once.
double measure_comm_factor(ProcessGroup& group, const CalibrationPieces& pieces, int64_t b,
                           int64_t t, const UnitTraffic& traffic, const LinkProfile& link,
                           double compute_s, int repeats = 3);

struct TimeInputs {
  ComputeTimes compute;
  /// The shard group's collectives, and the replicate group's (hybrid_shard's all-reduce across
  /// blocks; no_shard's all-reduce over the world).
  LinkProfile shard, replicate;
  /// Tensor parallelism: what each piece issues on the tensor-parallel group per micro-batch at
  /// the run's (B, T) (ActivationModel::tp_traffic), and that group's collectives, latency
  /// included: they are on the critical path (each layer waits for its own), and the engine's
  /// unit overhead does not cover them.
  TensorParallelTraffic tp_traffic;
  LinkProfile tp;
  /// Seconds of one optimizer step on this rank's state (measured on it).
  double optimizer_s = 0;
  /// Each collective's time alone times this is what it adds to the step (measure_comm_factor).
  double comm_factor = 1;
  /// Collectives run beside compute on hardware of their own (NCCL on a GPU): a unit's gathers
  /// and reductions hide behind one unit's compute (the prefetched neighbour's), and only what
  /// exceeds it is exposed. Then comm_factor is not used.
  bool overlap = false;
  /// The engine's fixed cost per unit and micro-batch (unit_overhead.h). It includes the calls'
  /// latency: with it, the links' latencies should be zero.
  UnitOverhead overhead;
  /// Offload I/O (TimePrediction::offload_s). CPU offload copies each unit's parameter shard to
  /// the device for every gather and its gradient shard back, at `host_bytes_per_s` (0: no
  /// copy, the shards already live where they compute, as on a CPU). An optimizer state in a
  /// file is read and written once per step at the disk's rates (0: not counted).
  double host_bytes_per_s = 0;
  double disk_read_bytes_per_s = 0;
  double disk_write_bytes_per_s = 0;
};

struct TimePrediction {
  double forward_s = 0;
  double backward_s = 0;   // recomputation included
  double recompute_s = 0;  // of which recomputation
  double all_gather_exposed_s = 0;
  double reduce_exposed_s = 0;
  double optimizer_s = 0;
  /// Offload I/O, not overlapped with anything (an upper bound).
  double offload_s = 0;
  /// The engine's fixed costs (TimeInputs::overhead) over the step's units and micro-batches.
  double overhead_s = 0;
  /// Tensor parallelism's collectives (TimeInputs::tp_traffic), none hidden: the layers wait for
  /// them inside forward and backward (fsdp::StepProfiler counts them there).
  double tp_s = 0;
  double step_s = 0;
  /// Per step, as CommStats counts them.
  int64_t all_gather_bytes = 0;
  int64_t reduce_scatter_bytes = 0;
  int64_t all_reduce_bytes = 0;
  int64_t all_gather_calls = 0;
  /// On the tensor-parallel group, per step: every collective's buffer bytes (buffer_bytes,
  /// fsdp-train's tp_bytes) and calls, and the whole count by kind.
  int64_t tp_bytes = 0;
  int64_t tp_calls = 0;
  CommStats tp_traffic;
  /// Device <-> host copies and optimizer-state file reads and writes per step.
  int64_t offload_bytes = 0;
};

/// The step of predict_step_memory's schedule, timed. Throws as predict_step_memory.
TimePrediction predict_step_time(const std::vector<UnitInfo>& units, const StepOptions& options,
                                 const TimeInputs& inputs, int rank);

}  // namespace fsdp::plan
