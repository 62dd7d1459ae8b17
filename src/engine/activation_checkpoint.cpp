// See checkpoint.h. The region is one custom autograd node (reentrant checkpointing): its
// forward runs the region without grad, its backward runs it again with grad and
// backpropagates through that fresh graph with a nested backward call, which accumulates the
// parameters' gradients exactly as an unchecked run would and returns the inputs' gradients.
#include <fsdp/activation_checkpoint.h>

#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/torch.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <utility>

#include <fsdp/core/trace.h>

#include "saved_ops.h"

namespace fsdp {

namespace detail {
namespace {

// The random generators a region may draw from: the CPU one, and the default generator of each
// accelerator device its inputs live on.
std::vector<at::Generator> generators_for(const std::vector<torch::Tensor>& inputs) {
  std::vector<at::Generator> gens = {at::detail::getDefaultCPUGenerator()};
  std::vector<c10::Device> seen;
  for (const auto& t : inputs) {
    if (!t.defined() || t.device().is_cpu())
      continue;
    if (std::find(seen.begin(), seen.end(), t.device()) != seen.end())
      continue;
    seen.push_back(t.device());
    gens.push_back(at::globalContext().defaultGenerator(t.device()));
  }
  return gens;
}

std::vector<torch::Tensor> states_of(std::vector<at::Generator>& gens) {
  std::vector<torch::Tensor> states;
  for (auto& g : gens) {
    std::lock_guard<std::mutex> lock(g.mutex());
    states.push_back(g.get_state());
  }
  return states;
}

void set_states(std::vector<at::Generator>& gens, const std::vector<torch::Tensor>& states) {
  for (size_t i = 0; i < gens.size(); ++i) {
    std::lock_guard<std::mutex> lock(gens[i].mutex());
    gens[i].set_state(states[i]);
  }
}

// Sets the generators to the region's saved states for the recomputation and puts the caller's
// states back afterwards, also when the recomputation throws.
class ReplayRng {
 public:
  ReplayRng(std::vector<at::Generator> gens, const std::vector<torch::Tensor>& saved)
      : gens_(std::move(gens)), outer_(states_of(gens_)) {
    set_states(gens_, saved);
  }
  ~ReplayRng() { set_states(gens_, outer_); }
  ReplayRng(const ReplayRng&) = delete;
  ReplayRng& operator=(const ReplayRng&) = delete;

