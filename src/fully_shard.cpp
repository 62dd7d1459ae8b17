// fully_shard(): turning a module into a unit, and the registry that finds units again.
#include <fsdp/fully_shard.h>

#include <torch/torch.h>

#include <map>
#include <mutex>
#include <unordered_set>

#include "collectives.h"
#include "param_group.h"
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
  }
}

}  // namespace detail

void fully_shard(const std::shared_ptr<torch::nn::Module>& module,
                 const FullyShardOptions& options) {
  TORCH_CHECK(module, "fully_shard: module is null");
  TORCH_CHECK(options.group(), "fully_shard: FullyShardOptions has no process group");
  TORCH_CHECK(!is_sharded(*module), "fully_shard: module '", module->name(),
              "' is already sharded");
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
  auto unit = std::make_shared<detail::ParamGroup>(name, std::move(params), options);
  std::lock_guard<std::mutex> lock(detail::g_mutex);
  detail::prune_locked();
  detail::g_entries.push_back({module.get(), module, std::move(unit), detail::g_next_id++});
}

void set_requires_gradient_sync(torch::nn::Module& module, bool sync) {
  if (auto unit = detail::find_unit(module))
    unit->set_requires_gradient_sync(sync);
  for (const auto& child : module.modules(/*include_self=*/false)) {
    if (auto unit = detail::find_unit(*child))
      unit->set_requires_gradient_sync(sync);
  }
}

bool is_sharded(const torch::nn::Module& module) {
  return detail::find_unit(module) != nullptr;
}

}  // namespace fsdp
