// The accelerator's kernels during the traced steps (logging.trace_steps with training.device =
// "cuda"): Kineto, PyTorch's profiler, records them, and a summary (time per kernel name and in
// all) goes beside the step trace. Our own spans (fsdp/observe/trace.h) time the host; on a GPU
// the host runs ahead of the device, so where the device's time goes takes the device's own
// record. bench/torch_gpt.py writes the same summary for PyTorch's side (bench/gpu_check.py
// compares the two).
#pragma once

#include <memory>
#include <string>

namespace fsdp_trainer {

class KernelProfile {
 public:
  /// Starts recording the host's ops and the device's kernels and copies.
  static std::unique_ptr<KernelProfile> start();
  KernelProfile(const KernelProfile&) = delete;
  KernelProfile& operator=(const KernelProfile&) = delete;
  /// Stops if still recording (the summary is then lost).
  ~KernelProfile();

  /// Stops and writes the summary, JSON, to `path`: {"steps", "device_ns" (the kernels' and
  /// copies' time added up), "kernels": [{"name", "count", "ns"}, ...] largest first}.
  /// Returns one line that says what it found.
  std::string stop_and_write(const std::string& path, int steps);

 private:
  KernelProfile() = default;
  bool running_ = false;
};

}  // namespace fsdp_trainer
