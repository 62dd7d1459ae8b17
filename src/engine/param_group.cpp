// See param_group.h for the state machines and the life of a unit through one step.
#include "param_group.h"

#include <torch/autograd.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>

#include <fsdp/core/memory.h>
#include <fsdp/detail/buffer_lifetimes.h>
#include <fsdp/detail/param_layout.h>

#include "prefetch.h"
#include "root_state.h"

namespace fsdp::detail {
namespace {

// Identity over the inputs of one unit call that require grad. Its backward runs once autograd
// has produced the gradients of all of them, i.e. when the call's backward through the unit is
// complete. AccumulateGrad nodes run before any other ready node (they have the highest
// priority in the engine's queue), so the parameters' gradients are in place by then.
struct PostBackward : public torch::autograd::Function<PostBackward> {
  // `inputs` must be a TensorList: autograd only sees tensors passed as Tensor or TensorList
  // (a std::vector<Tensor> would count as an opaque non-tensor argument, cutting the graph).
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<CallRecord> call,
                                                at::TensorList inputs) {
    ctx->saved_data["call"] = c10::IValue::make_capsule(std::move(call));
    return inputs.vec();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto call = c10::static_intrusive_pointer_cast<CallRecord>(ctx->saved_data["call"].toCapsule());
    if (auto unit = call->unit.lock())
      unit->post_backward(*call);
    torch::autograd::variable_list result;
    result.reserve(grads.size() + 1);
    result.emplace_back();  // the call record is not a tensor
    for (auto& g : grads)
      result.push_back(std::move(g));
    return result;
  }
};

// Runs `fn`, appending what it throws to `errors` (rollback paths must go on): its first line,
// without the stack trace a c10::Error carries (a warning is no place for 30 frames).
template <typename F>
void collect_errors(std::vector<std::string>& errors, F&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    const std::string what = e.what();
    errors.push_back(what.substr(0, what.find('\n')));
  }
}

}  // namespace

bool CallRecord::alive() const {
  return std::any_of(output_nodes.begin(), output_nodes.end(),
                     [](const auto& w) { return !w.expired(); });
}

ParamGroup::ParamGroup(std::string name, std::vector<std::pair<std::string, torch::Tensor>> params,
                       FullyShardOptions options, UnitGroups groups)
    : name_(std::move(name)), options_(std::move(options)), groups_(std::move(groups)) {
  const int rank = groups_.shard ? groups_.shard->rank() : 0;
  const int size = shard_size();
  params_.reserve(params.size());
  for (auto& [fqn, p] : params) {
    const auto& offload = options_.offload_policy();
    params_.emplace_back(fqn, std::move(p), rank, size, options_.param_init(), options_.mp_policy(),
                         offload.has_value(), offload.has_value() && offload->pin_memory());
  }
}

const ParamGroup::Moments& ParamGroup::moments() {
  if (!moments_) {
    const bool root = state_ && state_->root_unit().get() == this;
    const std::string unit = root ? "(root)" : name_;
    moments_ = Moments{memory::moment_id("forward " + unit), memory::moment_id("backward " + unit),
                       memory::moment_id("recompute " + unit)};
  }
  return *moments_;
}

void ParamGroup::set_backward_moment_of_root() {
  if (auto root = state_->root_unit())
    memory::set_moment(root->moments().backward);
}

std::string ParamGroup::context() const {
  return "unit '" + name_ + "'";
}

void ParamGroup::fail(const std::string& msg) const {
  const auto& g = *options_.group();
  TORCH_CHECK(false, "[rank ", g.global_ranks().at(g.rank()), "] fsdp ", context(), ": ", msg);
}

bool ParamGroup::has_trainable_params() const {
  return std::any_of(params_.begin(), params_.end(),
                     [](const ShardedParam& p) { return p.requires_grad(); });
}

int64_t ParamGroup::sharded_bytes() const {
  int64_t b = 0;
  for (const auto& p : params_)
    b += p.padded_shard().numel() * p.padded_shard().element_size();
  return b;
}

