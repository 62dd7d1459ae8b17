// Dynamic loss scaling for fp16 training when each rank holds a shard of the gradients
// (PyTorch's ShardedGradScaler).
//
// fp16 has five exponent bits: gradients below about 6e-8 flush to zero and above 65504
// overflow. Scaling the loss by S before backward moves the gradients into range; the optimizer
// must then see them divided by S, and a step whose gradients overflowed anywhere must be
// skipped. With sharding, one rank's shards can overflow while the others' are finite, so the
// inf/NaN check is combined across the group (one all-reduce of one float per step): every rank
// skips the same steps, and every rank's scale follows the same sequence.
//
//   fsdp::ShardedGradScaler scaler(pg);
//   auto loss = compute_loss();
//   scaler.scale(loss).backward();
//   scaler.unscale_(optimizer);                        // optional: before clipping
//   fsdp::clip_grad_norm_(model->parameters(), 1.0, *pg);
//   scaler.step(optimizer);                            // skipped if any rank found inf/NaN
//   scaler.update();                                   // back off or grow the scale
#pragma once

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <vector>

#include <fsdp/distributed/process_group.h>

namespace fsdp {

struct GradScalerOptions {
  /// The first scale (PyTorch's default: 2^16).
  TORCH_ARG(double, init_scale) = 65536.0;
  /// Scale multiplier after growth_interval steps in a row without inf/NaN.
  TORCH_ARG(double, growth_factor) = 2.0;
  /// Scale multiplier after a step with inf/NaN (that step is skipped).
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// false: scale() returns the loss unchanged, step() always steps, nothing communicates.
  TORCH_ARG(bool, enabled) = true;
};

class ShardedGradScaler {
 public:
  /// `group`: the group the units were sharded over (every rank of it calls unscale_/step).
  explicit ShardedGradScaler(std::shared_ptr<ProcessGroup> group, GradScalerOptions options = {});

  /// loss * scale (in the loss's dtype).
  torch::Tensor scale(const torch::Tensor& loss) const;

  /// Divides the grads of the optimizer's parameters by the scale, in place, and finds out
  /// whether any rank of the group has an inf or NaN among its grads (one all-reduce). At most
  /// once per step; step() calls it if the caller did not.
  void unscale_(torch::optim::Optimizer& optimizer);
  /// The same for a list of parameters (this rank's shards).
  void unscale_(const std::vector<torch::Tensor>& params);

  /// optimizer.step() unless some rank found an inf/NaN in this step's grads. Returns whether
  /// it stepped.
  bool step(torch::optim::Optimizer& optimizer);

  /// Ends the step: the scale backs off after an inf/NaN, grows after growth_interval clean
  /// steps in a row. Must follow every step().
  void update();

  /// The group's successor (fault tolerance makes a replica's group anew after a change of
  /// membership); between steps only.
  void set_group(std::shared_ptr<ProcessGroup> group);

  double get_scale() const { return scale_; }
  bool is_enabled() const { return options_.enabled(); }
  /// Whether this step's unscale_ found inf/NaN on some rank (reset by update()).
  bool found_inf() const { return found_inf_; }
  /// Steps skipped since construction.
  int64_t skipped_steps() const { return skipped_steps_; }
  /// Clean steps since the last growth or back-off.
  int64_t growth_tracker() const { return growth_tracker_; }

  /// Scale and growth tracker, for checkpoints: restoring them resumes the same sequence.
  struct State {
    double scale = 0;
    int64_t growth_tracker = 0;
    int64_t skipped_steps = 0;
  };
  State state() const { return {scale_, growth_tracker_, skipped_steps_}; }
  void load_state(const State& state);

 private:
  std::shared_ptr<ProcessGroup> group_;
  GradScalerOptions options_;
  double scale_;
  int64_t growth_tracker_ = 0;
  int64_t skipped_steps_ = 0;
  bool unscaled_ = false;  // unscale_ ran in this step
  bool stepped_ = false;   // step() ran in this step
  bool found_inf_ = false;
};

}  // namespace fsdp
