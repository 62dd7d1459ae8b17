// See plan_check.h.
#include "plan_check.h"

#include <algorithm>
#include <utility>

#include <fsdp/core/memory.h>

namespace fsdp_trainer {

PlanCheck::PlanCheck(RunPlan run, fsdp::plan::MemoryPrediction prediction,
                     std::optional<fsdp::plan::TimePrediction> time_prediction,
                     std::optional<MeasuredTime> step_time, std::string method)
    : run_(std::move(run)),
      prediction_(std::move(prediction)),
      time_prediction_(std::move(time_prediction)),
      step_time_(std::move(step_time)),
      method_(std::move(method)) {}

void PlanCheck::record_step(int64_t seq_len, const fsdp::StepBreakdown& b) {
  namespace memory = fsdp::memory;
  if (memory::peak_bytes() > measured_.peak) {
    measured_.peak = memory::peak_bytes();
    measured_.at_peak = memory::at_peak_by_category();
    measured_.moment = memory::at_peak_moment();
    measured_.seq_len = seq_len;
  }
  ++measured_.steps;
  const auto peaks = memory::peak_by_category();
  for (int c = 0; c < memory::kNumCategories; ++c)
    measured_.category_peaks.bytes[c] = std::max(measured_.category_peaks.bytes[c], peaks.bytes[c]);
  if (time_prediction_) {
    auto& mt = measured_time_;
    mt.forward += b.forward_s;
    mt.backward += b.backward_s;
    mt.all_gather_wait += b.all_gather_wait_s;
    mt.reduce_wait += b.reduce_wait_s;
    mt.optimizer += b.optimizer_s;
    mt.other += b.other_s;
    mt.step += b.step_s;
    ++mt.steps;
  }
}

std::vector<std::string> PlanCheck::compare(std::string* json) const {
  // Compared at the length the measured step had (fine-tuning batches vary; the prediction
  // before step 1 is for the longest).
  auto options = run_.options;
  options.seq_len = measured_.seq_len;
  const auto at_measured =
      fsdp::plan::predict_step_memory(run_.units, options, run_.activations, 0);
  std::vector<std::string> lines{compare_prediction(at_measured, measured_)};
  MeasuredTime mean = measured_time_;
  if (mean.steps > 0) {
    for (double* v : {&mean.forward, &mean.backward, &mean.all_gather_wait, &mean.reduce_wait,
                      &mean.optimizer, &mean.other, &mean.step})
      *v /= static_cast<double>(mean.steps);
    if (step_time_)
      lines.push_back(compare_time(*step_time_, mean, method_));
  }
  if (json)
    *json = plan_json(at_measured, measured_, step_time_, mean, method_, time_prediction_);
  return lines;
}

}  // namespace fsdp_trainer
