#include "metrics_processor.h"

#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <filesystem>
#include <vector>

#include <fsdp/core/memory.h>
#include <fsdp/distributed/collectives.h>

namespace fsdp_trainer {

MetricsProcessor::MetricsProcessor(std::shared_ptr<fsdp::ProcessGroup> group, torch::Device device,
                                   DeviceMemory device_memory)
    : group_(std::move(group)), device_(device), device_memory_(std::move(device_memory)) {
  if (!device_memory_.peak_bytes) {
    device_memory_.reset_peak = [] { fsdp::memory::reset_peak(); };
    device_memory_.peak_bytes = [] { return fsdp::memory::peak_bytes(); };
  }
}

MetricsProcessor::~MetricsProcessor() = default;

double MetricsProcessor::mean(double v) {
  auto t = at::tensor({v}, at::TensorOptions(at::kDouble).device(device_));
  fsdp::all_reduce(*group_, t, fsdp::ReduceOp::kSum, "mean of a metric")->wait();
  return t.item<double>() / group_->size();
}

int64_t MetricsProcessor::max(int64_t v) {
  auto t = at::tensor({v}, at::TensorOptions(at::kLong).device(device_));
  fsdp::all_reduce(*group_, t, fsdp::ReduceOp::kMax, "max of a metric")->wait();
  return t.item<int64_t>();
}

void MetricsProcessor::set_mfu_basis(double flops_per_token, double peak_flops_per_rank) {
  flops_per_token_ = flops_per_token;
  peak_flops_per_rank_ = peak_flops_per_rank;
}

void MetricsProcessor::reduce(StepMetrics& m, double loss_sum, std::optional<double> local_tokens) {
  // One summing all-reduce of a (world, columns) table in which each rank fills only its own
  // row: after it every rank holds every rank's figures and takes means and maxima locally.
  // Four separate all-reduces cost ~5 ms per step between steps at batch 1 on 2 cores (each a
  // round trip, and a point where the faster rank waits). Doubles hold byte counts exactly
  // below 2^53.
  enum Col { kLoss, kTokens, kRss, kPeakRss, kPeak, kGradsPeak, kPeakReserved, kCategories };
  constexpr int kCols = kCategories + fsdp::memory::kNumCategories;
  // The tracking allocator counts host tensors; on a GPU the peaks are the device's.
  const bool tracked = device_.is_cpu() && fsdp::memory::tracking_installed();
  std::vector<double> mine(kCols, 0.0);
  mine[kLoss] = loss_sum;
  mine[kTokens] = local_tokens.value_or(0.0);
  mine[kRss] = static_cast<double>(fsdp::memory::resident_bytes());
  mine[kPeakRss] = static_cast<double>(fsdp::memory::peak_resident_bytes());
  if (tracked) {
    mine[kPeak] = static_cast<double>(fsdp::memory::peak_bytes());
    mine[kGradsPeak] =
        static_cast<double>(fsdp::memory::peak_by_category()[fsdp::memory::Category::kGrads]);
    const auto parts = fsdp::memory::at_peak_by_category();
    for (int c = 0; c < fsdp::memory::kNumCategories; ++c)
      mine[kCategories + c] = static_cast<double>(parts.bytes[c]);
  } else {
    mine[kPeak] = static_cast<double>(device_memory_.peak_bytes());
  }
  if (device_memory_.peak_reserved_bytes)
    mine[kPeakReserved] = static_cast<double>(device_memory_.peak_reserved_bytes());
  const int world = group_->size();
  auto table = at::zeros({world, kCols}, at::kDouble);
  table[group_->rank()].copy_(at::tensor(mine, at::kDouble));
  auto on_device = table.to(device_);
  fsdp::all_reduce(*group_, on_device, fsdp::ReduceOp::kSum, "step metrics")->wait();
  table = on_device.cpu();
  const auto col = [&](int c) { return table.select(1, c); };
  m.loss = col(kLoss).sum().item<double>() / world;
  if (local_tokens)
    m.tokens = std::llround(col(kTokens).sum().item<double>());
  m.tokens_per_second = m.tokens / m.step_time_s;
  m.mfu =
      model_flops_utilization(flops_per_token_, m.tokens_per_second, peak_flops_per_rank_ * world);
  m.rss_bytes = static_cast<int64_t>(col(kRss).max().item<double>());
  m.peak_rss_bytes = static_cast<int64_t>(col(kPeakRss).max().item<double>());
  // The breakdown of the rank with the highest peak (they sum to its peak).
  const auto top = col(kPeak).argmax().item<int64_t>();
  const auto row = table[top];
  m.peak_bytes = static_cast<int64_t>(row[kPeak].item<double>());
  if (device_memory_.peak_reserved_bytes)
    m.peak_reserved_bytes = static_cast<int64_t>(col(kPeakReserved).max().item<double>());
  if (!tracked)
    return;
  using fsdp::memory::Category;
  auto part = [&](Category c) {
    return static_cast<int64_t>(row[kCategories + static_cast<int>(c)].item<double>());
  };
  m.mem_params_bytes = part(Category::kParams);
  m.mem_grads_bytes = part(Category::kGrads);
  m.mem_optimizer_bytes = part(Category::kOptimizer);
  m.mem_gathered_bytes = part(Category::kGathered);
  m.mem_activations_bytes = part(Category::kActivations);
  m.mem_other_bytes = part(Category::kOther);
  m.grads_peak_bytes = static_cast<int64_t>(col(kGradsPeak).max().item<double>());
}

void MetricsProcessor::open_outputs(const LoggingConfig& logging, int64_t steps,
                                    int64_t start_step) {
  namespace fs = std::filesystem;
  fs::create_directories(logging.run_dir);
  const auto metrics_path = fs::path(logging.run_dir) / "metrics.jsonl";
  if (start_step == 0) {
    fs::remove(metrics_path);
    writer_ = std::make_unique<MetricsWriter>(metrics_path.string());
  } else {
    writer_ = std::make_unique<MetricsWriter>(metrics_path.string(), start_step + 1);
  }
  if (logging.tensorboard) {
    // A fresh run removes an earlier run's event files (TensorBoard would show both runs' steps
    // as one run's); a resumed run adds a file, whose SessionLog START hides the earlier files'
    // steps after the checkpoint.
    const auto tb_dir = fs::path(logging.run_dir) / "tensorboard";
    if (start_step == 0 && fs::is_directory(tb_dir)) {
      for (const auto& entry : fs::directory_iterator(tb_dir))
        if (is_tensorboard_event_file(entry.path().filename().string()))
          fs::remove(entry.path());
    }
    tensorboard_ = std::make_unique<TensorBoardWriter>(tb_dir.string(), start_step + 1);
  }
  progress_ = std::make_unique<Progress>(logging.progress, steps, logging.log_every);
}

void MetricsProcessor::message(const std::string& text) {
  if (progress_)
    progress_->message(text);
}

void MetricsProcessor::log(const StepMetrics& m, double eta_s) {
  writer_->append(m);
  if (tensorboard_)
    tensorboard_->write_scalars(m.step, tensorboard_scalars(m));
  progress_->update({m.step, m.loss, m.tokens_per_second, m.mfu, m.peak_bytes, eta_s});
}

void MetricsProcessor::close_outputs() {
  writer_.reset();
  tensorboard_.reset();
  progress_.reset();
}

void MetricsProcessor::finish() {
  if (progress_)
    progress_->finish();
}

const std::string& MetricsProcessor::metrics_path() const {
  return writer_->path();
}

}  // namespace fsdp_trainer
