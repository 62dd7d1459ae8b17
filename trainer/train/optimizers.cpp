#include "optimizers.h"

#include <fmt/core.h>

#include <algorithm>
#include <cmath>

#include <fsdp/optim/fused_optimizer.h>
#include <fsdp/optim/torch_fused_adamw.h>

#include "checkpoint_meta.h"
#include "optimizer_factory.h"

namespace fsdp_trainer {

double learning_rate(const TrainingConfig& t, int64_t step) {
  if (step <= t.warmup_steps)
    return t.lr * static_cast<double>(step) / std::max<int64_t>(1, t.warmup_steps);
  const double progress =
      static_cast<double>(step - t.warmup_steps) / std::max<int64_t>(1, t.steps - t.warmup_steps);
  return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + std::cos(M_PI * std::min(1.0, progress)));
}

Optimizers::Optimizers(const Config& config, const torch::nn::Module& model,
                       std::shared_ptr<fsdp::ProcessGroup> group)
    : training_(config.training), options_(config.optimizer) {
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& p : model.parameters()) {
    if (!p.requires_grad())
      continue;
    params_.push_back(p);
    (p.dim() >= 2 ? decay : no_decay).push_back(p);
  }
  optimizer_ = make_optimizer(config, std::move(decay), std::move(no_decay));
  if (uses_loss_scaling(config)) {
    TORCH_CHECK(group, "Optimizers: loss scaling needs a process group");
    scaler_ = std::make_unique<fsdp::ShardedGradScaler>(
        std::move(group), fsdp::GradScalerOptions()
                              .init_scale(config.precision.init_scale)
                              .growth_interval(config.precision.growth_interval));
  }
}

double Optimizers::set_lr(int64_t step) {
  const double lr = learning_rate(training_, step);
  for (auto& group : optimizer_->param_groups())
    group.options().set_lr(lr);
  return lr;
}

std::string Optimizers::describe() const {
  std::string text = options_.name == "adamw" ? "torch::optim::AdamW" : options_.name;
  if (const auto* fused = dynamic_cast<const fsdp::FusedOptimizer*>(optimizer_.get())) {
    text +=
        fmt::format(" ({} kernels, {} moments", fused->kernel_capability(), options_.moments_dtype);
    text += fused->state_in_memory() ? ")" : ", state in " + fused->offload_info() + ")";
  } else if (dynamic_cast<const fsdp::TorchFusedAdamW*>(optimizer_.get())) {
    text += " (shards on the GPU: torch's fused CUDA AdamW, fsdp::TorchFusedAdamW)";
  } else if (options_.name == "sgd") {
    text += " (shards on the GPU: torch::optim::SGD)";
  }
  return text;
}

void Optimizers::record_offload(StepMetrics& m) const {
  const auto* fused = dynamic_cast<const fsdp::FusedOptimizer*>(optimizer_.get());
  if (!fused || fused->state_in_memory())
    return;
  const auto& o = fused->last_step();
  m.offload_read_bytes = o.bytes_read;
  m.offload_written_bytes = o.bytes_written;
  m.time_offload_wait_s = o.io_wait_seconds;
}

void Optimizers::save_meta(std::map<std::string, std::string>& meta) const {
  if (scaler_) {
    const auto st = scaler_->state();
    meta["scaler.scale"] = fmt::format("{:.17g}", st.scale);
    meta["scaler.growth_tracker"] = std::to_string(st.growth_tracker);
    meta["scaler.skipped_steps"] = std::to_string(st.skipped_steps);
  }
  // training.grad_clip_mode = previous_step clips the next step by it.
  if (std::isfinite(previous_grad_norm_))
    meta["clip.previous_norm"] = fmt::format("{:.17g}", previous_grad_norm_);
}

void Optimizers::load_meta(const CheckpointMeta& meta) {
  if (scaler_ && meta.has("scaler.scale")) {
    scaler_->load_state({*meta.positive("scaler.scale"), meta.count("scaler.growth_tracker"),
                         meta.count("scaler.skipped_steps")});
  }
  if (const auto norm = meta.non_negative("clip.previous_norm"))
    previous_grad_norm_ = *norm;
}

}  // namespace fsdp_trainer