int64_t ParamGroup::unsharded_bytes() const {
  int64_t b = 0;
  for (const auto& p : params_)
    b += p.unsharded_nbytes();
  return b;
}

torch::ScalarType ParamGroup::reduce_dtype(torch::ScalarType master) const {
  return reduce_dtype_of(options_.mp_policy(), master);
}

// ---- Gathering --------------------------------------------------------------------------------

void ParamGroup::issue_unshard(bool counted) {
  memory::CategoryScope tag(memory::Category::kGathered);
  if (unit_state_.gathered())
    return;
  const bool gathers = shard_size() > 1 && !params_.empty();
  std::vector<torch::Tensor> inputs, outputs;
  for (auto& p : params_) {
    p.alloc_unsharded();
    if (!gathers) {
      p.fill_unsharded_locally();  // nothing to gather; a cast or a format's round trip
      continue;
    }
    // Mixed precision: a cast or encoded copy of the shard, kept until the gather is waited
    // for. Block shards are already in the compute dtype (decoded, if encoded): they travel
    // as they are.
    if (unit_state_.block_shards()) {
      inputs.push_back(p.block_shard());
      outputs.push_back(p.padded_unsharded());
    } else {
      inputs.push_back(p.gather_input());
      outputs.push_back(p.gather_output());
    }
  }
  unit_state_.gather_issued(counted);
  if (counted)
    state_->prefetcher().acquire_slot();
  if (gathers) {
    // After a reshard to a block, backward gathers the blocks inside the (smaller) block group.
    auto& over = unit_state_.block_shards() ? *groups_.post_forward : *groups_.shard;
    gather_ = all_gather(over, inputs, outputs, options_.all_gather_bucket_bytes(), context());
    gather_inputs_ = std::move(inputs);
  }
}

void ParamGroup::wait_unshard() {
  memory::CategoryScope tag(memory::Category::kGathered);
  if (unit_state_.sharded() != ShardedState::kGathering)
    return;
  if (gather_) {
    // reset() before the wait can throw would destroy an unwaited work; keep it until waited.
    gather_->wait();
    gather_.reset();
    for (auto& p : params_)
      p.decode_gather();  // what arrived in a gather format (nothing otherwise)
  }
  free_at(UnitEvent::kGatherDone);
  for (auto& p : params_)
    p.to_unsharded();
  unit_state_.gather_done();
}

void ParamGroup::free_at(UnitEvent event) {
  for (const auto& l : gather_lifetimes()) {
    if (l.freed != event)
      continue;
    switch (l.buffer) {
      case UnitBuffer::kUnsharded:
        for (auto& p : params_)
          p.free_unsharded();
        break;
      case UnitBuffer::kGatherInFlight:
        gather_inputs_.clear();
        for (auto& p : params_)
          p.free_gather_output();
        break;
      case UnitBuffer::kBlockShards:
        drop_block_shards();
        break;
      default:
        TORCH_INTERNAL_ASSERT(false, "fsdp: a reduction's buffer in the gather's lifetimes");
    }
  }
}

void ParamGroup::drop_block_shards() {
  if (!unit_state_.block_shards())
    return;
  for (auto& p : params_)
    p.drop_block_shard();
  unit_state_.dropped_block_shards();
}

void ParamGroup::reshard() {
  if (!unit_state_.gathered())
    return;
  // The transfer writes into the unsharded buffers: it must land (or fail) before they are
  // freed. CollectiveWork::wait() returns or throws only once every bucket has finished.
  std::exception_ptr failed;
  try {
    wait_unshard();
  } catch (...) {
    failed = std::current_exception();
    gather_.reset();
    gather_inputs_.clear();
  }
  for (auto& p : params_)
    p.to_sharded();
  free_at(UnitEvent::kResharded);
  if (unit_state_.resharded())
    state_->prefetcher().release_slot();
  if (failed)
    std::rethrow_exception(failed);
}

