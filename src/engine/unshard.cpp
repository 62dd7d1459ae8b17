// See unshard.h.
#include <fsdp/unshard.h>

#include <torch/torch.h>

#include "param_group.h"
#include "registry.h"
#include "root_state.h"

namespace fsdp {

void unshard(torch::nn::Module& module) {
  auto units = detail::units_under(module);
  TORCH_CHECK(!units.empty(), "fsdp::unshard: module '", module.name(),
              "' is not and holds no FSDP unit");
  for (const auto& unit : units) {
    TORCH_CHECK(!unit->in_forward() && unit->state().pass_id() == 0, "fsdp::unshard: unit '",
                unit->name(), "' is in a forward or backward pass; call it between steps");
  }
  // Issue every gather, then wait: they overlap on the backend's lanes.
  for (const auto& unit : units) {
    unit->set_user_held(true);
    unit->issue_unshard(/*counted=*/false);
  }
  for (const auto& unit : units)
    unit->wait_unshard();
}

void reshard(torch::nn::Module& module) {
  for (const auto& unit : detail::units_under(module)) {
    unit->set_user_held(false);
    unit->release();
  }
}

UnshardGuard::UnshardGuard(torch::nn::Module& module) : module_(module) {
  unshard(module_);
}

UnshardGuard::~UnshardGuard() {
  try {
    reshard(module_);
  } catch (const std::exception& e) {
    TORCH_WARN("fsdp::UnshardGuard: resharding '", module_.name(), "' failed: ", e.what());
  }
}

}  // namespace fsdp
