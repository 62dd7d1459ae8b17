// See param_group.h for the state machines and the life of a unit through one step.
#include "param_group.h"

#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>

#include "prefetch.h"
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

void end_of_backward() {
  t_callback_queued = false;
  auto units = live_units();
  // Units whose hooks did not finish (the root, units whose inputs needed no grad): same
  // order on every rank (creation order), so their collectives match.
  for (auto& unit : units)
    unit->finish_backward();
  for (auto& unit : units)
    unit->finish_reduce();
  prefetch::end_backward();
  for (auto& unit : units)
    unit->reset_after_backward();
}

void queue_end_of_backward() {
  if (t_callback_queued)
    return;
  t_callback_queued = true;
  torch::autograd::Engine::get_default_engine().queue_callback(end_of_backward);
}

// Reduce-scatters issued but not yet waited, oldest first. Each post_backward completes the
// earlier ones before issuing its own, so at most one unit's reduce-scatter buffers are alive
// while the next unit computes (FSDP2 does the same).
thread_local std::vector<std::weak_ptr<ParamGroup>> t_reducing;

void finish_earlier_reduce_scatters() {
  for (auto& w : t_reducing) {
    if (auto unit = w.lock())
      unit->finish_reduce_scatter();
  }
  t_reducing.clear();
}

}  // namespace

ParamGroup::ParamGroup(std::string name, std::vector<std::pair<std::string, torch::Tensor>> params,
                       FullyShardOptions options, UnitGroups groups)
    : name_(std::move(name)), options_(std::move(options)), groups_(std::move(groups)) {
  const int rank = groups_.shard ? groups_.shard->rank() : 0;
  const int size = shard_size();
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
  static const char* const kNames[] = {"SHARDED", "GATHERING", "UNSHARDED"};
  if (sharded_state_ != expected) {
    fail(std::string(where) + ": unexpected sharded state " +
         kNames[static_cast<int>(sharded_state_)]);
  }
}

int64_t ParamGroup::sharded_bytes() const {
  int64_t b = 0;
  for (const auto& p : params_)
    b += p.padded_shard().numel() * p.padded_shard().element_size();
  return b;
}

int64_t ParamGroup::unsharded_bytes() const {
  return sharded_bytes() * shard_size();
}

void ParamGroup::issue_unshard(bool counted) {
  if (sharded_state_ != ShardedState::kSharded)
    return;
  std::vector<torch::Tensor> inputs, outputs;
  for (auto& p : params_) {
    p.alloc_unsharded();
    inputs.push_back(block_shards_ ? p.block_shard() : p.padded_shard());
    outputs.push_back(p.padded_unsharded());
  }
  if (counted) {
    counted_ = true;
    prefetch::acquire_slot();
  }
  sharded_state_ = ShardedState::kGathering;
  if (shard_size() > 1 && !params_.empty()) {
    // After a reshard to a block, backward gathers the blocks inside the (smaller) block group.
    auto& over = block_shards_ ? *groups_.post_forward : *groups_.shard;
    gather_ = all_gather(over, inputs, outputs, options_.all_gather_bucket_bytes());
  }
}

void ParamGroup::wait_unshard() {
  if (sharded_state_ != ShardedState::kGathering)
    return;
  if (gather_) {
    gather_->wait();
    gather_.reset();
  }
  if (block_shards_) {
    for (auto& p : params_)
      p.drop_block_shard();
    block_shards_ = false;
  }
  for (auto& p : params_)
    p.to_unsharded();
  sharded_state_ = ShardedState::kUnsharded;
}

void ParamGroup::release_slot() {
  if (counted_) {
    counted_ = false;
    prefetch::release_slot();
  }
}

void ParamGroup::reshard() {
  if (sharded_state_ == ShardedState::kSharded)
    return;
  // The transfer writes into the unsharded buffers: it must land before they are freed.
  wait_unshard();
  for (auto& p : params_) {
    p.to_sharded();
    p.free_unsharded();
  }
  sharded_state_ = ShardedState::kSharded;
  release_slot();
}

void ParamGroup::reset_after_backward() {
  if (backward_pending_)
    return;  // its backward has not run (yet): it keeps what the backward will need
  held_ = false;
  reshard();
  if (block_shards_) {
    for (auto& p : params_)
      p.drop_block_shard();
    block_shards_ = false;
  }
}

