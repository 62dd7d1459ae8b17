// Mixed precision per unit (FSDP2's MixedPrecisionPolicy): which dtype a unit gathers and
// computes in, which dtype its gradients are reduced in, and what its forward returns.
//
// The sharded parameters stay in their own dtype (fp32, say): they are the master copy that
// model->parameters() yields and the optimizer updates. With param_dtype set, each rank casts
// its shard to param_dtype before the all-gather, so the gather moves and the unsharded
// buffers hold param_dtype bytes (half of fp32 for bf16/fp16), and the forward and backward
// compute in it. Gradients come out of backward in param_dtype, are reduce-scattered (and
// all-reduced, for kNoShard/kHybridShard) in reduce_dtype, and are added to the shard grads
// in the master dtype. Gradients accumulated without communication (no_sync) are kept in the
// master dtype. Only floating-point parameters are cast: integer ones (packed weights) are
// gathered as they are.
//
//   fsdp::FullyShardOptions opts(pg);
//   opts.mp_policy(fsdp::MixedPrecisionPolicy().param_dtype(torch::kBFloat16)
//                                              .reduce_dtype(torch::kFloat32));
//
// Units may differ: e.g. the root in fp32 (embeddings and head) over bf16 blocks.
#pragma once

#include <torch/arg.h>
#include <torch/types.h>

#include <optional>

namespace fsdp {

struct MixedPrecisionPolicy {
  /// Gather and compute dtype of the unit's floating-point parameters; unset: their own.
  TORCH_ARG(std::optional<torch::ScalarType>, param_dtype) = std::nullopt;
  /// Dtype of the gradient reduce-scatter and all-reduce; unset: param_dtype if set, else
  /// the parameters' own.
  TORCH_ARG(std::optional<torch::ScalarType>, reduce_dtype) = std::nullopt;
  /// The floating-point tensors the unit's forward returns are cast to this; unset: as
  /// computed.
  TORCH_ARG(std::optional<torch::ScalarType>, output_dtype) = std::nullopt;
  /// Cast the floating-point tensors of the forward's arguments to param_dtype (when set)
  /// before the forward, so a bf16 unit receives bf16 activations from an fp32 one.
  TORCH_ARG(bool, cast_forward_inputs) = true;
};

}  // namespace fsdp
