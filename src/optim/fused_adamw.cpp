// fsdp::FusedAdamW: torch::optim::AdamW's scalars per parameter, the kernel per piece.
#include <fsdp/optim/fused_optimizer.h>

#include <cmath>

#include "optimizer_kernels.h"

namespace fsdp {
namespace {

const torch::optim::AdamWOptions& adamw_options(const torch::optim::OptimizerOptions& o) {
  return static_cast<const torch::optim::AdamWOptions&>(o);
}

void check(const torch::optim::AdamWOptions& o) {
  const auto [b1, b2] = o.betas();
  TORCH_CHECK(o.lr() >= 0, "FusedAdamW: invalid learning rate ", o.lr());
  TORCH_CHECK(o.eps() >= 0, "FusedAdamW: invalid eps ", o.eps());
  TORCH_CHECK(b1 >= 0 && b1 < 1 && b2 >= 0 && b2 < 1, "FusedAdamW: invalid betas (", b1, ", ", b2,
              ")");
  TORCH_CHECK(o.weight_decay() >= 0, "FusedAdamW: invalid weight_decay ", o.weight_decay());
}

}  // namespace

FusedAdamW::FusedAdamW(std::vector<torch::optim::OptimizerParamGroup> groups,
                       torch::optim::AdamWOptions defaults, OptimizerStateOptions state_options)
    : FusedOptimizer(std::move(groups), std::make_unique<torch::optim::AdamWOptions>(defaults),
                     std::move(state_options)) {
  bool amsgrad = false;
  for (const auto& g : param_groups_) {
    check(adamw_options(g.options()));
    amsgrad = amsgrad || adamw_options(g.options()).amsgrad();
  }
  std::vector<std::string> names{"exp_avg", "exp_avg_sq"};
  if (amsgrad)  // a flat buffer for all parameters if any group uses it
    names.push_back("max_exp_avg_sq");
  init_state(std::move(names));
}

FusedAdamW::FusedAdamW(std::vector<torch::Tensor> params, torch::optim::AdamWOptions defaults,
                       OptimizerStateOptions state_options)
    : FusedAdamW(one_group(std::move(params)), defaults, std::move(state_options)) {}

FusedAdamW::~FusedAdamW() = default;

void FusedAdamW::check_options(const torch::optim::OptimizerOptions& options) const {
  const auto& o = adamw_options(options);
  check(o);
  TORCH_CHECK(!o.amsgrad() || state_names().size() == 3,
              "FusedAdamW: amsgrad was turned on after construction");
}

void FusedAdamW::prepare(const Slot& slot, size_t index,
                         const torch::optim::OptimizerOptions& options) {
  if (scalars_.size() < num_slots())
    scalars_.resize(num_slots());
  const auto& o = adamw_options(options);
  const auto [beta1, beta2] = o.betas();
  const double step = static_cast<double>(slot.step);
  const double bias_correction1 = 1 - std::pow(beta1, step);
  const double bias_correction2 = 1 - std::pow(beta2, step);
  // Each double is rounded to float once, where torch::optim::AdamW passes it to an ATen op.
  auto& s = scalars_[index];
  s.apply_decay = o.weight_decay() != 0;
  s.decay = static_cast<float>(1 - o.lr() * o.weight_decay());
  s.beta1 = static_cast<float>(beta1);
  s.one_minus_beta1 = static_cast<float>(1 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1 - beta2);
  s.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  s.eps = static_cast<float>(o.eps());
  s.neg_step_size = static_cast<float>(-(o.lr() / bias_correction1));
  s.amsgrad = o.amsgrad();
  s.rounding_key = rounding_key(slot);
}

void FusedAdamW::update(const Slot& slot, size_t index, int64_t begin, int64_t end,
                        const float* grad, void* const* state) const {
  detail::AdamWSpan span;
  span.param = slot.param.data_ptr<float>() + begin;
  span.grad = grad;
  span.exp_avg = state[0];
  span.exp_avg_sq = state[1];
  span.max_exp_avg_sq = state_names().size() > 2 ? state[2] : nullptr;
  span.n = end - begin;
  span.first = begin;
  detail::kernels().adamw(scalars_[index], span, bf16_state());
}

}  // namespace fsdp
