// The trainer's planner part (trainer/train/plan_check.h): what it keeps of the steady steps it
// is handed, and the comparison it makes of them with the prediction.
#include <gtest/gtest.h>

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <string>

#include <fsdp/core/memory.h>

#include "config/config.h"
#include "train/plan_check.h"
#include "train/step_plan.h"

namespace {

namespace fs = std::filesystem;

fsdp_trainer::RunPlan tiny_plan() {
  const auto path =
      fs::temp_directory_path() / ("plan-check-" + std::to_string(::getpid()) + ".toml");
  std::ofstream(path) << "[model]\narch = \"gpt\"\npreset = \"gpt2-test\"\n"
                         "[training]\nbatch_size = 2\nseq_len = 16\n";
  const auto config = fsdp_trainer::load_config(path.string(), {}, false);
  fs::remove(path);
  return fsdp_trainer::plan_run(config, /*vocab_size=*/512, "", /*world_size=*/1,
                                /*local_world_size=*/1, "fp32", /*other_bytes=*/0);
}

// Holds `bytes` tracked bytes at once, then frees them: a step whose peak is that much above
// what is held outside it.
void step_with_peak(int64_t bytes) {
  fsdp::memory::reset_peak();
  auto t = torch::empty({bytes / 4}, torch::kFloat);
  t.zero_();
}

TEST(PlanCheck, KeepsTheHighestSteadyPeakAndComparesAtItsLength) {
  fsdp::memory::install_tracking_allocator();
  const auto run = tiny_plan();
  const auto prediction =
      fsdp::plan::predict_step_memory(run.units, run.options, run.activations, 0);
  fsdp_trainer::MeasuredTime predicted_time;
  predicted_time.step = 0.5, predicted_time.forward = 0.2, predicted_time.backward = 0.3;
  fsdp_trainer::PlanCheck check(run, prediction, fsdp::plan::TimePrediction{}, predicted_time,
                                "a test's method");
  EXPECT_EQ(check.prediction().peak, prediction.peak);

  fsdp::StepBreakdown b;
  b.step_s = 0.4, b.forward_s = 0.1, b.backward_s = 0.3;
  step_with_peak(1 << 20);
  check.record_step(16, b);
  const int64_t first = check.measured().peak;
  EXPECT_GE(first, 1 << 20);
  step_with_peak(4 << 20);  // the highest, at another length
  check.record_step(12, b);
  const int64_t highest = check.measured().peak;
  EXPECT_GE(highest, first + (3 << 20));
  step_with_peak(2 << 20);
  check.record_step(16, b);
  EXPECT_EQ(check.measured().peak, highest);
  EXPECT_EQ(check.measured().seq_len, 12);
  EXPECT_EQ(check.measured().steps, 3);

  std::string json;
  const auto lines = check.compare(&json);
  ASSERT_EQ(lines.size(), 2u);  // memory, then the step time
  EXPECT_NE(lines[0].find("predicted"), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find("a test's method"), std::string::npos) << lines[1];
  const auto doc = nlohmann::json::parse(json);
  EXPECT_EQ(doc.at("measured").at("peak").get<int64_t>(), highest);
  EXPECT_EQ(doc.at("measured").at("steps").get<int64_t>(), 3);
  EXPECT_EQ(doc.at("measured").at("seq_len").get<int64_t>(), 12);
  // The means of the steps' times, next to the prediction.
  EXPECT_DOUBLE_EQ(doc.at("time").at("measured").at("step").get<double>(), 0.4);
  EXPECT_DOUBLE_EQ(doc.at("time").at("predicted").at("step").get<double>(), 0.5);
  // Compared at the measured peak's length: the prediction at 12 tokens, not at 16.
  auto at12 = run.options;
  at12.seq_len = 12;
  EXPECT_EQ(doc.at("predicted").at("peak").get<int64_t>(),
            fsdp::plan::predict_step_memory(run.units, at12, run.activations, 0).peak);
}

}  // namespace
