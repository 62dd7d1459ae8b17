// See clip_grad.h: one all-reduce of a single double per call.
#include <fsdp/clip_grad.h>

#include <torch/torch.h>

#include <cmath>

#include "collectives.h"
#include "param_group.h"
#include "registry.h"

namespace fsdp {

double clip_grad_norm_(const std::vector<torch::Tensor>& params, double max_norm,
                       ProcessGroup& group) {
  torch::NoGradGuard no_grad;
  // Accumulate in double, on the grads' device (a CUDA norm added to a CPU accumulator would
  // fail): the sum over a large model of fp32 squares loses digits otherwise.
  torch::Tensor sq;
  std::vector<torch::Tensor> grads;
  for (const auto& p : params) {
    const auto& g = p.grad();
    if (!g.defined() || g.numel() == 0)
      continue;
    grads.push_back(g);
    // An element held by R ranks (replicated: kNoShard, kHybridShard, or no unit at all)
    // would be counted R times by the sum over ranks; weigh it 1/R. The weights are exact
    // for power-of-two R and within an ulp of double otherwise.
    auto unit = detail::unit_of_param(p.unsafeGetTensorImpl());
    const int holders = group.size() / (unit ? unit->shard_size() : 1);
    auto term = g.to(torch::kDouble).square().sum();
    if (holders > 1)
      term = term / holders;
    if (!sq.defined())
      sq = torch::zeros({1}, term.options());
    sq += term.to(sq.device());
  }
  // The collective runs where the backend needs its tensors (this rank's current CUDA device
  // for NCCL); a rank without any grad still takes part.
  const torch::Device comm_device(group.device_type());
  if (!sq.defined())
    sq = torch::zeros({1}, torch::TensorOptions().dtype(torch::kDouble).device(comm_device));
  else if (sq.device().type() != comm_device.type())
    sq = sq.to(comm_device);
  detail::all_reduce(group, sq, detail::ReduceOp::kSum, "clip_grad_norm_")->wait();
  const double norm = std::sqrt(sq.item<double>());
  // A non-finite norm is returned for the caller to act on (skip the step, stop); scaling by
  // NaN would only spread it.
  const double coef = max_norm / (norm + 1e-6);
  if (std::isfinite(norm) && coef < 1.0) {
    for (auto& g : grads)
      g.mul_(coef);
  }
  return norm;
}

}  // namespace fsdp
