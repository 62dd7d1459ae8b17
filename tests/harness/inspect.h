// Which units hold gathered (unsharded) storage: the tests' check that a model is sharded.
#pragma once

#include <torch/nn/module.h>

#include "engine/param_group.h"
#include "engine/registry.h"

namespace fsdp::test {

/// Some parameter of `unit` has unsharded storage allocated.
inline bool holds_unsharded(const fsdp::detail::ParamGroup& unit) {
  for (const auto& p : unit.params()) {
    if (p.unsharded_allocated())
      return true;
  }
  return false;
}

/// How many units of the process (every model) hold unsharded storage now.
inline int units_holding_unsharded_storage() {
  int count = 0;
  for (const auto& unit : fsdp::detail::live_units())
    count += holds_unsharded(*unit) ? 1 : 0;
  return count;
}

/// No unit under `model` holds unsharded storage.
inline bool model_is_sharded(const torch::nn::Module& model) {
  for (const auto& unit : fsdp::detail::units_under(model)) {
    if (holds_unsharded(*unit))
      return false;
  }
  return true;
}

}  // namespace fsdp::test
