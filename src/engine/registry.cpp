// See registry.h.
#include "registry.h"

#include <torch/nn/module.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include <fsdp/fully_shard.h>

#include "param_group.h"

namespace fsdp::detail {
namespace {

struct Entry {
  std::weak_ptr<torch::nn::Module> module;
  std::shared_ptr<ParamGroup> unit;
  uint64_t order;  // creation order, for the ordered listings
};

// Two hash tables, so that fsdp::forward (a unit by module, every call) and clip_grad_norm_ /
// param_shards (a unit by parameter, every parameter) are O(1) without copying anything: a
// model with thousands of parameter tensors pays nothing per tensor for the lookup. The units
// keep their parameters alive, so a TensorImpl address in `by_param` cannot be reused while
// its unit is registered.
std::mutex g_mutex;
std::unordered_map<const torch::nn::Module*, Entry> g_by_module;
std::unordered_map<const c10::TensorImpl*, std::shared_ptr<ParamGroup>> g_by_param;
uint64_t g_next_order = 0;

void erase_locked(std::unordered_map<const torch::nn::Module*, Entry>::iterator it) {
  for (const auto& p : it->second.unit->params())
    g_by_param.erase(p.param().unsafeGetTensorImpl());
  g_by_module.erase(it);
}

// Drops units whose module died (their parameters die with them). O(units): only where a
// listing is built anyway (units_under runs once per step in StepProfiler, so a model that
// died is released at the latest by the next step of another one). The dropped units are
// returned, for the caller to destroy after it unlocks: a unit's teardown may end a process
// group (NCCL's waits for its work), which must not happen under the registry's lock.
[[nodiscard]] std::vector<std::shared_ptr<ParamGroup>> prune_locked() {
  std::vector<std::shared_ptr<ParamGroup>> dead;
  for (auto it = g_by_module.begin(); it != g_by_module.end();) {
    auto next = std::next(it);
    if (it->second.module.expired()) {
      dead.push_back(it->second.unit);
      erase_locked(it);
    }
    it = next;
  }
  return dead;
}

}  // namespace

void register_unit(const std::shared_ptr<torch::nn::Module>& module,
                   std::shared_ptr<ParamGroup> unit) {
  std::vector<std::shared_ptr<ParamGroup>> dead;  // destroyed after the lock is released
  std::lock_guard<std::mutex> lock(g_mutex);
  dead = prune_locked();
  for (const auto& p : unit->params())
    g_by_param[p.param().unsafeGetTensorImpl()] = unit;
  g_by_module[module.get()] = Entry{module, std::move(unit), g_next_order++};
}

void release_dead_units() {
  std::vector<std::shared_ptr<ParamGroup>> dead;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    dead = prune_locked();
  }
}

std::vector<UnitEntry> live_entries() {
  std::vector<std::pair<uint64_t, UnitEntry>> ordered;
  std::vector<std::shared_ptr<ParamGroup>> dead;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    dead = prune_locked();
    ordered.reserve(g_by_module.size());
    for (const auto& [key, e] : g_by_module) {
      if (auto m = e.module.lock())
        ordered.push_back({e.order, {std::move(m), e.unit}});
    }
  }
  std::sort(ordered.begin(), ordered.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<UnitEntry> out;
  out.reserve(ordered.size());
  for (auto& [order, e] : ordered)
    out.push_back(std::move(e));
  return out;
}

std::vector<std::shared_ptr<ParamGroup>> live_units() {
  std::vector<std::shared_ptr<ParamGroup>> out;
  for (auto& e : live_entries())
    out.push_back(std::move(e.unit));
  return out;
}

std::vector<std::shared_ptr<RootState>> live_states() {
  std::vector<std::shared_ptr<RootState>> out;
  for (const auto& unit : live_units()) {
    if (std::find(out.begin(), out.end(), unit->state_ptr()) == out.end())
      out.push_back(unit->state_ptr());
  }
  return out;
}

std::shared_ptr<ParamGroup> find_unit(const torch::nn::Module& module) {
  std::shared_ptr<ParamGroup> dead;  // destroyed after the lock is released (prune_locked)
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_by_module.find(&module);
  if (it == g_by_module.end())
    return nullptr;
  if (it->second.module.expired()) {
    // A new module at a dead one's address: the old unit is not its unit.
    dead = it->second.unit;
    erase_locked(it);
    return nullptr;
  }
  return it->second.unit;
}

std::vector<std::shared_ptr<ParamGroup>> units_under(const torch::nn::Module& module) {
  std::vector<std::pair<uint64_t, std::shared_ptr<ParamGroup>>> found;
  std::vector<std::shared_ptr<ParamGroup>> dead;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    dead = prune_locked();
    std::unordered_set<const torch::nn::Module*> seen;  // a shared submodule appears twice
    auto add = [&](const torch::nn::Module* m) {
      if (!seen.insert(m).second)
        return;
      auto it = g_by_module.find(m);
      if (it != g_by_module.end() && !it->second.module.expired())
        found.push_back({it->second.order, it->second.unit});
    };
    add(&module);
    for (const auto& child : module.modules(/*include_self=*/false))
      add(child.get());
  }
  std::sort(found.begin(), found.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::shared_ptr<ParamGroup>> out;
  out.reserve(found.size());
  for (auto& [order, unit] : found)
    out.push_back(std::move(unit));
  return out;
}

std::shared_ptr<ParamGroup> unit_of_param(const c10::TensorImpl* param) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_by_param.find(param);
  return it == g_by_param.end() ? nullptr : it->second;
}

}  // namespace fsdp::detail
