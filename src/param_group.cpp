// See param_group.h for the state machines and the life of a unit through one step.
#include "param_group.h"

#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>

#include "registry.h"

namespace fsdp::detail {
namespace {

// Identity over a unit's tensor inputs. Its backward runs once autograd has produced the
// gradients of all of them, i.e. when the unit's own backward is complete: the moment to
// reduce-scatter. AccumulateGrad nodes run before any other ready node (they have the highest
// priority in the engine's queue), so the parameters' gradients are in place by then.
struct PostBackward : public torch::autograd::Function<PostBackward> {
  // `inputs` must be a TensorList: autograd only sees tensors passed as Tensor or TensorList
  // (a std::vector<Tensor> would count as an opaque non-tensor argument, cutting the graph).
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                int64_t unit_id, at::TensorList inputs) {
    ctx->saved_data["unit"] = unit_id;
    return inputs.vec();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (auto unit = unit_by_id(ctx->saved_data["unit"].toInt()))
      unit->post_backward();
    torch::autograd::variable_list result;
    result.reserve(grads.size() + 1);
    result.emplace_back();  // unit_id is not a tensor
    for (auto& g : grads)
      result.push_back(std::move(g));
    return result;
  }
};

// One end-of-backward callback per backward pass, queued by the first pre-backward hook.
thread_local bool t_callback_queued = false;

void queue_end_of_backward() {
  if (t_callback_queued)
    return;
  t_callback_queued = true;
  torch::autograd::Engine::get_default_engine().queue_callback([] {
    t_callback_queued = false;
    for (auto& unit : live_units())
      unit->finish_backward();
  });
}

}  // namespace

ParamGroup::ParamGroup(std::string name, std::vector<std::pair<std::string, torch::Tensor>> params,
                       FullyShardOptions options)
    : name_(std::move(name)), options_(std::move(options)) {
  const int rank = group().rank(), size = group().size();
  params_.reserve(params.size());
  for (auto& [fqn, p] : params) {
    params_.emplace_back(fqn, std::move(p), rank, size, options_.param_init());
  }
}

void ParamGroup::fail(const std::string& msg) const {
  TORCH_CHECK(false, "[rank ", group().global_ranks().at(group().rank()), "] fsdp unit '", name_,
              "': ", msg);
}

void ParamGroup::check_state(ShardedState expected, const char* where) const {
  if (sharded_state_ != expected) {
    fail(std::string(where) + ": unexpected sharded state " +
         (sharded_state_ == ShardedState::kSharded ? "SHARDED" : "UNSHARDED"));
  }
}

int64_t ParamGroup::sharded_bytes() const {
  int64_t b = 0;
  for (const auto& p : params_)
    b += p.padded_shard().numel() * p.padded_shard().element_size();
  return b;
}

int64_t ParamGroup::unsharded_bytes() const {
  return sharded_bytes() * group().size();
}

void ParamGroup::unshard() {
  if (sharded_state_ == ShardedState::kUnsharded)
    return;
  if (!params_.empty()) {
    std::vector<torch::Tensor> inputs, outputs;
    for (auto& p : params_) {
      p.alloc_unsharded();
      inputs.push_back(p.padded_shard());
      outputs.push_back(p.padded_unsharded());
    }
    all_gather(group(), inputs, outputs)->wait();
    for (auto& p : params_)
      p.to_unsharded();
  }
  sharded_state_ = ShardedState::kUnsharded;
}

void ParamGroup::reshard() {
  if (sharded_state_ == ShardedState::kSharded)
    return;
  for (auto& p : params_) {
    p.to_sharded();
    p.free_unsharded();
  }
  sharded_state_ = ShardedState::kSharded;
}

std::vector<torch::Tensor> ParamGroup::pre_forward(std::vector<torch::Tensor> inputs,
                                                   bool is_root_call) {
  // A new iteration: if the last backward died halfway (an exception), its callback never ran.
  if (is_root_call)
    t_callback_queued = false;
  if (training_state_ != TrainingState::kIdle) {
    fail(
        "forward entered again before the previous one finished (recursive fsdp::forward of "
        "the same unit is not supported)");
  }
  training_state_ = TrainingState::kForward;
  unshard();
  const bool grad_mode = torch::GradMode::is_enabled();
  bool trainable = false;
  for (const auto& p : params_)
    trainable = trainable || p.requires_grad();
  if (grad_mode && trainable) {
    backward_pending_ = true;
    pre_backward_done_ = false;
  }
  bool any_input_requires_grad = false;
  for (const auto& t : inputs)
    any_input_requires_grad = any_input_requires_grad || t.requires_grad();
  if (grad_mode && any_input_requires_grad) {
    return PostBackward::apply(unit_id(*this), at::TensorList(inputs));
  }
  return inputs;
}

