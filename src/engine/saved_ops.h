// Selective activation checkpointing's op cache: while a checkpointed region runs its forward,
// the outputs of the expensive ops (matrix products, flash attention) are kept; when backward
// runs the region again, those ops return the kept outputs instead of computing them, and every
// other op computes as usual.
//
// Why the dispatcher: a C++ region calls ATen ops directly (torch::nn::Linear, at::matmul,
// at::scaled_dot_product_attention), so the only place to see "the i-th matrix product of the
// region" without changing the model is the dispatcher. PyTorch does this in Python, through
// TorchDispatchMode, which a process without Python does not have. Instead the cache registers
// boxed kernels for the chosen ops under CustomRNGKeyId, a dispatch key below autograd that
// nothing in LibTorch uses outside its own tests, with a fallthrough for every other op (a
// kernel that passes the call below the key where a composite kernel would otherwise run), and
// puts that key in the thread's included set only while a selective region runs. Below autograd
// matters: during the recomputation autograd still records each product's backward node (saving its
// inputs), and only the numeric kernel underneath is replaced by the cached result, so the
// gradients are computed by exactly the formulas of an unchecked run.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <optional>
#include <string>
#include <vector>

namespace fsdp::detail {

class SavedOps {
 public:
  /// Record (first run) or replay (recomputation) into `ops` on this thread while the scope
  /// lives; nullptr: no caching here (a fully checkpointed region, possibly nested in a
  /// selective one). Only a scope with `ops` puts the key in the included set, so fully
  /// checkpointed regions dispatch as usual.
  class Scope {
   public:
    Scope(SavedOps* ops, bool record);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    SavedOps* previous_;
    std::optional<c10::impl::IncludeDispatchKeyGuard> include_;
  };

  // Used by the kernel.
  struct Entry {
    std::string op;
    std::vector<c10::IValue> outputs;  // copies of the op's outputs
  };
  bool recording = true;
  std::vector<Entry> entries;
  size_t next = 0;
};

}  // namespace fsdp::detail