std::vector<torch::Tensor> ParamGroup::pre_forward(std::vector<torch::Tensor> inputs,
                                                   bool is_root_call) {
  // A new iteration: if the last backward died halfway (an exception), its callback never ran.
  if (is_root_call) {
    t_callback_queued = false;
    prefetch::begin_forward(*this);
  }
  if (training_state_ != TrainingState::kIdle) {
    fail(
        "forward entered again before the previous one finished (recursive fsdp::forward of "
        "the same unit is not supported)");
  }
  training_state_ = TrainingState::kForward;
  prefetch::record_forward(*this);
  prefetch::claim(*this);
  // The root stays gathered through the whole forward: it is not part of the pipeline.
  unshard(/*counted=*/!is_root_call && !held_);
  for (auto& next : prefetch::forward_targets(*this))
    prefetch::request(*next);

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
  const bool reshard_after =
      options_.reshard_after_forward() && options_.strategy() != ShardingStrategy::kShardGradOp;
  // The root's backward starts right after forward: resharding it would only gather it again.
  const bool keep = grad_mode && backward_pending_ && (is_root_call || !reshard_after);
  if (keep) {
    held_ = true;
    release_slot();  // held memory is the strategy's, not the prefetch pipeline's
  } else if (grad_mode && backward_pending_ && groups_.post_forward) {
    wait_unshard();
    for (auto& p : params_)
      p.keep_block_shard(groups_.post_forward->size(), groups_.post_forward->rank());
    reshard();
    block_shards_ = true;
  } else {
    reshard();
  }
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
  if (is_root_call)
    prefetch::end_forward();
}

void ParamGroup::abandon_forward() noexcept {
  reshard();
  held_ = false;
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
  prefetch::claim(*this);
  unshard(/*counted=*/!held_);
  if (options_.backward_prefetch() == BackwardPrefetch::kBackwardPre || backward_prefetch_list) {
    for (auto& next : prefetch::backward_targets(*this))
      prefetch::request(*next);
  }
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
    finish_earlier_reduce_scatters();
    // Reduce-scatter input, rank-major: [N][param 0 chunk | param 1 chunk | ...]. Every rank
    // communicates, even for parameters that received no gradient (zeros), so that all ranks
    // issue the same collectives.
    const int n = shard_size();
    int64_t s = 0;
    for (auto* p : trainable)
      s += p->padded_shard_numel();
    auto dtype = trainable.front()->dtype();
    for (auto* p : trainable) {
      if (p->dtype() != dtype)
        fail("trainable parameters of one unit must share a dtype");
    }
    auto opts = trainable.front()->padded_shard().options();
    PendingReduce pending;
    pending.params = trainable;
    {
      torch::NoGradGuard no_grad;
      pending.input = torch::empty({n * s}, opts);
      auto rows = pending.input.view({n, s});
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
      held_ = false;
      reshard();
      if (n > 1) {
        pending.output = torch::empty({s}, opts);
        pending.reduce_scatter =
            reduce_scatter(*groups_.shard, pending.input, pending.output, ReduceOp::kAvg);
      } else {
        pending.output = std::move(pending.input);  // nothing to scatter: the grads are ours
      }
    }
    reduce_ = std::move(pending);
    if (n == 1)
      issue_all_reduce();  // no reduce-scatter to wait for: overlap it with what follows
    else
      t_reducing.push_back(weak_from_this());
  }
  held_ = false;
  reshard();
  if (options_.backward_prefetch() == BackwardPrefetch::kBackwardPost && !backward_prefetch_list) {
    for (auto& next : prefetch::backward_targets(*this))
      prefetch::request(*next);
  }
  pre_backward_done_ = false;
  training_state_ = TrainingState::kIdle;
}

void ParamGroup::issue_all_reduce() {
  if (!reduce_ || reduce_->all_reduce_issued)
    return;
  reduce_->all_reduce_issued = true;
  if (!groups_.replicate || groups_.replicate->size() == 1)
    return;
  // Buckets bound the size of one collective (and of the backend's staging buffers).
  const auto& out = reduce_->output;
  const int64_t per_bucket = std::max<int64_t>(
      1, options_.all_reduce_bucket_bytes() / static_cast<int64_t>(out.element_size()));
  for (int64_t start = 0; start < out.numel(); start += per_bucket) {
    const int64_t len = std::min(per_bucket, out.numel() - start);
    reduce_->all_reduces.push_back(
        all_reduce(*groups_.replicate, out.narrow(0, start, len), ReduceOp::kAvg));
  }
}

void ParamGroup::finish_reduce_scatter() {
  if (!reduce_)
    return;
  if (reduce_->reduce_scatter) {
    reduce_->reduce_scatter->wait();
    reduce_->reduce_scatter.reset();
    reduce_->input = torch::Tensor();
  }
  issue_all_reduce();
}

void ParamGroup::finish_reduce() {
  if (!reduce_)
    return;
  finish_reduce_scatter();
  for (auto& w : reduce_->all_reduces)
    w->wait();
  int64_t offset = 0;
  for (auto* p : reduce_->params) {
    const int64_t len = p->padded_shard_numel();
    p->set_sharded_grad(reduce_->output.narrow(0, offset, len));
    offset += len;
  }
  reduce_.reset();
}

void ParamGroup::finish_backward() {
  if (backward_pending_ && pre_backward_done_) {
    post_backward();
  } else if (training_state_ == TrainingState::kPreBackward) {
    reshard();
    training_state_ = TrainingState::kIdle;
  }
}

}  // namespace fsdp::detail
