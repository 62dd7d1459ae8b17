// fsdp::FusedSGD: torch::optim::SGD's scalars per parameter, the kernel per piece.
#include <fsdp/optim/fused_optimizer.h>

#include "optimizer_kernels.h"

namespace fsdp {
namespace {

const torch::optim::SGDOptions& sgd_options(const torch::optim::OptimizerOptions& o) {
  return static_cast<const torch::optim::SGDOptions&>(o);
}

}  // namespace

FusedSGD::FusedSGD(std::vector<torch::optim::OptimizerParamGroup> groups,
                   torch::optim::SGDOptions defaults, OptimizerStateOptions state_options)
    : FusedOptimizer(std::move(groups), std::make_unique<torch::optim::SGDOptions>(defaults),
                     std::move(state_options)) {
  bool momentum = false;
  for (const auto& g : param_groups_) {
    const auto& o = sgd_options(g.options());
    TORCH_CHECK(o.lr() >= 0, "FusedSGD: invalid learning rate ", o.lr());
    TORCH_CHECK(o.momentum() >= 0, "FusedSGD: invalid momentum ", o.momentum());
    TORCH_CHECK(o.weight_decay() >= 0, "FusedSGD: invalid weight_decay ", o.weight_decay());
    TORCH_CHECK(!o.nesterov() || (o.momentum() > 0 && o.dampening() == 0),
                "FusedSGD: Nesterov momentum requires a momentum and zero dampening");
    momentum = momentum || o.momentum() != 0;
  }
  // Without momentum there is no state at all.
  init_state(momentum ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{});
}

FusedSGD::FusedSGD(std::vector<torch::Tensor> params, torch::optim::SGDOptions defaults,
                   OptimizerStateOptions state_options)
    : FusedSGD(one_group(std::move(params)), defaults, std::move(state_options)) {}

FusedSGD::~FusedSGD() = default;

void FusedSGD::check_options(const torch::optim::OptimizerOptions& options) const {
  const auto& o = sgd_options(options);
  TORCH_CHECK(o.momentum() == 0 || !state_names().empty(),
              "FusedSGD: momentum was turned on after construction");
}

void FusedSGD::prepare(const Slot& slot, size_t index,
                       const torch::optim::OptimizerOptions& options) {
  if (scalars_.size() < num_slots())
    scalars_.resize(num_slots());
  const auto& o = sgd_options(options);
  auto& s = scalars_[index];
  s.apply_weight_decay = o.weight_decay() != 0;
  s.weight_decay = static_cast<float>(o.weight_decay());
  s.use_momentum = o.momentum() != 0;
  s.momentum = static_cast<float>(o.momentum());
  s.one_minus_dampening = static_cast<float>(1 - o.dampening());
  s.nesterov = o.nesterov();
  s.neg_lr = static_cast<float>(-1 * o.lr());
  s.first = slot.step == 1;  // torch's SGD: the buffer starts as a copy of the gradient
  s.rounding_key = rounding_key(slot);
}

void FusedSGD::update(const Slot& slot, size_t index, int64_t begin, int64_t end, const float* grad,
                      void* const* state) const {
  detail::SGDSpan span;
  span.param = slot.param.data_ptr<float>() + begin;
  span.grad = grad;
  span.momentum_buffer = state_names().empty() ? nullptr : state[0];
  span.n = end - begin;
  span.first = begin;
  detail::kernels().sgd(scalars_[index], span, bf16_state());
}

}  // namespace fsdp
