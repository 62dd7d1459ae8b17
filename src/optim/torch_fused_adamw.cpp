// See include/fsdp/optim/torch_fused_adamw.h.
#include <fsdp/optim/torch_fused_adamw.h>

#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_fused_adamw.h>
#include <torch/utils.h>

#include <vector>

namespace fsdp {

torch::Tensor TorchFusedAdamW::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups()) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    TORCH_CHECK(!o.amsgrad(), "fsdp::TorchFusedAdamW: amsgrad is not supported");
    std::vector<torch::Tensor> params, grads, exp_avgs, exp_avg_sqs, step_values;
    std::vector<std::pair<torch::optim::AdamWParamState*, StepTensor*>> counts;
    for (auto& p : group.params()) {
      if (!p.grad().defined())
        continue;
      TORCH_CHECK(!p.grad().is_sparse(), "fsdp::TorchFusedAdamW: sparse gradients");
      TORCH_CHECK(p.grad().scalar_type() == p.scalar_type() && p.grad().device() == p.device(),
                  "fsdp::TorchFusedAdamW: a gradient must have its parameter's dtype and device, "
                  "got ",
                  p.grad().scalar_type(), " on ", p.grad().device(), " for ", p.scalar_type(),
                  " on ", p.device());
      if (!params.empty()) {
        TORCH_CHECK(p.device() == params[0].device() && p.scalar_type() == params[0].scalar_type(),
                    "fsdp::TorchFusedAdamW: the parameters of a group must share a device and "
                    "a dtype, got ",
                    params[0].device(), " ", params[0].scalar_type(), " and ", p.device(), " ",
                    p.scalar_type());
      }
      auto& slot = state()[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto fresh = std::make_unique<torch::optim::AdamWParamState>();
        fresh->step(0);
        fresh->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        fresh->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        slot = std::move(fresh);
      }
      auto& s = static_cast<torch::optim::AdamWParamState&>(*slot);
      auto& counter = steps_[p.unsafeGetTensorImpl()];
      if (!counter.value.defined() || counter.step != s.step() ||
          counter.value.device() != p.device()) {
        counter.value =
            torch::full({}, static_cast<double>(s.step()), p.options().dtype(torch::kFloat));
        counter.step = s.step();
      }
      counts.emplace_back(&s, &counter);
      params.push_back(p);
      grads.push_back(p.grad());
      exp_avgs.push_back(s.exp_avg());
      exp_avg_sqs.push_back(s.exp_avg_sq());
      step_values.push_back(counter.value);
    }
    if (params.empty())
      continue;
    // As torch.optim.AdamW(fused=True): the counts go up first, the kernel reads the new ones.
    at::_foreach_add_(step_values, 1.0);
    at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, step_values,
                      o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay(),
                      o.eps(), /*amsgrad=*/false, /*maximize=*/false);
    // The host-side counts only now: had a launch failed, state and tensors would still agree
    // (the next step rebuilds any tensor whose count differs).
    for (auto& [state, counter] : counts) {
      state->step(state->step() + 1);
      counter->step = state->step();
    }
  }
  return loss;
}

}  // namespace fsdp