void ParamGroup::release() {
  if (!unit_state_.releasable())
    return;
  reshard();
}

void ParamGroup::set_replicate_group(std::shared_ptr<ProcessGroup> group) {
  if (unit_state_.gathered() || unit_state_.training() != TrainingState::kIdle || !reduces_.empty())
    fail("set_replicate_group between steps only (the unit is " + unit_state_.describe() + ")");
  if (!groups_.replicate && group->size() > 1)
    fail("set_replicate_group: a unit without replicas (" +
         std::string(to_string(options_.strategy())) + ") takes no group of " +
         std::to_string(group->size()) + " ranks");
  if (groups_.replicate || group->size() > 1)  // a unit without replicas stays without
    groups_.replicate = std::move(group);
}

void ParamGroup::set_shard_group(std::shared_ptr<ProcessGroup> group) {
  if (unit_state_.gathered() || unit_state_.training() != TrainingState::kIdle || !reduces_.empty())
    fail("set_shard_group between steps only (the unit is " + unit_state_.describe() + ")");
  if (!groups_.shard) {
    if (group->size() > 1)
      fail("set_shard_group: a unit sharded over one rank takes no group of " +
           std::to_string(group->size()) + " ranks");
    return;
  }
  if (group->global_ranks() != groups_.shard->global_ranks())
    fail("set_shard_group: the new group must hold the same ranks in the same order (" +
         std::to_string(groups_.shard->size()) + " ranks from global rank " +
         std::to_string(groups_.shard->global_ranks().front()) + "), got " +
         std::to_string(group->size()) + " from " + std::to_string(group->global_ranks().front()));
  // The post-forward blocks (reshard_after_forward_size) are the new group's: made once per
  // group by every member (block_group is collective the first time, cached after), and the
  // units call this in the same order on every rank.
  if (groups_.post_forward)
    groups_.post_forward = group->block_group(groups_.post_forward->size());
  groups_.shard = std::move(group);
}

void ParamGroup::set_user_held(bool held) {
  unit_state_.set_user_held(held);
}

// ---- Forward ----------------------------------------------------------------------------------

void ParamGroup::pre_forward(bool is_root_call) {
  if (unit_state_.training() == TrainingState::kForward) {
    fail(
        "forward entered again before the previous one finished (a unit cannot run inside its "
        "own forward)");
  }
  unit_state_.forward_entered(is_root_call);
  moment_before_forward_ = memory::current_moment();
  const bool recompute = torch::autograd::get_current_graph_task_id() != -1;
  memory::set_moment(recompute ? moments().recompute : moments().forward);
  forward_kind_ = recompute ? "recompute" : "forward";
  forward_span_ = trace::begin();
  try {
    auto& prefetcher = state_->prefetcher();
    prefetcher.record_forward(*this);
    prefetcher.claim(*this);
    // The root call stays gathered through the model's forward: it is not part of the pipeline.
    unshard(/*counted=*/!is_root_call);
    for (auto& next : prefetcher.forward_targets(*this))
      prefetcher.request(*next);
    forming_ = c10::make_intrusive<CallRecord>();
    forming_->unit = weak_from_this();
    forming_->epoch = state_->epoch();
  } catch (...) {
    abort_forward();
    throw;
  }
}

std::vector<torch::Tensor> ParamGroup::wrap_inputs(std::vector<torch::Tensor> inputs) {
  if (inputs.empty() || !torch::GradMode::is_enabled())
    return inputs;
  auto wrapped = PostBackward::apply(forming_, at::TensorList(inputs));
  for (const auto& t : wrapped) {
    if (t.grad_fn()) {
      forming_->post_node.emplace(t.grad_fn());
      break;
    }
  }
  return wrapped;
}

