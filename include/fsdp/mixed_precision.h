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
//
// What the all-gather sends can differ from what the unit computes in (gather_format, after
// DeepSpeed ZeRO++'s quantized weights): a CPU without fast bf16 matmuls computes in fp32 and
// still gathers bf16 or int8, because there the links, not the matmuls, are the bottleneck.
// Each rank encodes its shard, the gather moves the encoded bytes, and every rank decodes all
// of them (its own shard included) into the unsharded buffer in the compute dtype. The
// forward and backward therefore see the parameters rounded through the format, the same on
// every rank and on any number of ranks (a unit that is not gathered, world size 1 or
// kNoShard, rounds locally), while the master shards keep full precision. Gradients take
// reduce_dtype, which may differ from the compute dtype the same way (bf16 reduction of fp32
// gradients).
//
//   // fp32 compute, int8 all-gather, bf16 reduce-scatter:
//   fsdp::MixedPrecisionPolicy().gather_format(fsdp::GatherFormat::kInt8)
//                               .reduce_dtype(torch::kBFloat16);
#pragma once

#include <torch/arg.h>
#include <torch/types.h>

#include <array>
#include <optional>
#include <utility>

#include <fsdp/detail/enum_names.h>

namespace fsdp {

/// The wire format of a unit's all-gather (MixedPrecisionPolicy::gather_format).
enum class GatherFormat {
  /// The compute dtype (param_dtype, else the parameter's own): exact.
  kComputeDtype,
  /// bf16 / fp16 on the wire, cast to the compute dtype on arrival (round to nearest even).
  kBFloat16,
  kFloat16,
  /// int8 with one fp32 scale per block of int8_block_size elements of a row (scale = the
  /// block's largest magnitude / 127, values rounded to nearest even): about 8.1 bits per
  /// value with the default block. Blocks never span rows, so they do not depend on how the
  /// rows are split between ranks. Parameters whose rows have fewer than 16 elements (biases,
  /// norm weights) travel as bf16: a scale per few values would cost more than it saves.
  kInt8,
};
/// Named as a configuration spells them ("param_dtype": the compute dtype).
template <>
struct EnumNames<GatherFormat> {
  static constexpr const char* what = "gather format";
  static constexpr std::array<std::pair<GatherFormat, const char*>, 4> names{{
      {GatherFormat::kComputeDtype, "param_dtype"},
      {GatherFormat::kBFloat16, "bf16"},
      {GatherFormat::kFloat16, "fp16"},
      {GatherFormat::kInt8, "int8"},
  }};
};

/// The wire format of a unit's gradient reduce-scatter (MixedPrecisionPolicy::reduce_format).
enum class ReduceFormat {
  /// reduce_dtype: the backend sums in it.
  kReduceDtype,
  /// int8 with one fp32 scale per int8_block_size elements (after DeepSpeed ZeRO++'s qgZ):
  /// each rank encodes the piece of its gradient destined for each rank, an all-to-all moves
  /// about a quarter of fp32's bytes, and each rank decodes the N pieces of its shard and sums
  /// them in fp32, in rank order. With error_feedback, what the encoding lost on each rank is
  /// added to that rank's next gradient of the unit, so the error does not accumulate over
  /// steps. Only the reduce-scatter is quantized: a unit sharded over one rank (kNoShard, world
  /// size 1) and hybrid_shard's all-reduce across replicas reduce in reduce_dtype.
  kInt8,
};
template <>
struct EnumNames<ReduceFormat> {
  static constexpr const char* what = "reduce format";
  static constexpr std::array<std::pair<ReduceFormat, const char*>, 2> names{{
      {ReduceFormat::kReduceDtype, "reduce_dtype"},
      {ReduceFormat::kInt8, "int8"},
  }};
};

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
  /// What the all-gather sends (see GatherFormat); floating-point parameters only.
  TORCH_ARG(GatherFormat, gather_format) = GatherFormat::kComputeDtype;
  /// Elements per int8 scale block (GatherFormat::kInt8 and ReduceFormat::kInt8), at least 1.
  TORCH_ARG(int64_t, int8_block_size) = 256;
  /// What the gradient reduce-scatter sends (see ReduceFormat).
  TORCH_ARG(ReduceFormat, reduce_format) = ReduceFormat::kReduceDtype;
  /// ReduceFormat::kInt8: carry each rank's quantization error into its next reduction of the
  /// unit. Costs a residual of the unit's unsharded gradient size per rank, in reduce_dtype,
  /// kept between steps (not in checkpoints: a resumed run starts it at zero, as does a unit
  /// whose backward pass failed after it reduced).
  TORCH_ARG(bool, error_feedback) = true;
};

}  // namespace fsdp
