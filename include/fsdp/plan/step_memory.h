// A training step's memory on one rank, predicted (fsdp::plan, issue 26): the engine's schedule
// replayed on byte counters. Every allocation the engine makes for a unit (its gathered
// parameters, the cast or encoded copy it sends, its unsharded gradients, the reduce-scatter's
// input and output, a reshard-to-k block, an offload staging copy) is an event at the point of
// the step where the engine makes it, in the order the prefetcher and the rate limiter issue
// them; the activations come from an ActivationModel. The counters are the categories
// fsdp::memory measures, and the prediction is their values at the highest total, with the
// moment it happens.
//
// The model's shape is the one fsdp_models::parallelize_* makes: units[0..L-1] are blocks run
// in that order, units.back() is the root ("") holding the rest (embeddings before the blocks,
// final norm, head and loss after them).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <fsdp/activation_checkpoint.h>
#include <fsdp/core/memory.h>
#include <fsdp/fully_shard.h>
#include <fsdp/mixed_precision.h>
#include <fsdp/plan/activations.h>
#include <fsdp/plan/model_states.h>
#include <fsdp/plan/units.h>

namespace fsdp::plan {

struct StepOptions {
  /// Strategy, world, dtypes, offload and optimizer (what model_states needs).
  StateOptions states;
  /// FullyShardOptions of the blocks (the root never reshards after forward).
  std::optional<bool> reshard_after_forward;
  int reshard_after_forward_size = 0;
  bool forward_prefetch = true;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kBackwardPre;
  int max_inflight_all_gathers = 2;
  GatherFormat gather_format = GatherFormat::kComputeDtype;
  int64_t int8_block_size = 256;
  /// MixedPrecisionPolicy::reduce_format and error_feedback: an int8 reduce-scatter keeps its
  /// encoded buffers in flight and, with error feedback, a residual of the unit's unsharded
  /// gradient size (in the reduce dtype) between steps.
  ReduceFormat reduce_format = ReduceFormat::kReduceDtype;
  bool error_feedback = true;
  /// Every unit stepped by its post-reduce hook in the last micro-batch's backward, its
  /// gradients dropped there (fsdp::set_post_reduce_hook, fsdp-train's
  /// fsdp.optimizer_in_backward): a unit's hook runs at the next unit's reduction (two later
  /// under kHybridShard, whose all-reduce follows the reduce-scatter), the rest at the end.
  bool optimizer_in_backward = false;
  /// Per block (units[0..L-1]); missing entries are kNone.
  std::vector<CheckpointMode> checkpoint;
  /// The micro-batch (rows B, sequence T) and how many run per step.
  int64_t batch_rows = 1;
  int64_t seq_len = 1;
  int micro_batches = 1;
  /// Micro-batches reduce-scatter every time (true) or keep unsharded gradients until the
  /// last one (fsdp::set_requires_gradient_sync(false) on the others).
  bool sync_every_micro_batch = false;
  /// Tracked bytes outside the model (kOther) live through the step, e.g. the input batch.
  int64_t other_bytes = 0;
  /// Gloo stages each all-gather call in flat buffers of its own, on its worker threads (so in
  /// kOther): (1 + 1/N) x the call's output, calls of at most all_gather_bucket_bytes
  /// (FullyShardOptions). Counted from a gather's issue to its wait. False for NCCL.
  bool gloo_staging = true;
  /// Gloo has no reduce-scatter: it is an all-to-all into a buffer the size of the input, kept
  /// until the collective is waited for (src/distributed/collectives.cpp). False for NCCL.
  bool gloo_reduce_scatter = true;
  int64_t all_gather_bucket_bytes = int64_t{4} << 20;
};

enum class StepPhase { kForward, kBackward, kOptimizer };
const char* to_string(StepPhase phase);

/// Where in the step an event happens.
struct Moment {
  StepPhase phase = StepPhase::kForward;
  std::string unit;  // the unit's path ("" the root)
  std::string what;  // "compute", "gather", "reduce", "recompute"...
  int micro_batch = 0;
};

struct MemoryPrediction {
  /// Bytes by fsdp::memory::Category at the highest total; they sum to `peak`.
  memory::CategoryBytes at_peak;
  int64_t peak = 0;
  /// The peak if Gloo's staging buffers (StepOptions::gloo_staging) are already freed when the
  /// step peaks: a gather in flight during a unit's compute usually finishes before the compute's
  /// high-water mark, but not always, so a measured peak lies between the two (equal to `peak`
  /// without staging).
  int64_t peak_without_staging = 0;
  Moment moment;
  /// Each category's own highest value during the step.
  memory::CategoryBytes category_peaks;
  /// The model states between steps (model_states()).
  RankStates states;
  /// Every event of the replay: where it happened and the counters after it (a spike's entry
  /// holds its high-water mark).
  std::vector<std::pair<Moment, memory::CategoryBytes>> timeline;

  /// The highest predicted total at the moments fsdp::memory labels `label` (the engine's
  /// "forward h3", "backward (root)"; see moment_label), -1 if none: how close to the peak the
  /// prediction puts a moment a run measured.
  int64_t highest_at(const std::string& label) const;
  /// The category holding the most bytes at the peak.
  memory::Category largest_category() const;
};

/// The label fsdp::memory::at_peak_moment() gives the same moment: "<phase> <unit>", the root
/// as "(root)"; "optimizer" for the optimizer step.
std::string moment_label(const Moment& moment);

/// CPU offload on an accelerator: the sharded parameters, their gradients and the optimizer
/// state live in host memory (the categories kParams, kGrads, kOptimizer), the rest on the
/// device. The device's side of `p`: the highest total of the other categories over the step,
/// with their values and moment there. (On a CPU host and device memory are one, and
/// predict_step_memory's peak is the answer.)
MemoryPrediction device_side(const MemoryPrediction& p);

/// The peak of one steady-state training step (optimizer state already created, gradients set
/// to none before it) on `rank`. Throws for a unit list that is not blocks then the root, and for
/// options that fully_shard would refuse.
MemoryPrediction predict_step_memory(const std::vector<UnitInfo>& units, const StepOptions& options,
                                     const ActivationModel& activations, int rank);

}  // namespace fsdp::plan