void ParamGroup::post_forward(const std::vector<torch::Tensor>& outputs) {
  TORCH_INTERNAL_ASSERT(unit_state_.training() == TrainingState::kForward, context(),
                        ": post_forward outside its forward");
  // The forward's span ends when this returns, on whichever path (a reshard may throw).
  struct EndSpan {
    ParamGroup& unit;
    ~EndSpan() {
      trace::end(unit.forward_span_, unit.forward_kind_, unit.forward_kind_, unit.name_);
    }
  } end_span{*this};
  std::vector<torch::Tensor> hooked;
  if (torch::GradMode::is_enabled()) {
    for (const auto& out : outputs) {
      if (out.requires_grad())
        hooked.push_back(out);
    }
  }
  const bool pending = !hooked.empty();
  if (pending && unit_state_.user_held() && has_trainable_params()) {
    fail(
        "is held unsharded by fsdp::unshard(), and this forward's outputs need gradients: call "
        "fsdp::reshard() (or end the UnshardGuard) before training through it");
  }
  auto call = std::move(forming_);
  // A nested unit hands the moment back to its caller. After the root call of a training
  // forward, what runs until the root's backward hook (the loss and its backward) is counted as
  // the root's backward.
  memory::set_moment(unit_state_.root_call() && pending ? moments().backward
                                                        : moment_before_forward_);
  if (pending) {
    for (const auto& out : hooked) {
      // Copy the handle: register_hook is non-const on the autograd metadata only.
      torch::Tensor handle = out;
      handle.register_hook([call](const torch::Tensor&) {
        if (auto unit = call->unit.lock())
          unit->pre_backward(*call);
      });
      if (out.grad_fn())
        call->output_nodes.emplace_back(out.grad_fn());
    }
    calls_.push_back(call);
  }
  unit_state_.forward_exited();
  if (unit_state_.training() != TrainingState::kIdle)
    return;  // a recomputation inside this unit's backward: the backward needs it gathered
  const bool reshards = frees_after_forward(options_);
  // The root call's backward starts right after forward: resharding it would only gather it
  // again. Held memory is the strategy's, not the prefetch pipeline's: no slot.
  if (pending && (unit_state_.root_call() || !reshards)) {
    if (unit_state_.hold_for_backward())
      state_->prefetcher().release_slot();
  }
  if (unit_state_.held() || unit_state_.user_held())
    return;
  if (pending && groups_.post_forward) {
    wait_unshard();
    memory::CategoryScope tag(memory::Category::kGathered);  // a part of the gathered unit
    for (auto& p : params_)
      p.keep_block_shard(groups_.post_forward->size(), groups_.post_forward->rank());
    reshard();
    unit_state_.kept_block_shards();
  } else {
    reshard();
  }
}

void ParamGroup::abort_forward() {
  if (unit_state_.training() != TrainingState::kForward)
    return;  // post_forward completed before the throw
  forming_.reset();
  forward_span_ = {};
  unit_state_.forward_exited();
  // The forward fails: what the rate limiter held back is not needed (RootState::exit_forward
  // drops it too). Dropped first, so that giving back this unit's slot issues nothing.
  state_->prefetcher().drop_queued();
  release();
}

// ---- Backward ---------------------------------------------------------------------------------

bool ParamGroup::expects_backward() const {
  return std::any_of(calls_.begin(), calls_.end(), [](const auto& c) { return c->alive(); });
}

bool ParamGroup::awaits_backward() const {
  const uint64_t pass = state_->pass_id();
  return std::any_of(calls_.begin(), calls_.end(),
                     [&](const auto& c) { return c->pre_pass != pass && c->alive(); });
}

void ParamGroup::forget_calls(std::optional<uint64_t> failed_epoch) {
  std::erase_if(calls_, [&](const auto& c) {
    return !c->alive() || (failed_epoch && c->epoch == *failed_epoch);
  });
  if (calls_.empty()) {
    unit_state_.release_hold();
    drop_block_shards();
    release();
  }
}

