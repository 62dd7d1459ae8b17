// See grad_scaler.h. The local check uses ATen's fused unscale-and-check kernel (one pass over
// each grad, the same kernel torch.amp.GradScaler uses); the only addition for sharding is the
// all-reduce of the flag.
#include <fsdp/grad_scaler.h>

#include <torch/torch.h>

#include <cmath>

#include <fsdp/distributed/collectives.h>

namespace fsdp {

ShardedGradScaler::ShardedGradScaler(std::shared_ptr<ProcessGroup> group, GradScalerOptions options)
    : group_(std::move(group)), options_(options), scale_(options.init_scale()) {
  TORCH_CHECK(group_, "ShardedGradScaler: no process group");
  TORCH_CHECK(options_.init_scale() > 0 && std::isfinite(options_.init_scale()),
              "ShardedGradScaler: init_scale must be positive and finite, got ",
              options_.init_scale());
  TORCH_CHECK(options_.growth_factor() > 1.0, "ShardedGradScaler: growth_factor must be > 1, got ",
              options_.growth_factor());
  TORCH_CHECK(options_.backoff_factor() > 0 && options_.backoff_factor() < 1.0,
              "ShardedGradScaler: backoff_factor must be in (0, 1), got ",
              options_.backoff_factor());
  TORCH_CHECK(options_.growth_interval() > 0,
              "ShardedGradScaler: growth_interval must be positive, got ",
              options_.growth_interval());
}

void ShardedGradScaler::set_group(std::shared_ptr<ProcessGroup> group) {
  TORCH_CHECK(group, "ShardedGradScaler::set_group: no process group");
  TORCH_CHECK(!unscaled_ && !stepped_, "ShardedGradScaler::set_group: in the middle of a step");
  group_ = std::move(group);
}

torch::Tensor ShardedGradScaler::scale(const torch::Tensor& loss) const {
  if (!options_.enabled())
    return loss;
  return loss * scale_;
}

void ShardedGradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  std::vector<torch::Tensor> params;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params())
      params.push_back(p);
  }
  unscale_(params);
}

void ShardedGradScaler::unscale_(const std::vector<torch::Tensor>& params) {
  if (!options_.enabled())
    return;
  TORCH_CHECK(!unscaled_,
              "ShardedGradScaler: unscale_ called twice in one step (call update() after step())");
  TORCH_CHECK(!stepped_, "ShardedGradScaler: unscale_ after step(); call update() first");
  torch::NoGradGuard no_grad;
  const torch::Device comm_device(group_->device_type());
  // The kernel takes grads of one device and dtype per call; fp32 masters on one device is the
  // usual case, but a model may mix (frozen fp16 storage has no grads; buffers none).
  auto found = torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat).device(comm_device));
  std::vector<std::vector<torch::Tensor>> groups;
  std::vector<std::pair<torch::Device, torch::ScalarType>> keys;
  for (const auto& p : params) {
    const auto& g = p.grad();
    if (!g.defined() || g.numel() == 0)
      continue;
    TORCH_CHECK(g.layout() == torch::kStrided, "ShardedGradScaler: sparse grads are not supported");
    const std::pair<torch::Device, torch::ScalarType> key{g.device(), g.scalar_type()};
    size_t i = 0;
    while (i < keys.size() && keys[i] != key)
      ++i;
    if (i == keys.size()) {
      keys.push_back(key);
      groups.emplace_back();
    }
    groups[i].push_back(g);
  }
  for (size_t i = 0; i < groups.size(); ++i) {
    const auto device = keys[i].first;
    auto local_found =
        torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat).device(device));
    auto inv_scale =
        torch::full({1}, 1.0 / scale_, torch::TensorOptions().dtype(torch::kFloat).device(device));
    at::_amp_foreach_non_finite_check_and_unscale_(groups[i], local_found, inv_scale);
    found += local_found.to(comm_device);
  }
  // Every rank of the group learns whether any rank overflowed: the step is skipped everywhere
  // or nowhere, and the scales stay equal.
  all_reduce(*group_, found, ReduceOp::kSum, "ShardedGradScaler inf check")->wait();
  found_inf_ = found.item<float>() > 0;
  unscaled_ = true;
}

bool ShardedGradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    optimizer.step();
    return true;
  }
  TORCH_CHECK(!stepped_, "ShardedGradScaler: step() called twice in one step; call update()");
  if (!unscaled_)
    unscale_(optimizer);
  stepped_ = true;
  if (found_inf_) {
    ++skipped_steps_;
    return false;
  }
  optimizer.step();
  return true;
}

void ShardedGradScaler::update() {
  if (!options_.enabled())
    return;
  TORCH_CHECK(unscaled_, "ShardedGradScaler: update() without unscale_() or step() in this step");
  if (found_inf_) {
    scale_ *= options_.backoff_factor();
    growth_tracker_ = 0;
  } else if (++growth_tracker_ == options_.growth_interval()) {
    // Growing past what fp32 holds would turn every next loss into inf; stay put instead.
    const double grown = scale_ * options_.growth_factor();
    if (std::isfinite(static_cast<float>(grown)))
      scale_ = grown;
    growth_tracker_ = 0;
  }
  unscaled_ = stepped_ = found_inf_ = false;
}

void ShardedGradScaler::load_state(const State& state) {
  TORCH_CHECK(state.scale > 0 && std::isfinite(state.scale),
              "ShardedGradScaler: a loaded scale must be positive and finite, got ", state.scale);
  TORCH_CHECK(state.growth_tracker >= 0 && state.skipped_steps >= 0,
              "ShardedGradScaler: negative counters in the loaded state");
  scale_ = state.scale;
  growth_tracker_ = state.growth_tracker;
  skipped_steps_ = state.skipped_steps;
  unscaled_ = stepped_ = found_inf_ = false;
}

}  // namespace fsdp
