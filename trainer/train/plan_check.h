// The planner's side of a run (fsdp-train --plan, training.memory_budget): the prediction made
// before step 1, what this rank measured in its steady steps, and the comparison of the two at
// the end. One of the trainer's parts: the trainer hands it each step's measurements and asks
// for the comparison; it knows nothing of how a step is run.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <fsdp/observe/step_profiler.h>
#include <fsdp/plan/step_memory.h>
#include <fsdp/plan/step_time.h>

#include "step_plan.h"

namespace fsdp_trainer {

class PlanCheck {
 public:
  /// `run` and `prediction`: the memory predicted for this rank; `time_prediction` (the timed
  /// pieces' model) and `step_time` (the job timed with 1 and 3 blocks, `method` naming it):
  /// the step time, when it was predicted.
  PlanCheck(RunPlan run, fsdp::plan::MemoryPrediction prediction,
            std::optional<fsdp::plan::TimePrediction> time_prediction,
            std::optional<MeasuredTime> step_time, std::string method);

  const RunPlan& run() const { return run_; }
  const fsdp::plan::MemoryPrediction& prediction() const { return prediction_; }
  const std::optional<fsdp::plan::TimePrediction>& time_prediction() const {
    return time_prediction_;
  }
  const std::optional<MeasuredTime>& step_time() const { return step_time_; }

  /// A steady step (the optimizer state exists) just ended on this rank: its tracked peaks,
  /// read from fsdp::memory now, at a micro-batch of `seq_len` tokens, and its time breakdown.
  void record_step(int64_t seq_len, const fsdp::StepBreakdown& b);
  const MeasuredPeak& measured() const { return measured_; }

  /// After the last step (with at least one recorded): the prediction at the sequence length
  /// the measured peak had, next to what was measured (memory, and the step time when it was
  /// predicted), as lines to print, and the same as plan.json's text (`json`).
  std::vector<std::string> compare(std::string* json) const;

 private:
  RunPlan run_;
  fsdp::plan::MemoryPrediction prediction_;
  std::optional<fsdp::plan::TimePrediction> time_prediction_;
  std::optional<MeasuredTime> step_time_;
  std::string method_;
  MeasuredPeak measured_;       // the highest steady-step peak and its categories
  MeasuredTime measured_time_;  // sums over the steady steps (means in compare())
};

}  // namespace fsdp_trainer
