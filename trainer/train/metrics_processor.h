// What a job reports of each step, as torchtitan's MetricsProcessor: the step's figures over
// every rank in one collective (loss, tokens, resident memory, the peak and its breakdown),
// throughput and MFU, and on rank 0 the outputs: metrics.jsonl, TensorBoard's events and the
// progress display.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <fsdp/distributed/process_group.h>

#include "config/config.h"
#include "observe/metrics.h"
#include "observe/progress.h"
#include "observe/tensorboard.h"

namespace fsdp_trainer {

/// The device memory counters of a runtime the trainer library does not link: CUDA lives in
/// fsdp-train-cuda's main() only, so that CPU runs never load CUDA libraries. Empty: the CPU's
/// (fsdp::memory's tracking allocator).
struct DeviceMemory {
  std::function<void()> reset_peak;
  std::function<int64_t()> peak_bytes;
  /// CUDA: the caching allocator's peak reserved bytes (StepMetrics::peak_reserved_bytes).
  std::function<int64_t()> peak_reserved_bytes;
};

class MetricsProcessor {
 public:
  /// `group`: every rank of the job, a group of the figures' own: their traffic goes through
  /// the collectives layer like all traffic (counted, and checked under
  /// fsdp.check_collectives) without mixing into the counters of the model's groups, which the
  /// step breakdown compares with what the strategy should move. `device`: where the backend
  /// takes its tensors (the GPU for NCCL).
  MetricsProcessor(std::shared_ptr<fsdp::ProcessGroup> group, torch::Device device,
                   DeviceMemory device_memory);
  ~MetricsProcessor();

  /// The mean and the maximum of a figure over the ranks (every rank calls them).
  double mean(double v);
  int64_t max(int64_t v);

  /// Starts a step's peak.
  void reset_peak() { device_memory_.reset_peak(); }
  /// MFU's two sides: the model's FLOPs per token, and the peak FLOP/s of one rank.
  void set_mfu_basis(double flops_per_token, double peak_flops_per_rank);
  double peak_flops_per_rank() const { return peak_flops_per_rank_; }

  /// The step's cross-rank figures, in one collective: the mean loss (of `loss_sum`), the
  /// largest resident set and high-water mark, and the highest peak with, where the tracking
  /// allocator counts, its breakdown by category on the rank that has it. `local_tokens`: this
  /// rank's tokens, summed into m.tokens (fine-tuning's batches differ per rank); without it
  /// m.tokens is already the job's. Then tokens per second and MFU, from m.step_time_s.
  void reduce(StepMetrics& m, double loss_sum, std::optional<double> local_tokens);

  /// Rank 0: metrics.jsonl in logging.run_dir (a fresh run replaces an earlier run's, a
  /// resumed one keeps the lines up to `start_step`), TensorBoard's events if
  /// logging.tensorboard (the same policy), and the progress display of `steps` steps.
  void open_outputs(const LoggingConfig& logging, int64_t steps, int64_t start_step);
  /// Whether this rank shows and writes (rank 0 after open_outputs).
  bool has_outputs() const { return progress_ != nullptr; }
  /// fsdp.fault_tolerant: the figures' group becomes the ranks training now, and the rank that
  /// writes may change (the lowest live one): the old writer closes its outputs, the new one
  /// opens them as a resumed run does.
  void set_group(std::shared_ptr<fsdp::ProcessGroup> group) { group_ = std::move(group); }
  void close_outputs();
  /// A line above the progress display (rank 0 with outputs; elsewhere nothing).
  void message(const std::string& text);
  /// Rank 0: the step's line of metrics.jsonl and TensorBoard, and the progress line with
  /// `eta_s` seconds to go.
  void log(const StepMetrics& m, double eta_s);
  /// Rank 0: ends the progress display.
  void finish();
  const std::string& metrics_path() const;
  bool writes_tensorboard() const { return tensorboard_ != nullptr; }

 private:
  std::shared_ptr<fsdp::ProcessGroup> group_;
  torch::Device device_;
  DeviceMemory device_memory_;
  double flops_per_token_ = 0;
  double peak_flops_per_rank_ = 0;
  std::unique_ptr<MetricsWriter> writer_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  std::unique_ptr<Progress> progress_;
};

}  // namespace fsdp_trainer