void ParamGroup::begin_backward() {
  if (!unit_state_.grads_stashed()) {
    // Autograd is about to accumulate full-shape grads into the same parameters.
    for (auto& p : params_)
      p.stash_sharded_grad();
  }
  unit_state_.backward_began();
}

void ParamGroup::pre_backward(CallRecord& call) {
  const uint64_t pass = state_->on_backward_hook();
  if (call.pre_pass == pass)
    return;  // another output of the same call
  call.pre_pass = pass;
  if (!backward_span_.active())
    backward_span_ = trace::begin();
  if (std::none_of(calls_.begin(), calls_.end(), [&](const auto& c) { return c.get() == &call; })) {
    // A call processed by an earlier pass runs backward again (its graph was retained).
    calls_.push_back(c10::intrusive_ptr<CallRecord>::reclaim_copy(&call));
  }
  if (unit_state_.training() == TrainingState::kIdle)
    begin_backward();
  memory::set_moment(moments().backward);
  auto& prefetcher = state_->prefetcher();
  prefetcher.claim(*this);
  unshard(/*counted=*/!unit_state_.held() && !unit_state_.user_held());
  if (options_.backward_prefetch() == BackwardPrefetch::kBackwardPre || backward_prefetch_list) {
    for (auto& next : prefetcher.backward_targets(*this))
      prefetcher.request(*next);
  }
}

void ParamGroup::post_backward(CallRecord& call) {
  const uint64_t pass = state_->on_backward_hook();
  if (call.post_pass == pass)
    return;
  if (std::none_of(calls_.begin(), calls_.end(), [&](const auto& c) { return c.get() == &call; }))
    return;  // a call whose outputs needed no grad: nothing of the unit ran for it
  call.post_pass = pass;
  if (unit_state_.training() != TrainingState::kPreBackward)
    return;
  // Another call of this unit is in the middle of its backward (its first output gradient
  // arrived, its inputs' gradients are not complete): it still reads the gathered parameters,
  // so the reduction waits for it. Otherwise each call's backward reduces on its own: a unit
  // called twice far apart is not held gathered (with its unsharded grads) in between.
  for (const auto& other : calls_) {
    if (other.get() != &call && other->pre_pass == pass && other->post_pass != pass)
      return;
  }
  reduce_gradients();
}

