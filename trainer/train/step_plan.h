// fsdp-train's use of the planner (fsdp::plan, issue 26): the prediction of a run's per-rank
// memory from its config, before it starts (--plan, training.memory_budget), and the comparison
// with what the run measured.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fsdp/core/memory.h>
#include <fsdp/plan/activations.h>
#include <fsdp/plan/step_memory.h>
#include <fsdp/plan/step_time.h>
#include <fsdp/plan/units.h>

#include "config/config.h"

namespace fsdp_trainer {

/// What the planner needs to know about a run.
struct RunPlan {
  std::vector<fsdp::plan::UnitInfo> units;
  fsdp::plan::ActivationModel activations;
  fsdp::plan::StepOptions options;
  /// The pieces timed at the run's micro-batch (plan_run with time_compute).
  std::optional<fsdp::plan::ComputeTimes> compute;
  /// The one-block model's pieces (time_compute), for measurements with the job's groups.
  std::shared_ptr<const fsdp::plan::CalibrationPieces> pieces;
  /// `pieces` and the copies timed with it (plan_run's timing_copies), each with parameters of
  /// its own, so that several threads can time them at once.
  std::vector<std::shared_ptr<const fsdp::plan::CalibrationPieces>> timing_pieces;
};

/// The run's units (its model built on the meta device, as model_factory builds it: GPT or
/// Llama, or the fine-tuned pretrained model with LoRA/QLoRA), its activations calibrated on a
/// one-block model of the same widths in the compute dtype (fsdp/plan/activations.h; needs the
/// tracking allocator), and the step options of `config` on `world_size` ranks. `model_path`:
/// the fine-tuned model's file (fine-tuning only). `other_bytes`: tracked memory outside the
/// model at the start of a step (fsdp::memory kOther: the data). ConfigError as model_factory.
/// `time_compute`: also time the pieces at the run's micro-batch (every rank of a machine at
/// once), on `timing_copies` one-block models at once in this process
/// (fsdp::plan::time_pieces_together: what one process predicts for the ranks of its machine).
/// `before_timing` runs right before (a barrier, so that every rank times at once).
/// A model too large to calibrate in a second or two is calibrated on three narrowed copies
/// (fsdp::plan::extrapolate_to_full_width); for a one-block model above 16M parameters (with its
/// embeddings: SmolLM2-135M's has 32M) `progress` then gets a line as each starts and one when
/// all are done (fsdp-plan prints them on stderr). Smaller models say nothing, so that errors
/// found after the calibration stay one line.
using PlanProgress = std::function<void(const std::string& line)>;
///
/// With tensor parallelism (parallel.tp > 1, `world_size` the whole world) the plan is of one
/// rank of the 2-D mesh: the model split as the run splits it, over a fsdp::local_group in which
/// this process plays tensor-parallel rank `tp_rank` (0 has the most words of the vocabulary's
/// split); the units are that rank's parts, the step options' world the data-parallel axis
/// (world_size / tp, over which they are sharded), its activations those of the split blocks,
/// and the tensor-parallel group's collectives counted as the calibration runs them
/// (ActivationModel::tp_traffic, fsdp/plan/tp_traffic.h). Predict a rank with its data-parallel
/// rank.
RunPlan plan_run(const Config& config, int64_t vocab_size, const std::string& model_path,
                 int world_size, int local_world_size, const std::string& compute_dtype,
                 int64_t other_bytes, bool time_compute = false,
                 const std::function<void()>& before_timing = nullptr, int timing_copies = 1,
                 const PlanProgress& progress = nullptr, int tp_rank = 0);

/// Mean seconds per steady step by phase, as fsdp::StepProfiler measures them (forward and
/// backward without the waits inside them).
struct MeasuredTime {
  double forward = 0, backward = 0, all_gather_wait = 0, reduce_wait = 0, optimizer = 0, other = 0,
         step = 0;
  int64_t steps = 0;
};

/// Predicted (by `method`) next to measured, by phase, with the error of the step time.
std::string compare_time(const MeasuredTime& predicted, const MeasuredTime& m,
                         const std::string& method);

/// The prediction as fsdp-train prints it: the peak, its moment and the categories.
std::string describe_prediction(const fsdp::plan::MemoryPrediction& p);

/// What a run measured on one rank: the highest tracked peak of its steady steps (the optimizer
/// state exists), the categories at it and its moment.
struct MeasuredPeak {
  int64_t peak = 0;
  fsdp::memory::CategoryBytes at_peak;
  std::string moment;
  int64_t steps = 0;
  /// The micro-batch's sequence length in that step (fine-tuning pads each batch to its longest
  /// conversation; pretraining: training.seq_len).
  int64_t seq_len = 0;
  /// Each category's own highest value over those steps (whenever it peaked).
  fsdp::memory::CategoryBytes category_peaks;
};

/// Predicted next to measured, by category, with the error of the peak.
std::string compare_prediction(const fsdp::plan::MemoryPrediction& p, const MeasuredPeak& m);

/// Both as JSON (plan.json in the run directory): {"predicted": {"peak", "peak_without_staging",
/// "moment", "categories": {name: bytes}, "category_peaks": {name: bytes}, "moments": {label:
/// the highest predicted total there}}, "measured": {"peak", "moment", "steps", "seq_len",
/// "categories", "category_peaks"}}. Moments are
/// fsdp::memory labels; category names fsdp::memory::to_string's.
/// With `time` (seconds by phase, predicted) and `measured_time`: a "time" object too,
/// {"method", "predicted": {phase: s}, "measured": {phase: s, "steps"}}; with `traffic`, a
/// "traffic" object: the bytes per step the planner predicts each kind of collective moves
/// ({"all_gather", "reduce_scatter", "all_reduce"}, as CommStats counts them, on the units'
/// groups; and "tp": {"bytes", and each kind's bytes and calls} on the tensor-parallel group).
std::string plan_json(const fsdp::plan::MemoryPrediction& p, const MeasuredPeak& m,
                      const std::optional<MeasuredTime>& time = std::nullopt,
                      const MeasuredTime& measured_time = {}, const std::string& method = "",
                      const std::optional<fsdp::plan::TimePrediction>& traffic = std::nullopt);

/// training.memory_budget exceeded: a one-paragraph warning naming the largest categories at the
/// predicted peak and the first of the cheaper configurations (activation checkpointing, a
/// smaller micro-batch, full_shard, bf16 moments, offload) that the planner predicts to fit.
std::string budget_warning(const RunPlan& plan, const fsdp::plan::MemoryPrediction& p,
                           int64_t budget, int rank,
                           const std::string& budget_name = "training.memory_budget");

}  // namespace fsdp_trainer
