// fully_shard(): turning a module into a unit and attaching it to its model's RootState;
// ForwardCall, the unit side of fsdp::forward; the per-model settings (prefetch lists, gradient
// sync, communication counters).
#include <fsdp/core/memory.h>
#include <fsdp/detail/group_layout.h>
#include <fsdp/fully_shard.h>

#include <torch/torch.h>

#include <map>
#include <unordered_map>
#include <unordered_set>

#include <fsdp/distributed/collectives.h>
#include "param_group.h"
#include "prefetch.h"
#include "registry.h"
#include "root_state.h"

namespace fsdp {
namespace detail {
namespace {

// Same values on every rank: group rank 0's tensors, one broadcast per dtype.
void broadcast_from_rank0(ProcessGroup& group, const std::vector<torch::Tensor>& tensors) {
  std::map<torch::ScalarType, std::vector<torch::Tensor>> by_dtype;
  for (const auto& t : tensors) {
    if (t.numel() > 0)
      by_dtype[t.scalar_type()].push_back(t);
  }
  torch::NoGradGuard no_grad;
  for (auto& [dtype, ts] : by_dtype) {
    std::vector<torch::Tensor> flat;
    for (const auto& t : ts)
      flat.push_back(t.detach().reshape({-1}));
    auto buffer = torch::cat(flat);
    broadcast(group, buffer, /*root=*/0, "sync_module_states")->wait();
    int64_t offset = 0;
    for (const auto& t : ts) {
      t.detach().copy_(buffer.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

}  // namespace

ForwardCall::ForwardCall(std::shared_ptr<ParamGroup> unit) : unit_(std::move(unit)) {
  const auto& mp = unit_->options().mp_policy();
  if (mp.cast_forward_inputs())
    input_dtype_ = mp.param_dtype();
  output_dtype_ = mp.output_dtype();
  auto& state = unit_->state();
  const bool is_root_call = state.enter_forward(*unit_);
  try {
    unit_->pre_forward(is_root_call);
  } catch (...) {
    finished_ = true;  // pre_forward cleaned up after itself
    state.exit_forward(/*failed=*/true);
    throw;
  }
}

bool ForwardCall::casts_input(const torch::Tensor& t) const {
  return input_dtype_ && t.is_floating_point() && t.scalar_type() != *input_dtype_;
}

bool ForwardCall::takes(const torch::Tensor& t) const {
  if (!t.defined())
    return false;
  return (t.requires_grad() && torch::GradMode::is_enabled()) || casts_input(t);
}

std::vector<torch::Tensor> ForwardCall::wrap_inputs(std::vector<torch::Tensor> inputs) {
  std::vector<torch::Tensor> need_grad;
  std::vector<size_t> where;
  for (size_t i = 0; i < inputs.size(); ++i) {
    auto& t = inputs[i];
    // A differentiable cast: the gradient flows back to the caller in its own dtype.
    if (casts_input(t))
      t = t.to(*input_dtype_);
    if (t.requires_grad() && torch::GradMode::is_enabled()) {
      inputs_require_grad_ = true;
      need_grad.push_back(t);
      where.push_back(i);
    }
  }
  if (!need_grad.empty()) {
    auto wrapped = unit_->wrap_inputs(std::move(need_grad));
    for (size_t j = 0; j < where.size(); ++j)
      inputs[where[j]] = std::move(wrapped[j]);
  }
  return inputs;
}

torch::Tensor ForwardCall::cast_output(const torch::Tensor& t) const {
  if (!output_dtype_ || !t.defined() || !t.is_floating_point() || t.scalar_type() == *output_dtype_)
    return t;
  return t.to(*output_dtype_);
}

const std::string& ForwardCall::unit_name() const {
  return unit_->name();
}

CheckpointMode ForwardCall::checkpoint_mode(bool replayable) const {
  const auto mode = unit_->options().activation_checkpointing();
  if (mode == CheckpointMode::kNone || !torch::GradMode::is_enabled())
    return CheckpointMode::kNone;
  // Nothing in this call needs a gradient: no backward will come to recompute for.
  if (!inputs_require_grad_ && !unit_->has_trainable_params())
    return CheckpointMode::kNone;
  TORCH_CHECK(replayable, "fsdp::forward: unit '", unit_->name(),
              "' checkpoints its activations, so its forward must be able to run again on "
              "copies of its arguments; an argument is passed with std::ref or cannot be copied");
  return mode;
}

void ForwardCall::finish(const std::vector<torch::Tensor>& outputs) {
  unit_->post_forward(outputs);
  finished_ = true;
  unit_->state().exit_forward(/*failed=*/false);
}

ForwardCall::~ForwardCall() {
  if (finished_)
    return;
  // The module's forward (or post_forward) threw and that exception is on its way to the
  // caller: undo what is open; a failure while doing so (a collective that failed too) must
  // not replace the original exception.
  try {
    unit_->abort_forward();
  } catch (const std::exception& e) {
    TORCH_WARN("fsdp: while abandoning the forward of unit '", unit_->name(), "': ", e.what());
  }
  try {
    unit_->state().exit_forward(/*failed=*/true);
  } catch (const std::exception& e) {
    TORCH_WARN("fsdp: while abandoning a forward of the model of unit '", unit_->name(),
               "': ", e.what());
  }
}

void check_no_grad_through_reference(const std::vector<torch::Tensor>& tensors) {
  if (!torch::GradMode::is_enabled())
    return;
  for (const auto& t : tensors) {
    TORCH_CHECK(!(t.defined() && t.requires_grad()),
                "fsdp::forward: an argument passed with std::ref holds a tensor that requires "
                "grad; its gradient would bypass the unit's backward hooks. Pass it by value or "
                "const reference (fsdp then wraps it), or detach it");
  }
}

namespace {

std::vector<ProcessGroup*> groups_under(const torch::nn::Module& module) {
  std::vector<ProcessGroup*> out;
  auto add = [&](const std::shared_ptr<ProcessGroup>& g) {
    if (g && std::find(out.begin(), out.end(), g.get()) == out.end())
      out.push_back(g.get());
  };
  for (const auto& unit : units_under(module)) {
    add(unit->options().group());
    add(unit->groups().shard);
    add(unit->groups().replicate);
    add(unit->groups().post_forward);
  }
  return out;
}

std::vector<std::weak_ptr<ParamGroup>> units_of(
    const std::vector<std::shared_ptr<torch::nn::Module>>& modules, const char* what) {
  std::vector<std::weak_ptr<ParamGroup>> out;
  for (const auto& m : modules) {
    TORCH_CHECK(m, what, ": null module in the list");
    auto unit = find_unit(*m);
    TORCH_CHECK(unit, what, ": module '", m->name(),
                "' is not an FSDP unit (call fully_shard on it)");
    out.push_back(unit);
  }
  return out;
}

// The process groups of a unit, from its strategy. Subgroups are created collectively (every
// rank applies fully_shard in the same order) and cached by the parent group.
// Options that say nothing under the chosen strategy, or contradict it, are refused: a
// setting that silently does nothing is a misconfiguration the user cannot see.
void check_option_conflicts(const FullyShardOptions& o, int me) {
  const auto strategy = o.strategy();
  const std::string where = "[rank " + std::to_string(me) + "] fully_shard: ";
  TORCH_CHECK(o.hybrid_shard_size() == 0 || strategy == ShardingStrategy::kHybridShard, where,
              "hybrid_shard_size(", o.hybrid_shard_size(),
              ") applies to the hybrid_shard strategy only, and the strategy is ",
              to_string(strategy));
  TORCH_CHECK(!(strategy == ShardingStrategy::kShardGradOp && o.reshard_after_forward() &&
                *o.reshard_after_forward()),
              where,
              "the shard_grad_op strategy keeps parameters gathered from forward to backward; "
              "reshard_after_forward(true) contradicts it");
  TORCH_CHECK(!(strategy == ShardingStrategy::kNoShard && o.reshard_after_forward()), where,
              "the no_shard strategy never gathers parameters, so reshard_after_forward(",
              *o.reshard_after_forward() ? "true" : "false", ") means nothing with it");
  if (o.replicate_group()) {
    TORCH_CHECK(strategy == ShardingStrategy::kHybridShard, where,
                "a replicate_group applies to the hybrid_shard strategy only, and the strategy is ",
                to_string(strategy));
    TORCH_CHECK(o.hybrid_shard_size() == 0 || o.hybrid_shard_size() == o.group()->size(), where,
                "with a replicate_group, the group is one replica's ranks (the shard group), so "
                "hybrid_shard_size(",
                o.hybrid_shard_size(), ") must be 0 or its ", o.group()->size(), " ranks");
  }
  if (o.reshard_after_forward_size() != 0) {
    TORCH_CHECK(o.reshard_after_forward_size() > 0, where, "reshard_after_forward_size ",
                o.reshard_after_forward_size(), " must be positive (0: off)");
    TORCH_CHECK(
        strategy == ShardingStrategy::kFullShard || strategy == ShardingStrategy::kHybridShard,
        where, "reshard_after_forward_size(", o.reshard_after_forward_size(),
        ") applies to the full_shard and hybrid_shard strategies, and the strategy is ",
        to_string(strategy));
    TORCH_CHECK(reshards_after_forward(o), where, "reshard_after_forward_size(",
                o.reshard_after_forward_size(),
                ") reshards after forward, and reshard_after_forward(false) keeps parameters "
                "gathered");
  }
}

UnitGroups resolve_groups(const FullyShardOptions& options) {
  auto& group = options.group();
  const int n = group->size();
  const int me = group->global_ranks().at(group->rank());
  // The sizes (and their checks) are the layout's, which the planner predicts from.
  // A replicate group given: `group` is one replica, a hybrid block of n ranks of n.
  const bool given = options.replicate_group() != nullptr;
  GroupLayout layout;
  try {
    layout = group_layout(options.strategy(), given ? n : options.hybrid_shard_size(),
                          options.reshard_after_forward(), options.reshard_after_forward_size(), n,
                          group->rank());
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "[rank ", me, "] ", e.what_without_backtrace());
  }
  UnitGroups g;
  switch (options.strategy()) {
    case ShardingStrategy::kFullShard:
    case ShardingStrategy::kShardGradOp:
      g.shard = group;
      break;
    case ShardingStrategy::kNoShard:
      g.replicate = group;
      break;
    case ShardingStrategy::kHybridShard: {
      const int s = layout.shard_size;
      if (given) {
        if (s > 1)
          g.shard = group;
        g.replicate = options.replicate_group();
      } else if (s == n) {
        g.shard = group;  // one block: plain full sharding
      } else if (s == 1) {
        g.replicate = group;  // blocks of one: plain replication
      } else {
        g.shard = group->block_group(s);
        g.replicate = group->strided_group(s);
      }
      break;
    }
  }
  if (layout.post_forward_size > 0)
    g.post_forward = g.shard->block_group(layout.post_forward_size);
  TORCH_INTERNAL_ASSERT((g.shard ? g.shard->size() : 1) == layout.shard_size &&
                        (g.shard ? g.shard->rank() : 0) == layout.shard_rank);
  return g;
}

}  // namespace

}  // namespace detail

void fully_shard(const std::shared_ptr<torch::nn::Module>& module,
                 const FullyShardOptions& options) {
  TORCH_CHECK(module, "fully_shard: module is null");
  TORCH_CHECK(options.group(), "fully_shard: FullyShardOptions has no process group");
  detail::check_option_conflicts(options,
                                 options.group()->global_ranks().at(options.group()->rank()));
  TORCH_CHECK(!is_sharded(*module), "fully_shard: module '", module->name(),
              "' is already sharded");
  TORCH_CHECK(options.max_inflight_all_gathers() >= 1,
              "fully_shard: max_inflight_all_gathers must be at least 1, got ",
              options.max_inflight_all_gathers());
  TORCH_CHECK(options.all_gather_bucket_bytes() >= 0,
              "fully_shard: all_gather_bucket_bytes must be >= 0 (0: one call per unit), got ",
              options.all_gather_bucket_bytes());
  TORCH_CHECK(options.all_reduce_bucket_bytes() >= 1,
              "fully_shard: all_reduce_bucket_bytes must be at least 1, got ",
              options.all_reduce_bucket_bytes());
  const auto& mp = options.mp_policy();
  for (const auto& [what, dtype] :
       {std::pair{"param_dtype", mp.param_dtype()}, std::pair{"reduce_dtype", mp.reduce_dtype()},
        std::pair{"output_dtype", mp.output_dtype()}}) {
    TORCH_CHECK(!dtype || c10::isFloatingType(*dtype), "fully_shard: MixedPrecisionPolicy::", what,
                " must be a floating-point dtype, got ", *dtype);
  }
  TORCH_CHECK(mp.int8_block_size() >= 1,
              "fully_shard: MixedPrecisionPolicy::int8_block_size must be at least 1, got ",
              mp.int8_block_size());
  auto& group = *options.group();
  const auto entries = detail::live_entries();

  // Bottom-up only: a unit made first owns everything under it, so a module inside it would
  // find its parameters taken.
  for (const auto& e : entries) {
    for (const auto& child : e.module->modules(/*include_self=*/false)) {
      TORCH_CHECK(child.get() != module.get(), "fully_shard: module '", module->name(),
                  "' is inside unit '", e.unit->name(),
                  "', which was sharded first and owns its parameters: apply fully_shard "
                  "bottom-up (the blocks first, then the model)");
    }
  }
  // torch::nn::Sequential's forward calls its children directly, not through fsdp::forward,
  // so a sharded child would compute with its shards: refuse it here rather than fail with a
  // shape error in the middle of a forward. (ModuleList and ModuleDict have no forward.)
  for (const auto& m : module->modules(/*include_self=*/true)) {
    if (!dynamic_cast<const torch::nn::SequentialImpl*>(m.get()))
      continue;
    for (const auto& child : m->children()) {
      TORCH_CHECK(!detail::find_unit(*child), "fully_shard: '", child->name(),
                  "' is a child of a torch::nn::Sequential, whose forward calls it "
                  "directly instead of through fsdp::forward, so it cannot be a unit: write a "
                  "module whose forward calls fsdp::forward(child, ...), or shard the Sequential "
                  "as one unit");
    }
  }

  // Parameters already owned by inner units stay theirs; shared (tied) parameters are taken once.
  std::unordered_set<const c10::TensorImpl*> taken;
  for (const auto& e : entries) {
    for (const auto& p : e.unit->params())
      taken.insert(p.param().unsafeGetTensorImpl());
  }
  std::vector<std::pair<std::string, torch::Tensor>> params;
  std::vector<torch::Tensor> to_sync;
  const std::pair<std::string, torch::Tensor>* first_trainable = nullptr;
  for (const auto& item : module->named_parameters(/*recurse=*/true)) {
    const auto* impl = item.value().unsafeGetTensorImpl();
    if (!taken.insert(impl).second)
      continue;
    TORCH_CHECK(item.value().device().type() == group.device_type(), "fully_shard: parameter '",
                item.key(), "' is on ", item.value().device(), " but the process group's backend '",
                group.backend_name(), "' needs ", c10::DeviceTypeName(group.device_type()),
                " tensors");
    params.emplace_back(item.key(), item.value());
    // Parameters that param_init fills are the same on every rank by construction.
    if (!options.param_init())
      to_sync.push_back(item.value());
  }
  // A unit reduces its gradients in one collective of one dtype.
  for (const auto& p : params) {
    if (!p.second.requires_grad())
      continue;
    if (!first_trainable) {
      first_trainable = &p;
      continue;
    }
    TORCH_CHECK(p.second.scalar_type() == first_trainable->second.scalar_type(),
                "fully_shard: module '", module->name(), "': trainable parameters '",
                first_trainable->first, "' (", first_trainable->second.scalar_type(), ") and '",
                p.first, "' (", p.second.scalar_type(),
                ") have different dtypes; a unit reduces its gradients in one dtype: shard them "
                "in different units, or freeze one");
  }
  if (options.sync_module_states() && group.size() > 1) {
    // Buffers are not sharded, but they must agree too (e.g. a causal mask, running stats).
    for (const auto& b : module->buffers(/*recurse=*/true))
      to_sync.push_back(b);
    detail::broadcast_from_rank0(group, to_sync);
  }

  // The shards are allocated here (an unsharded buffer too, freed before this returns).
  memory::CategoryScope tag(memory::Category::kParams);
  auto unit = std::make_shared<detail::ParamGroup>(module->name(), std::move(params), options,
                                                   detail::resolve_groups(options));
  // The models of the units already sharded under `module` become part of this one; their
  // units are named by their path inside it.
  std::unordered_map<const torch::nn::Module*, std::string> paths;
  for (const auto& item : module->named_modules(/*name_prefix=*/"", /*include_self=*/false))
    paths.emplace(item.value().get(), item.key());
  auto state = std::make_shared<detail::RootState>();
  for (const auto& e : entries) {
    auto it = paths.find(e.module.get());
    if (it == paths.end())
      continue;
    e.unit->set_name(it->second);
    // Hold the inner state: adopting moves its units, whose references kept it alive.
    auto inner = e.unit->state_ptr();
    if (inner != state)
      state->adopt(*inner);
  }
  unit->set_state(state);
  state->add(unit);
  detail::register_unit(module, std::move(unit));
}

void release_dead_models() {
  detail::release_dead_units();
}

void set_requires_gradient_sync(torch::nn::Module& module, bool sync) {
  for (auto& unit : detail::units_under(module))
    unit->set_requires_gradient_sync(sync);
}

void set_replicate_group(torch::nn::Module& module, std::shared_ptr<ProcessGroup> group) {
  TORCH_CHECK(group, "fsdp::set_replicate_group: no group");
  for (auto& unit : detail::units_under(module))
    unit->set_replicate_group(group);
}

void set_shard_group(torch::nn::Module& module, std::shared_ptr<ProcessGroup> group) {
  TORCH_CHECK(group, "fsdp::set_shard_group: no group");
  for (auto& unit : detail::units_under(module))
    unit->set_shard_group(group);
}

void set_post_reduce_hook(torch::nn::Module& module, PostReduceHook hook) {
  for (auto& unit : detail::units_under(module))
    unit->set_post_reduce_hook(hook);
}

bool is_sharded(const torch::nn::Module& module) {
  return detail::find_unit(module) != nullptr;
}

void set_modules_to_forward_prefetch(
    const torch::nn::Module& module,
    const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  auto unit = detail::find_unit(module);
  TORCH_CHECK(unit, "set_modules_to_forward_prefetch: module '", module.name(),
              "' is not an FSDP unit");
  unit->forward_prefetch_list = detail::units_of(modules, "set_modules_to_forward_prefetch");
}

void set_modules_to_backward_prefetch(
    const torch::nn::Module& module,
    const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  auto unit = detail::find_unit(module);
  TORCH_CHECK(unit, "set_modules_to_backward_prefetch: module '", module.name(),
              "' is not an FSDP unit");
  unit->backward_prefetch_list = detail::units_of(modules, "set_modules_to_backward_prefetch");
}

CommStats comm_stats(const torch::nn::Module& module) {
  CommStats total;
  for (auto* g : detail::groups_under(module))
    total += g->comm_stats();
  return total;
}

void reset_comm_stats(const torch::nn::Module& module) {
  for (auto* g : detail::groups_under(module))
    g->comm_stats().reset();
}

}  // namespace fsdp
