// Which modules are FSDP units. C++ modules cannot carry extra state, so units are found by
// module address, guarded by a weak reference so that a new module at a freed address is
// never mistaken for an old one.
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

/// Units whose modules are still alive, in the order they were created.
std::vector<std::shared_ptr<ParamGroup>> live_units();
/// Stable id of a unit (for autograd nodes, which can only save plain values).
int64_t unit_id(const ParamGroup& unit);
std::shared_ptr<ParamGroup> unit_by_id(int64_t id);
/// The unit that owns `param` (by TensorImpl), or nullptr.
std::shared_ptr<ParamGroup> unit_of_param(const c10::TensorImpl* param);

}  // namespace fsdp::detail
