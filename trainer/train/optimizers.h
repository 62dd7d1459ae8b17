// The optimizer side of a job as one part, as torchtitan keeps its optimizers and learning-rate
// schedulers in containers of their own: the trainable parameters (split for weight decay), the
// configured optimizer over them, the dynamic loss scaler, the learning-rate schedule, and the
// previous step's gradient norm (training.grad_clip_mode = previous_step), with what of them a
// checkpoint keeps.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fsdp/distributed/process_group.h>
#include <fsdp/grad_scaler.h>

#include "config/config.h"
#include "observe/metrics.h"

namespace fsdp_trainer {

class CheckpointMeta;

/// training.lr at `step` (1-based): a linear warm-up over training.warmup_steps, then a cosine
/// decay to training.min_lr at training.steps (and min_lr after it).
double learning_rate(const TrainingConfig& t, int64_t step);

class Optimizers {
 public:
  /// The optimizer of `config` over `model`'s parameters that require gradients: weight decay
  /// on matrices only (as GPT-2 and nanoGPT: not on norms and biases). The loss scaler
  /// (precision.loss_scaling) agrees over `group`; a null group is allowed without one.
  Optimizers(const Config& config, const torch::nn::Module& model,
             std::shared_ptr<fsdp::ProcessGroup> group);

  /// Sets every parameter group's learning rate to the schedule's at `step`; returns it.
  double set_lr(int64_t step);

  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  const torch::optim::Optimizer& optimizer() const { return *optimizer_; }
  fsdp::ShardedGradScaler* scaler() { return scaler_.get(); }
  /// The trainable parameters, in the model's order.
  std::vector<torch::Tensor>& params() { return params_; }
  /// The previous step's global gradient norm (NaN before the first); steps update it.
  double& previous_grad_norm() { return previous_grad_norm_; }

  /// What the "optimizer:" line of a run says: the class, and for the fused ones the kernels,
  /// the moments' dtype and where their state lives.
  std::string describe() const;
  /// The file offload of the last step (optimizer.offload = file), into `m`; nothing otherwise.
  void record_offload(StepMetrics& m) const;

  /// The loss scaler's state and the previous norm, as a checkpoint's metadata (the moments
  /// travel with the model's shards: fsdp::save_sharded).
  void save_meta(std::map<std::string, std::string>& meta) const;
  /// What save_meta wrote, from a checkpoint (keys it lacks leave the state as it is).
  void load_meta(const CheckpointMeta& meta);

 private:
  TrainingConfig training_;
  OptimizerConfig options_;
  std::vector<torch::Tensor> params_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::unique_ptr<fsdp::ShardedGradScaler> scaler_;
  double previous_grad_norm_ = std::numeric_limits<double>::quiet_NaN();
};

}  // namespace fsdp_trainer