void ParamGroup::post_forward(const std::vector<torch::Tensor>& outputs, bool is_root_call) {
  const bool grad_mode = torch::GradMode::is_enabled();
  // The root's backward starts right after forward: resharding it would only gather it again.
  const bool keep = grad_mode && (is_root_call || !options_.reshard_after_forward());
  if (!keep)
    reshard();
  if (grad_mode && backward_pending_) {
    std::weak_ptr<ParamGroup> weak = weak_from_this();
    for (const auto& out : outputs) {
      if (!out.requires_grad())
        continue;
      // Copy the tensor handle: register_hook is non-const on the autograd metadata only.
      torch::Tensor handle = out;
      handle.register_hook([weak](const torch::Tensor&) {
        if (auto self = weak.lock())
          self->pre_backward();
      });
    }
  }
  training_state_ = TrainingState::kIdle;
}

void ParamGroup::abandon_forward() noexcept {
  reshard();
  backward_pending_ = false;
  pre_backward_done_ = false;
  training_state_ = TrainingState::kIdle;
}

void ParamGroup::pre_backward() {
  if (pre_backward_done_ || !backward_pending_)
    return;
  pre_backward_done_ = true;
  queue_end_of_backward();
  training_state_ = TrainingState::kPreBackward;
  for (auto& p : params_)
    p.stash_sharded_grad();
  unshard();
}

void ParamGroup::post_backward() {
  if (!backward_pending_)
    return;
  backward_pending_ = false;
  training_state_ = TrainingState::kPostBackward;
  if (!pre_backward_done_) {
    // Autograd never reached this unit's outputs; its parameters got no gradient this pass.
    for (auto& p : params_)
      p.stash_sharded_grad();
  }
  std::vector<ShardedParam*> trainable;
  for (auto& p : params_) {
    if (p.requires_grad())
      trainable.push_back(&p);
  }
  if (!requires_gradient_sync_) {
    for (auto* p : trainable)
      p->keep_unsharded_grad();
    trainable.clear();
  }
  if (!trainable.empty()) {
    // Reduce-scatter input, rank-major: [N][param 0 chunk | param 1 chunk | ...]. Every rank
    // communicates, even for parameters that received no gradient (zeros), so that all ranks
    // issue the same collectives.
    const int n = group().size();
    int64_t s = 0;
    for (auto* p : trainable)
      s += p->padded_shard_numel();
    auto dtype = trainable.front()->dtype();
    for (auto* p : trainable) {
      if (p->dtype() != dtype)
        fail("trainable parameters of one unit must share a dtype");
    }
    auto opts = trainable.front()->padded_shard().options();
    torch::Tensor output;
    {
      torch::NoGradGuard no_grad;
      auto input = torch::empty({n * s}, opts);
      auto rows = input.view({n, s});
      int64_t offset = 0;
      for (auto* p : trainable) {
        const int64_t len = p->padded_shard_numel();
        auto g = p->take_unsharded_grad();
        p->copy_grad_into(g,
                          rows.narrow(1, offset, len).view({n, p->chunk_rows(), p->row_numel()}));
        offset += len;
      }
      // The unsharded parameters are done with: free them before the collective's buffers
      // are allocated, so a unit never holds params, grads and both buffers at once.
      reshard();
      output = torch::empty({s}, opts);
      reduce_scatter(group(), input, output, ReduceOp::kAvg)->wait();
    }
    int64_t offset = 0;
    for (auto* p : trainable) {
      const int64_t len = p->padded_shard_numel();
      p->set_sharded_grad(output.narrow(0, offset, len));
      offset += len;
    }
  }
  reshard();
  pre_backward_done_ = false;
  training_state_ = TrainingState::kIdle;
}

void ParamGroup::finish_backward() {
  if (backward_pending_ && pre_backward_done_) {
    post_backward();
  } else if (sharded_state_ == ShardedState::kUnsharded &&
             training_state_ == TrainingState::kPreBackward) {
    reshard();
    training_state_ = TrainingState::kIdle;
  }
}

}  // namespace fsdp::detail