void ParamGroup::reduce_gradients() {
  // The backward's span ends with its reduce-scatter issued and the next prefetch requested.
  struct EndSpan {
    ParamGroup& unit;
    ~EndSpan() { trace::end(unit.backward_span_, "backward", "backward", unit.name_); }
  } end_span{*this};
  memory::CategoryScope tag(memory::Category::kGrads);
  unit_state_.reduce_began();
  std::vector<ShardedParam*> trainable;
  for (auto& p : params_) {
    if (p.requires_grad())
      trainable.push_back(&p);
  }
  if (!requires_gradient_sync_) {
    // Accumulation without communication: this pass's grads are held aside and added to the
    // local accumulator when the pass ends well (end_backward_pass).
    for (auto* p : trainable)
      p->hold_pass_grad(p->take_unsharded_grad());
  } else if (!trainable.empty()) {
    auto dtype = trainable.front()->dtype();
    for (auto* p : trainable) {
      if (p->dtype() != dtype) {
        fail("trainable parameters of one unit must share a dtype ('" + p->fqn() + "' is " +
             c10::toString(p->dtype()) + ", '" + trainable.front()->fqn() + "' is " +
             c10::toString(dtype) + ")");
      }
    }
    state_->finish_reduce_scatters();
    // Reduce-scatter input, rank-major: [N][param 0 chunk | param 1 chunk | ... | P flags].
    // Every rank sends every parameter, zeros where it has no gradient, so that all ranks
    // issue the same collectives with the same sizes.
    const int n = shard_size();
    const int64_t n_params = static_cast<int64_t>(trainable.size());
    int64_t chunks = 0;
    for (auto* p : trainable)
      chunks += p->padded_shard_numel();
    // ReduceFormat::kInt8 (a reduce-scatter to quantize): the flags start at a scale-block
    // boundary, the columns before them zero (int8_reduce.h).
    // Reduced in reduce_dtype; the results join the grads in the master dtype (add_to_stash).
    // On the compute device, also when the shards are offloaded to the host. The row's layout
    // is the one the planner predicts from (fsdp/detail/param_layout.h).
    const auto& mp = options_.mp_policy();
    const auto layout =
        reduce_layout(chunks, n_params, n, reduce_dtype(trainable.front()->dtype()), mp);
    const bool int8 = layout.int8;
    if (int8 && !int8_reduce_)
      int8_reduce_.emplace(mp.int8_block_size(), mp.error_feedback());
    const int64_t flags_at = layout.flags_at;
    const int64_t s = layout.row;
    auto opts =
        torch::TensorOptions().dtype(layout.dtype).device(trainable.front()->compute_device());
    PendingReduce pending(int8    ? ReduceKind::kInt8
                          : n > 1 ? ReduceKind::kScatter
                                  : ReduceKind::kLocal);
    pending.params = trainable;
    pending.flags_offset = flags_at;
    {
      torch::NoGradGuard no_grad;
      pending.input = torch::empty({n * s}, opts);
      auto rows = pending.input.view({n, s});
      if (flags_at > chunks)
        rows.narrow(1, chunks, flags_at - chunks).zero_();
      auto flags = rows.narrow(1, flags_at, n_params);
      int64_t offset = 0;
      for (int64_t i = 0; i < n_params; ++i) {
        auto* p = trainable[static_cast<size_t>(i)];
        const int64_t len = p->padded_shard_numel();
        auto g = p->take_unsharded_grad();
        // Grads kept by earlier no-sync passes travel with the pass's first reduction only.
        const bool has_grad = p->copy_grad_into(
            g, rows.narrow(1, offset, len).view({n, p->chunk_rows(), p->row_numel()}),
            /*add_kept=*/pass_reduction_.get() == PassReduction::kNone);
        flags.select(1, i).fill_(has_grad ? 1 : 0);
        offset += len;
      }
      // The unsharded parameters are done with: free them before the collective's buffers
      // are allocated, so a unit never holds params, grads and both buffers at once.
      unit_state_.release_hold();
      if (!unit_state_.user_held())
        reshard();
      if (int8) {
        pending.output = torch::empty({s}, opts);
        pending.wire = int8_reduce_->encode(rows, chunks);
        // The issue starts with the encoding: the wire is what the exchange reads, and the
        // rows may go before its receive buffer is allocated.
        pending.free_at(UnitEvent::kReduceIssued);
        pending.received = torch::empty_like(pending.wire);
        pending.reduce_scatter =
            reduce_scatter_exchange(*groups_.shard, pending.wire, pending.received, context());
        pending.advance(ReduceStage::kScattering, name_);
      } else if (n > 1) {
        pending.output = torch::empty({s}, opts);
        pending.reduce_scatter = reduce_scatter(*groups_.shard, pending.input, pending.output,
                                                ReduceOp::kAvg, context());
        pending.advance(ReduceStage::kScattering, name_);
        pending.free_at(UnitEvent::kReduceIssued);
      } else {
        pending.output = std::move(pending.input);  // nothing to scatter: the grads are ours
        pending.advance(ReduceStage::kScattered, name_);
        pending.free_at(UnitEvent::kReduceIssued);
      }
    }
    reduces_.push_back(std::move(pending));
    pass_reduction_.reduced(name_);
    if (n == 1)
      issue_all_reduce();  // no reduce-scatter to wait for: overlap it with what follows
    else
      state_->track_reduce_scatter(*this);
  }
  unit_state_.release_hold();
  unit_state_.reduce_done();
  release();
  set_backward_moment_of_root();  // what runs next belongs to the enclosing unit
  // Units reduced earlier whose reductions are complete: their hooks (the optimizer in
  // backward) run now, while this unit's reduce-scatter is in flight.
  state_->run_post_reduce_hooks(this);
  if (options_.backward_prefetch() == BackwardPrefetch::kBackwardPost && !backward_prefetch_list) {
    auto& prefetcher = state_->prefetcher();
    for (auto& next : prefetcher.backward_targets(*this))
      prefetcher.request(*next);
  }
}

