// See clip_grad.h: one all-reduce of a single double per norm, none under no_shard.
#include <fsdp/clip_grad.h>

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include <fsdp/distributed/collectives.h>
#include "param_group.h"
#include "registry.h"

namespace fsdp {
namespace {

// Grads grouped by how many ranks hold each element, dtype and device, so that each group's
// norms come from one _foreach_norm. An element held by R ranks (replicated: kNoShard,
// kHybridShard, or no unit at all) would be counted R times by the sum over ranks; its group's
// squared norm is weighed 1/R (exact for power-of-two R, within an ulp of double otherwise).
struct Group {
  int holders;
  c10::ScalarType dtype;
  torch::Device device;
  std::vector<torch::Tensor> grads;
};

struct Grouped {
  std::vector<Group> groups;
  // Whether every grad is whole and identical on every rank (all in units that shard over one
  // rank, i.e. replicate over the whole group, and whose reduction is an all-reduce): then
  // each rank's local norm is the global one, and the collective (a synchronisation point that
  // absorbs any skew between ranks, ~2 ms on a loaded 2-core machine) is skipped, as DDP's
  // users skip it.
  bool replicated_everywhere = true;
};

Grouped group_grads(const std::vector<torch::Tensor>& params, int group_size,
                    const TensorParallelParams& tp) {
  Grouped out;
  const auto split = [&](const torch::Tensor& p) {
    return std::any_of(tp.split.begin(), tp.split.end(), [&](const torch::Tensor& s) {
      return s.unsafeGetTensorImpl() == p.unsafeGetTensorImpl();
    });
  };
  TORCH_CHECK(tp.ways >= 1 && group_size % tp.ways == 0, "clip_grad_norm_: tensor parallelism of ",
              tp.ways, " ways in a group of ", group_size);
  for (const auto& p : params) {
    // Decided from every parameter, grad or not, so that every rank decides alike.
    auto unit = detail::unit_of_param(p.unsafeGetTensorImpl());
    const int ways = tp.ways > 1 && split(p) ? tp.ways : 1;
    out.replicated_everywhere =
        out.replicated_everywhere && unit && unit->shard_size() == 1 && ways == 1;
    const auto& g = p.grad();
    if (!g.defined() || g.numel() == 0)
      continue;
    const int holders = group_size / (unit ? unit->shard_size() : 1) / ways;
    auto& groups = out.groups;
    auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& x) {
      return x.holders == holders && x.dtype == g.scalar_type() && x.device == g.device();
    });
    if (it == groups.end())
      it = groups.insert(groups.end(), Group{holders, g.scalar_type(), g.device(), {}});
    it->grads.push_back(g);
  }
  return out;
}

// Adds the groups' squared norms to `weighted` (each weighed 1/holders) and `whole`. Each
// tensor's norm is reduced in its own dtype (at least fp32: ATen's CPU reductions sum in
// cascade, so a tensor's norm is good to a few ulps whatever its size), and the norms are
// squared and summed in double, across tensors and ranks. Converting every grad to double
// first, as this did before, cost ~50x as much (11 vs 0.2 ms for 1M elements, on a busy core)
// for digits the fp32 update cannot use.
void add_squares(const std::vector<Group>& groups, torch::Tensor& weighted, torch::Tensor& whole) {
  for (const auto& grp : groups) {
    std::optional<c10::ScalarType> acc;
    if (grp.dtype == torch::kBFloat16 || grp.dtype == torch::kHalf)
      acc = torch::kFloat;
    auto norms = torch::stack(at::_foreach_norm(grp.grads, 2, acc)).to(torch::kDouble);
    auto term = norms.square().sum();
    auto part = grp.holders > 1 ? term / grp.holders : term;
    whole = whole.defined() ? whole + term.to(whole.device()) : term.reshape({1});
    weighted = weighted.defined() ? weighted + part.to(weighted.device()) : part.reshape({1});
  }
}

// The global norm from this rank's squares: summed across `group` unless replicated.
double reduce_squares(torch::Tensor weighted, const torch::Tensor& whole, bool replicated,
                      ProcessGroup& group) {
  if (replicated)
    return whole.defined() ? std::sqrt(whole.item<double>()) : 0.0;
  // The collective runs where the backend needs its tensors (this rank's current CUDA device
  // for NCCL); a rank without any grad still takes part.
  const torch::Device comm_device(group.device_type());
  if (!weighted.defined())
    weighted = torch::zeros({1}, torch::TensorOptions().dtype(torch::kDouble).device(comm_device));
  else if (weighted.device().type() != comm_device.type())
    weighted = weighted.to(comm_device);
  all_reduce(group, weighted, ReduceOp::kSum, "clip_grad_norm_")->wait();
  return std::sqrt(weighted.item<double>());
}

}  // namespace

double clip_grad_norm_(const std::vector<torch::Tensor>& params, double max_norm,
                       ProcessGroup& group, const TensorParallelParams& tp) {
  torch::NoGradGuard no_grad;
  const Grouped grouped = group_grads(params, group.size(), tp);
  torch::Tensor weighted, whole;
  add_squares(grouped.groups, weighted, whole);
  const double norm = reduce_squares(weighted, whole, grouped.replicated_everywhere, group);
  // A non-finite norm is returned for the caller to act on (skip the step, stop); scaling by
  // NaN would only spread it.
  const double coef = max_norm / (norm + 1e-6);
  if (std::isfinite(norm) && coef < 1.0) {
    for (const auto& grp : grouped.groups)
      at::_foreach_mul_(grp.grads, coef);
  }
  return norm;
}

void GradNormSum::add(const std::vector<torch::Tensor>& params) {
  torch::NoGradGuard no_grad;
  const Grouped grouped = group_grads(params, group_->size(), tp_);
  replicated_everywhere_ = replicated_everywhere_ && grouped.replicated_everywhere;
  add_squares(grouped.groups, weighted_, whole_);
}

double GradNormSum::reduce() {
  const double norm = reduce_squares(weighted_, whole_, replicated_everywhere_, *group_);
  weighted_ = torch::Tensor();
  whole_ = torch::Tensor();
  replicated_everywhere_ = true;
  return norm;
}

}  // namespace fsdp
