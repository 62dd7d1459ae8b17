// The planner's view of a model (issue 26, fsdp::plan): which parameters each FSDP unit will
// hold, with their shapes, dtypes and whether they train; read from the module alone, before
// any sharding, so it works on a model built on the meta device and on any model a user shards.
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <string>
#include <vector>

namespace fsdp::plan {

struct ParamInfo {
  std::string name;  // as in model.named_parameters()
  std::vector<int64_t> shape;
  torch::ScalarType dtype = torch::kFloat32;
  bool trainable = true;  // requires_grad
};

struct UnitInfo {
  std::string path;  // the module's path in the model ("" for the model itself)
  std::vector<ParamInfo> params;
};

/// The units fully_shard would make when applied (bottom-up) to the modules at `unit_paths`
/// (paths relative to `model`, "h0" or "layers.3"; "" is the model itself, the root): each
/// parameter belongs to the innermost listed module that holds it. In the order of
/// `unit_paths`. Throws, naming it, for a path that is not a module of `model` and for a
/// parameter in no listed module (fully_shard would leave it unsharded: list "" to make the
/// root a unit).
std::vector<UnitInfo> describe_units(torch::nn::Module& model,
                                     const std::vector<std::string>& unit_paths);

}  // namespace fsdp::plan