void ParamGroup::issue_all_reduce() {
  memory::CategoryScope tag(memory::Category::kGrads);
  for (auto& r : reduces_) {
    if (r.stage() != ReduceStage::kScattered)
      continue;
    r.advance(ReduceStage::kReplicating, name_);
    r.all_reduce_round = state_->reduce_round();
    if (!groups_.replicate || groups_.replicate->size() == 1) {
      start_host_copy(r);  // final already: nothing to all-reduce
      continue;
    }
    // Buckets bound the size of one collective (and of the backend's staging buffers).
    const auto& out = r.output;
    const int64_t per_bucket = std::max<int64_t>(
        1, options_.all_reduce_bucket_bytes() / static_cast<int64_t>(out.element_size()));
    for (int64_t start = 0; start < out.numel(); start += per_bucket) {
      const int64_t len = std::min(per_bucket, out.numel() - start);
      r.all_reduces.push_back(
          all_reduce(*groups_.replicate, out.narrow(0, start, len), ReduceOp::kAvg, context()));
    }
  }
}

void ParamGroup::finish_reduce_scatter() {
  memory::CategoryScope tag(memory::Category::kGrads);
  for (auto& r : reduces_) {
    if (r.stage() == ReduceStage::kScattering) {
      r.reduce_scatter->wait();
      r.reduce_scatter.reset();
      if (r.kind == ReduceKind::kInt8)
        int8_reduce_->decode_mean(r.received, r.output);
      r.free_at(UnitEvent::kScattered);
      r.advance(ReduceStage::kScattered, name_);
    }
  }
  issue_all_reduce();
}

void ParamGroup::finish_backward() {
  if (unit_state_.training() == TrainingState::kPreBackward)
    reduce_gradients();
}

void ParamGroup::wait_reduces() {
  memory::CategoryScope tag(memory::Category::kGrads);
  finish_reduce_scatter();  // every reduction is kReplicating or kReduced after it
  for (auto& r : reduces_) {
    if (r.stage() != ReduceStage::kReplicating)
      continue;
    const bool replicated = !r.all_reduces.empty();
    for (auto& w : r.all_reduces)
      w->wait();
    r.all_reduces.clear();
    r.advance(ReduceStage::kReduced, name_);
    if (replicated)
      start_host_copy(r);  // final only now (without an all-reduce it started at issue)
  }
}

void ParamGroup::start_host_copy(PendingReduce& r) const {
  const auto& offload = options_.offload_policy();
  if (!offload || r.params.empty() || !r.params.front()->offloaded() || !r.output.defined())
    return;
  r.start_host_copy(offload->pin_memory());
}

void ParamGroup::install_grads() {
  memory::CategoryScope tag(memory::Category::kGrads);
  torch::NoGradGuard no_grad;
  for (auto& r : reduces_) {
    TORCH_INTERNAL_ASSERT(r.stage() == ReduceStage::kReduced, "fsdp: unit '", name_,
                          "': grads installed from a reduction still ", to_string(r.stage()));
    // Offloaded on an accelerator: the whole output is already on its way to the host
    // (start_host_copy); else one host copy of the flags per unit (a device sync on CUDA, at
    // the end of backward only).
    const torch::Tensor& out = r.wait_host_copy() ? r.host_output : r.output;
    auto flags = out.narrow(0, r.flags_offset, static_cast<int64_t>(r.params.size()))
                     .to(torch::kCPU, torch::kFloat);
    const float* flag = flags.data_ptr<float>();
    int64_t offset = 0;
    for (size_t i = 0; i < r.params.size(); ++i) {
      auto* p = r.params[i];
      const int64_t len = p->padded_shard_numel();
      if (flag[i] > 0)
        p->add_to_stash(out.narrow(0, offset, len));
      offset += len;
    }
  }
}

