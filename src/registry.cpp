// See registry.h.
#include "registry.h"

#include <torch/nn/module.h>

#include <algorithm>
#include <mutex>
#include <unordered_set>

#include <fsdp/fully_shard.h>

#include "param_group.h"

namespace fsdp::detail {
namespace {

struct Entry {
  const torch::nn::Module* key;
  std::weak_ptr<torch::nn::Module> module;
  std::shared_ptr<ParamGroup> unit;
};

std::mutex g_mutex;
std::vector<Entry> g_entries;

// Drops units whose module died (their parameters die with them).
void prune_locked() {
  std::erase_if(g_entries, [](const Entry& e) { return e.module.expired(); });
}

}  // namespace

void register_unit(const std::shared_ptr<torch::nn::Module>& module,
                   std::shared_ptr<ParamGroup> unit) {
  std::lock_guard<std::mutex> lock(g_mutex);
  prune_locked();
  g_entries.push_back({module.get(), module, std::move(unit)});
}

std::vector<UnitEntry> live_entries() {
  std::lock_guard<std::mutex> lock(g_mutex);
  prune_locked();
  std::vector<UnitEntry> out;
  for (const auto& e : g_entries) {
    if (auto m = e.module.lock())
      out.push_back({std::move(m), e.unit});
  }
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
  std::lock_guard<std::mutex> lock(g_mutex);
  for (const auto& e : g_entries) {
    if (e.key == &module && !e.module.expired())
      return e.unit;
  }
  return nullptr;
}

std::vector<std::shared_ptr<ParamGroup>> units_under(const torch::nn::Module& module) {
  std::unordered_set<const torch::nn::Module*> subtree{&module};
  for (const auto& child : module.modules(/*include_self=*/false))
    subtree.insert(child.get());
  std::vector<std::shared_ptr<ParamGroup>> out;
  for (auto& e : live_entries()) {
    if (subtree.count(e.module.get()))
      out.push_back(std::move(e.unit));
  }
  return out;
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

}  // namespace fsdp::detail
