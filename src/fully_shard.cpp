// fully_shard(): turning a module into a unit, and the registry that finds units again.
#include <fsdp/fully_shard.h>

#include <torch/torch.h>

#include <map>
#include <mutex>
#include <unordered_set>

#include "collectives.h"
#include "param_group.h"
#include "prefetch.h"
#include "registry.h"

namespace fsdp {
namespace detail {
namespace {

struct Entry {
  const torch::nn::Module* key;
  std::weak_ptr<torch::nn::Module> module;
  std::shared_ptr<ParamGroup> unit;
  int64_t id;
};

std::mutex g_mutex;
std::vector<Entry> g_entries;
int64_t g_next_id = 0;

// Drops units whose module died (their parameters die with them).
void prune_locked() {
  std::erase_if(g_entries, [](const Entry& e) { return e.module.expired(); });
}

thread_local int t_forward_depth = 0;

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
    broadcast(group, buffer, /*root=*/0)->wait();
    int64_t offset = 0;
    for (const auto& t : ts) {
      t.detach().copy_(buffer.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

}  // namespace

std::vector<std::shared_ptr<ParamGroup>> live_units() {
  std::lock_guard<std::mutex> lock(g_mutex);
  prune_locked();
  std::vector<std::shared_ptr<ParamGroup>> out;
  for (const auto& e : g_entries)
    out.push_back(e.unit);
  return out;
}

int64_t unit_id(const ParamGroup& unit) {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (const auto& e : g_entries) {
    if (e.unit.get() == &unit)
      return e.id;
  }
  TORCH_INTERNAL_ASSERT(false, "fsdp unit '", unit.name(), "' is not registered");
}

std::shared_ptr<ParamGroup> unit_by_id(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (const auto& e : g_entries) {
    if (e.id == id && !e.module.expired())
      return e.unit;
  }
  return nullptr;
}

std::shared_ptr<ParamGroup> find_unit(const torch::nn::Module& module) {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (const auto& e : g_entries) {
    if (e.key == &module && !e.module.expired())
      return e.unit;
  }
  return nullptr;
}

bool in_unit_forward() {
  return t_forward_depth > 0;
}

std::vector<torch::Tensor> pre_forward(ParamGroup& unit, std::vector<torch::Tensor> args) {
  const bool is_root_call = t_forward_depth == 0;
  ++t_forward_depth;
  try {
    return unit.pre_forward(std::move(args), is_root_call);
  } catch (...) {
    --t_forward_depth;
    throw;
  }
}

void post_forward(ParamGroup& unit, const std::vector<torch::Tensor>& outputs) {
  unit.post_forward(outputs, /*is_root_call=*/t_forward_depth == 1);
  --t_forward_depth;
}

void abort_forward(ParamGroup& unit) noexcept {
  // Only undo what is still open: post_forward may have completed before the throw.
  if (unit.training_state() == TrainingState::kForward) {
    --t_forward_depth;
    unit.abandon_forward();
    if (t_forward_depth == 0) {
      try {
        prefetch::end_forward();
      } catch (...) {
        // Freeing prefetched units waits for their gathers; a failure there was reported by
        // the collective that failed first.
      }
    }
  }
}

std::shared_ptr<ParamGroup> unit_of_param(const c10::TensorImpl* param) {
  for (auto& unit : live_units()) {
    for (const auto& p : unit->params()) {
      if (p.param().unsafeGetTensorImpl() == param)
        return unit;
    }
  }
  return nullptr;
}

namespace {

std::vector<std::shared_ptr<ParamGroup>> units_under(const torch::nn::Module& module) {
  std::vector<std::shared_ptr<ParamGroup>> out;
  if (auto unit = find_unit(module))
    out.push_back(std::move(unit));
  for (const auto& child : module.modules(/*include_self=*/false)) {
    if (auto unit = find_unit(*child))
      out.push_back(std::move(unit));
  }
  return out;
}

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
UnitGroups resolve_groups(const FullyShardOptions& options) {
  auto& group = options.group();
  const int n = group->size();
  const int me = group->global_ranks().at(group->rank());
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
      const int s = options.hybrid_shard_size();
      TORCH_CHECK(s >= 1 && n % s == 0, "[rank ", me, "] fully_shard: hybrid_shard_size ", s,
                  " must be at least 1 and divide the group's ", n, " ranks");
      if (s == n) {
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
  const int k = options.reshard_after_forward_size();
  const bool reshards = options.reshard_after_forward() &&
                        options.strategy() != ShardingStrategy::kShardGradOp &&
                        options.strategy() != ShardingStrategy::kNoShard;
  if (k > 1 && reshards && g.shard) {
    const int shard_n = g.shard->size();
    TORCH_CHECK(shard_n % k == 0, "[rank ", me, "] fully_shard: reshard_after_forward_size ", k,
                " must divide the shard group's ", shard_n, " ranks");
    if (k < shard_n)
      g.post_forward = g.shard->block_group(k);
  }
  return g;
}

}  // namespace

}  // namespace detail

void fully_shard(const std::shared_ptr<torch::nn::Module>& module,
                 const FullyShardOptions& options) {
  TORCH_CHECK(module, "fully_shard: module is null");
  TORCH_CHECK(options.group(), "fully_shard: FullyShardOptions has no process group");
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
  auto& group = *options.group();

  // Parameters already owned by inner units stay theirs; shared (tied) parameters are taken once.
  std::unordered_set<const c10::TensorImpl*> taken;
  for (const auto& unit : detail::live_units()) {
    for (const auto& p : unit->params())
      taken.insert(p.param().unsafeGetTensorImpl());
  }
  std::vector<std::pair<std::string, torch::Tensor>> params;
  std::vector<torch::Tensor> to_sync;
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
  if (options.sync_module_states() && group.size() > 1) {
    // Buffers are not sharded, but they must agree too (e.g. a causal mask, running stats).
    for (const auto& b : module->buffers(/*recurse=*/true))
      to_sync.push_back(b);
    detail::broadcast_from_rank0(group, to_sync);
  }

  std::string name = module->name();
  auto unit = std::make_shared<detail::ParamGroup>(name, std::move(params), options,
                                                   detail::resolve_groups(options));
  std::lock_guard<std::mutex> lock(detail::g_mutex);
  detail::prune_locked();
  detail::g_entries.push_back({module.get(), module, std::move(unit), detail::g_next_id++});
}

void set_requires_gradient_sync(torch::nn::Module& module, bool sync) {
  for (auto& unit : detail::units_under(module))
    unit->set_requires_gradient_sync(sync);
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

const char* to_string(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::kFullShard:
      return "full_shard";
    case ShardingStrategy::kShardGradOp:
      return "shard_grad_op";
    case ShardingStrategy::kNoShard:
      return "no_shard";
    case ShardingStrategy::kHybridShard:
      return "hybrid_shard";
  }
  return "?";
}

const char* to_string(BackwardPrefetch p) {
  switch (p) {
    case BackwardPrefetch::kNone:
      return "none";
    case BackwardPrefetch::kBackwardPre:
      return "backward_pre";
    case BackwardPrefetch::kBackwardPost:
      return "backward_post";
  }
  return "?";
}

}  // namespace fsdp