void ParamGroup::drop_installed_reduces() {
  // kInstalled ends every reduction's lifetime (lifetimes::valid): the records go, and with them
  // whatever buffers the earlier events left.
  reduces_.clear();
}

bool ParamGroup::run_post_reduce_hook(bool end_of_pass, uint64_t round) {
  if (!post_reduce_hook_ || pass_reduction_.get() != PassReduction::kReduced)
    return false;
  if (!end_of_pass) {
    for (const auto& c : calls_) {
      if (c->alive() && c->post_pass != state_->pass_id())
        return false;  // this call's backward may still come and reduce again
    }
    for (const auto& r : reduces_) {
      // Still scattering, or replicating over collectives issued in this round.
      if (r.stage() == ReduceStage::kScattering ||
          (r.stage() == ReduceStage::kReplicating && r.all_reduce_round == round &&
           !r.all_reduces.empty()))
        return false;
    }
  }
  // The optimizer inside backward runs here: its span, under this one, steps this unit.
  trace::Span span("post_reduce_hook", "post-reduce hook", name_);
  wait_reduces();
  install_grads();
  std::vector<torch::Tensor> params;
  for (auto& p : params_) {
    if (p.requires_grad()) {
      p.restore_stash();
      params.push_back(p.param());
    }
  }
  // The reduced buffers now back the grads (or were copied into them): the hook may free them.
  drop_installed_reduces();
  pass_reduction_.hook_ran(name_);
  post_reduce_hook_(params);
  return true;
}

void ParamGroup::end_backward_pass(uint64_t pass) {
  // A reduction in this pass sent the grads kept by earlier no-sync passes along.
  const bool kept_consumed = pass_reduction_.get() != PassReduction::kNone;
  const bool hook_ran = pass_reduction_.get() == PassReduction::kHookRan;
  for (auto& p : params_) {
    if (unit_state_.grads_stashed() && !hook_ran)
      p.restore_stash();
    p.commit_pass(/*drop_kept=*/kept_consumed);
  }
  drop_installed_reduces();
  pass_reduction_.pass_closed();
  backward_span_ = {};  // a unit whose backward never reduced (nothing reached it)
  unit_state_.pass_closed();
  drop_block_shards();
  release();
  std::erase_if(calls_, [&](const auto& c) {
    return c->pre_pass == pass || c->post_pass == pass || !c->alive();
  });
}

void ParamGroup::abort_backward_pass(uint64_t pass, std::vector<std::string>& errors) {
  // Every transfer must have landed (or failed) before its buffers go.
  for (auto& r : reduces_) {
    if (r.stage() == ReduceStage::kScattering)
      collect_errors(errors, [&] { r.reduce_scatter->wait(); });
    for (auto& w : r.all_reduces)
      collect_errors(errors, [&] { w->wait(); });
  }
  reduces_.clear();
  if (int8_reduce_ && pass_reduction_.get() != PassReduction::kNone)
    int8_reduce_->abort();  // its residual describes a reduction that did not land
  const bool hook_ran = pass_reduction_.get() == PassReduction::kHookRan;
  for (auto& p : params_) {
    // The stash replaces whatever autograd accumulated in the failed pass (a unit whose
    // post-reduce hook ran keeps what the hook left: see set_post_reduce_hook).
    if (unit_state_.grads_stashed() && !hook_ran)
      p.restore_stash();
    p.abort_pass();
  }
  pass_reduction_.pass_closed();
  backward_span_ = {};
  unit_state_.pass_closed();
  collect_errors(errors, [&] { release(); });
  drop_block_shards();
  std::erase_if(calls_, [&](const auto& c) {
    return c->pre_pass == pass || c->post_pass == pass || !c->alive();
  });
}

}  // namespace fsdp::detail
