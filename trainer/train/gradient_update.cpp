#include "gradient_update.h"

#include <fsdp/fully_shard.h>

namespace fsdp_trainer {

void scale_grads(const std::vector<torch::Tensor>& params, double factor) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads;
  for (const auto& p : params) {
    if (p.grad().defined())
      grads.push_back(p.grad());
  }
  at::_foreach_mul_(grads, factor);
}

UpdateInBackward::UpdateInBackward(torch::nn::Module& root, fsdp::FusedOptimizer& optimizer,
                                   fsdp::ProcessGroup& group, double clip_factor, bool measure_norm,
                                   fsdp::TensorParallelParams tp)
    : root_(root),
      optimizer_(optimizer),
      norm_(group, std::move(tp)),
      clip_factor_(clip_factor),
      measure_norm_(measure_norm) {}

UpdateInBackward::~UpdateInBackward() {
  fsdp::set_post_reduce_hook(root_, nullptr);
}

void UpdateInBackward::arm(bool on) {
  fsdp::PostReduceHook hook;
  if (on)
    hook = [this](const std::vector<torch::Tensor>& params) { step_unit(params); };
  fsdp::set_post_reduce_hook(root_, std::move(hook));
}

void UpdateInBackward::step_unit(const std::vector<torch::Tensor>& params) {
  torch::NoGradGuard no_grad;
  if (measure_norm_)
    norm_.add(params);
  if (clip_factor_ != 1.0)
    scale_grads(params, clip_factor_);
  optimizer_.step_params(params);
  // The unit's gradients are spent: freeing them here is the memory this mode saves.
  for (auto p : params)
    p.mutable_grad() = torch::Tensor();
}

}  // namespace fsdp_trainer