 private:
  std::vector<at::Generator> gens_;
  std::vector<torch::Tensor> outer_;
};

// What the node keeps between forward and backward.
struct Region : torch::CustomClassHolder {
  CheckpointFn again;
  std::string name;       // the unit's, for the trace
  size_t num_inputs = 0;  // the caller's; a placeholder may follow them (checkpoint_apply)
  CheckpointMode mode = CheckpointMode::kFull;
  std::vector<torch::Tensor> inputs;  // detached: same storage and version counter
  std::vector<bool> requires_grad;
  std::vector<int64_t> versions;
  std::vector<at::Generator> generators;
  std::vector<torch::Tensor> rng_states;
  SavedOps saved_ops;
};

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  // `inputs` is a TensorList so that autograd sees the tensors (see PostBackward).
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<Region> region,
                                                const CheckpointFn* first, at::TensorList inputs) {
    auto& r = *region;
    for (const auto& t : inputs) {
      r.inputs.push_back(t.defined() ? t.detach() : t);
      r.requires_grad.push_back(t.defined() && t.requires_grad());
      r.versions.push_back(t.defined() ? t._version() : 0);
    }
    r.generators = generators_for(r.inputs);
    r.rng_states = states_of(r.generators);
    std::vector<torch::Tensor> outputs;
    {
      SavedOps::Scope scope(r.mode == CheckpointMode::kSelective ? &r.saved_ops : nullptr,
                            /*record=*/true);
      outputs = (*first)(std::vector<torch::Tensor>(inputs.begin(), inputs.begin() + r.num_inputs));
    }
    std::vector<torch::Tensor> non_differentiable;
    for (const auto& o : outputs) {
      TORCH_CHECK(o.defined(), "activation checkpointing: a region returned an undefined tensor");
      if (!o.is_floating_point() && !o.is_complex())
        non_differentiable.push_back(o);
    }
    ctx->mark_non_differentiable(non_differentiable);
    ctx->saved_data["region"] = c10::IValue::make_capsule(std::move(region));
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto region = c10::static_intrusive_pointer_cast<Region>(ctx->saved_data["region"].toCapsule());
    auto& r = *region;
    for (size_t i = 0; i < r.inputs.size(); ++i) {
      TORCH_CHECK(!r.inputs[i].defined() || r.inputs[i]._version() == r.versions[i],
                  "activation checkpointing: input ", i,
                  " of a checkpointed region was modified in place after the region's forward; "
                  "its recomputation would not see the values the forward saw");
    }
    std::vector<torch::Tensor> inputs;
    for (size_t i = 0; i < r.inputs.size(); ++i) {
      auto t = r.inputs[i].defined() ? r.inputs[i].detach() : r.inputs[i];
      if (r.requires_grad[i])
        t.requires_grad_(true);
      inputs.push_back(t);
    }
    std::vector<torch::Tensor> outputs;
    {
      trace::Span span("recompute", "recompute", r.name);
      torch::AutoGradMode grad_mode(true);
      ReplayRng rng(r.generators, r.rng_states);
      SavedOps::Scope scope(r.mode == CheckpointMode::kSelective ? &r.saved_ops : nullptr,
                            /*record=*/false);
      outputs = r.again(std::vector<torch::Tensor>(inputs.begin(), inputs.begin() + r.num_inputs));
    }
    TORCH_CHECK(outputs.size() == grads.size(),
                "activation checkpointing: the recomputation returned ", outputs.size(),
                " tensors, the forward ", grads.size());
    std::vector<torch::Tensor> roots, root_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (grads[i].defined() && outputs[i].requires_grad()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grads[i]);
      }
    }
    // Whatever the forward kept for the recomputation is no longer needed.
    r.saved_ops.entries.clear();
    if (!roots.empty())
      torch::autograd::backward(roots, root_grads);
    torch::autograd::variable_list result = {torch::Tensor(), torch::Tensor()};
    for (size_t i = 0; i < inputs.size(); ++i)
      result.push_back(r.requires_grad[i] ? inputs[i].grad() : torch::Tensor());
    return result;
  }
};

}  // namespace

std::vector<torch::Tensor> checkpoint_apply(const CheckpointFn& first, CheckpointFn again,
                                            std::vector<torch::Tensor> inputs, CheckpointMode mode,
                                            std::string name) {
  if (mode == CheckpointMode::kNone || !torch::GradMode::is_enabled())
    return first(inputs);
  const bool any_grad = std::any_of(inputs.begin(), inputs.end(), [](const torch::Tensor& t) {
    return t.defined() && t.requires_grad();
  });
  const size_t num_inputs = inputs.size();
  if (!any_grad) {
    // The region's parameters need the node to run in backward even when no input requires
    // grad (the first block after an embedding of frozen tokens): one empty tensor that does.
    inputs.push_back(torch::empty({0}, torch::TensorOptions().requires_grad(true)));
  }
  auto region = c10::make_intrusive<Region>();
  region->mode = mode;
  region->again = std::move(again);
  region->name = std::move(name);
  region->num_inputs = num_inputs;
  return CheckpointFunction::apply(std::move(region), &first, at::TensorList(inputs));
}

}  // namespace detail

std::vector<torch::Tensor> checkpoint(
    const std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>& fn,
    std::vector<torch::Tensor> inputs, CheckpointMode mode) {
  return detail::checkpoint_apply(fn, fn, std::move(inputs), mode);
}

}  // namespace fsdp
