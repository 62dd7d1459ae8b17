// Which modules are FSDP units. C++ modules cannot carry extra state, so units are found by
// module address, guarded by a weak reference so that a new module at a freed address is never
// mistaken for an old one. A lookup table shared by all models, never their runtime state
// (that lives in each model's RootState); guarded by a mutex. Hash tables by module and by
// parameter: find_unit (every fsdp::forward) and unit_of_param (every parameter of
// clip_grad_norm_ and param_shards) cost O(1) and copy nothing; the listings (live_entries,
// units_under) are in creation order.
#pragma once

#include <memory>
#include <vector>

namespace c10 {
struct TensorImpl;
}
namespace torch::nn {
class Module;
}

namespace fsdp::detail {

class ParamGroup;
class RootState;

struct UnitEntry {
  std::shared_ptr<torch::nn::Module> module;
  std::shared_ptr<ParamGroup> unit;
};

/// Makes `unit` the unit of `module`.
void register_unit(const std::shared_ptr<torch::nn::Module>& module,
                   std::shared_ptr<ParamGroup> unit);
/// Units whose modules are still alive, with their modules, in the order they were created.
std::vector<UnitEntry> live_entries();
/// Drops every unit whose module died (fsdp::release_dead_models).
void release_dead_units();
std::vector<std::shared_ptr<ParamGroup>> live_units();
/// The distinct RootStates of the live units.
std::vector<std::shared_ptr<RootState>> live_states();
/// The unit of `module` and of every module under it, in creation order.
std::vector<std::shared_ptr<ParamGroup>> units_under(const torch::nn::Module& module);
/// The unit that owns `param` (by TensorImpl), or nullptr.
std::shared_ptr<ParamGroup> unit_of_param(const c10::TensorImpl* param);

}  // namespace fsdp::detail
