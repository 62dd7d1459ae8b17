// The trainer's metrics part (trainer/train/metrics_processor.h): a step's figures over the
// ranks, throughput and MFU, and rank 0's metrics.jsonl across a fresh and a resumed run.
#include <gtest/gtest.h>

#include <ATen/ops/empty.h>

#include <cmath>
#include <filesystem>
#include <string>

#include <fsdp/core/memory.h>
#include <fsdp/distributed/process_group.h>

#include "harness/multiprocess.h"
#include "observe/metrics.h"
#include "train/metrics_processor.h"

namespace {

using fsdp_trainer::DeviceMemory;
using fsdp_trainer::MetricsProcessor;
using fsdp_trainer::StepMetrics;

// Rank r reports loss r + 1, 10 (r + 1) tokens, and a device peak of 1000 (r + 1) bytes.
FSDP_WORKER(metrics_processor_reduce) {
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), world = pg->size();
  DeviceMemory device;
  device.reset_peak = [] {};
  device.peak_bytes = [rank] { return int64_t{1000} * (rank + 1); };
  device.peak_reserved_bytes = [rank] { return int64_t{7} * (rank + 1); };
  MetricsProcessor metrics(pg, torch::kCPU, device);
  WORKER_CHECK(metrics.mean(rank + 1.0) == (world + 1) / 2.0);
  WORKER_CHECK(metrics.max(-rank) == 0);
  metrics.set_mfu_basis(/*flops_per_token=*/6e6, /*peak_flops_per_rank=*/1e9);

  StepMetrics m;
  m.step_time_s = 0.5;
  metrics.reduce(m, rank + 1.0, 10.0 * (rank + 1));
  WORKER_CHECK(m.loss == (world + 1) / 2.0) << m.loss;
  WORKER_CHECK(m.tokens == 10 * world * (world + 1) / 2) << m.tokens;
  WORKER_CHECK(m.tokens_per_second == m.tokens / 0.5);
  WORKER_CHECK(std::abs(m.mfu - 6e6 * m.tokens_per_second / (1e9 * world)) < 1e-12) << m.mfu;
  WORKER_CHECK(m.peak_bytes == 1000 * world) << m.peak_bytes;  // the highest rank's
  WORKER_CHECK(m.peak_reserved_bytes == 7 * world);
  WORKER_CHECK(m.rss_bytes.value_or(0) > 0 && m.peak_rss_bytes >= m.rss_bytes);
  WORKER_CHECK(!m.mem_params_bytes);  // no breakdown without the tracking allocator

  // Without local tokens (pretraining), m.tokens is the caller's.
  StepMetrics p;
  p.step_time_s = 2;
  p.tokens = 64;
  metrics.reduce(p, 1.0, std::nullopt);
  WORKER_CHECK(p.tokens == 64 && p.tokens_per_second == 32);

  // Tracked: the breakdown is the one of the rank with the highest peak, and sums to it.
  fsdp::memory::install_tracking_allocator();
  MetricsProcessor tracked(pg, torch::kCPU, {});
  tracked.reset_peak();
  at::Tensor held;
  {
    fsdp::memory::CategoryScope params(fsdp::memory::Category::kParams);
    held = at::empty({(rank + 1) * (int64_t{1} << 20)}, at::kByte);
  }
  StepMetrics t;
  t.step_time_s = 1;
  tracked.reduce(t, 0.0, std::nullopt);
  WORKER_CHECK(t.mem_params_bytes.value_or(0) >= world * (int64_t{1} << 20)) << *t.mem_params_bytes;
  const int64_t parts = *t.mem_params_bytes + *t.mem_grads_bytes + *t.mem_optimizer_bytes +
                        *t.mem_gathered_bytes + *t.mem_activations_bytes + *t.mem_other_bytes;
  WORKER_CHECK(parts == t.peak_bytes) << parts << " vs " << t.peak_bytes;
  return 0;
}

TEST(MetricsProcessor, ReducesTheStepsFiguresOverTheRanks) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("metrics_processor_reduce", 3));
}

// Rank 0 writes; a resumed run keeps the lines up to its checkpoint and logs the rest again.
FSDP_WORKER(metrics_processor_outputs) {
  auto pg = fsdp::init_process_group();
  fsdp_trainer::LoggingConfig logging;
  logging.run_dir = ctx.tmp_dir + "/run";
  logging.progress = "none";
  auto run = [&](int64_t start_step, int64_t steps) {
    MetricsProcessor metrics(pg, torch::kCPU, {});
    if (pg->rank() == 0)
      metrics.open_outputs(logging, steps, start_step);
    WORKER_CHECK(metrics.has_outputs() == (pg->rank() == 0));
    metrics.message("shown by rank 0 only");
    for (int64_t step = start_step + 1; step <= steps; ++step) {
      StepMetrics m;
      m.step = step;
      m.step_time_s = 1;
      m.tokens = 10 * step + start_step;  // tells the runs apart
      metrics.reduce(m, 1.0, std::nullopt);
      if (metrics.has_outputs())
        metrics.log(m, 0.0);
    }
    metrics.finish();
  };
  run(0, 4);
  pg->barrier();
  run(2, 5);
  const auto path = logging.run_dir + "/metrics.jsonl";
  if (pg->rank() == 0) {
    const auto steps = fsdp_trainer::read_metrics(path);
    WORKER_CHECK(steps.size() == 5) << steps.size();
    const int64_t tokens[] = {10, 20, 32, 42, 52};
    for (size_t i = 0; i < steps.size(); ++i) {
      WORKER_CHECK(steps[i].step == static_cast<int64_t>(i) + 1);
      WORKER_CHECK(steps[i].tokens == tokens[i]) << i << ": " << steps[i].tokens;
    }
  }
  pg->barrier();
  run(0, 1);  // a fresh run replaces the file
  if (pg->rank() == 0) {
    WORKER_CHECK(fsdp_trainer::read_metrics(path).size() == 1);
  }
  return 0;
}

TEST(MetricsProcessor, Rank0LogsAFreshRunAnewAndAResumedOneAfterItsCheckpoint) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("metrics_processor_outputs", 2));
}

}  // namespace
