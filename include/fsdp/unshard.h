// Gathering a model once for many forwards: generation, evaluation.
//
// Every fsdp::forward gathers its unit and frees it again. Sampling a hundred tokens from a model
// is then a hundred all-gathers per unit; fsdp::unshard(model) gathers every unit of the model
// once and keeps it gathered through any number of forwards, until fsdp::reshard(model):
//
//   {
//     torch::NoGradGuard no_grad;
//     fsdp::UnshardGuard gathered(*model);   // one all-gather per unit
//     for (...) logits = fsdp::forward(model, ids);   // no collective
//   }                                        // sharded again
//
// The price is memory: every rank holds the unsharded parameters of every unit under the
// module. Every rank must call it (it all-gathers). While gathered, a forward whose outputs
// need gradients through a unit with trainable parameters is refused (the optimizer steps the
// shards, which the gathered copy would not see): reshard first.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

namespace fsdp {

/// Gathers every unit of `module` and of the modules under it, and keeps them gathered.
void unshard(torch::nn::Module& module);
/// Frees what unshard() gathered (units still needed by a pending backward stay gathered
/// until it ends).
void reshard(torch::nn::Module& module);

template <typename M>
void unshard(const torch::nn::ModuleHolder<M>& module) {
  unshard(*module.ptr());
}
template <typename M>
void reshard(const torch::nn::ModuleHolder<M>& module) {
  reshard(*module.ptr());
}

/// unshard() for a scope.
class UnshardGuard {
 public:
  explicit UnshardGuard(torch::nn::Module& module);
  template <typename M>
  explicit UnshardGuard(const torch::nn::ModuleHolder<M>& module) : UnshardGuard(*module.ptr()) {}
  UnshardGuard(const UnshardGuard&) = delete;
  UnshardGuard& operator=(const UnshardGuard&) = delete;
  ~UnshardGuard();

 private:
  torch::nn::Module& module_;
};

}  // namespace fsdp
