// How the engine lays one parameter out on one rank, what it puts on the wire to gather it, and
// how a unit's gradients are laid out to be reduced: the one description of those buffers. The
// engine allocates from it (ShardedParam, GatherCodec) and the planner predicts from it
// (fsdp::plan's step memory and step time), so that a change to what the engine allocates changes
// the planner's answer with no edit there.
//
// A parameter is sharded on dim 0 (a 0-d one as a single row): `chunk_rows` rows per rank, the
// last ranks' chunks padded with zero rows (or all padding), so that every rank's piece has the
// same size and the gather is one flat all-gather of world * chunk_rows rows.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <vector>

#include <fsdp/mixed_precision.h>

namespace fsdp::detail {

/// What one rank's piece of a parameter becomes on the wire of the all-gather
/// (MixedPrecisionPolicy::gather_format). Cast formats send the rows in `dtype`; int8 sends
/// [rows * blocks_per_row fp32 scales][rows * row_numel int8 values][padding to 4 bytes], as
/// kByte (gather_codec.h).
struct WireFormat {
  bool int8 = false;
  c10::ScalarType dtype = c10::ScalarType::Float;  // kByte for int8
  int64_t row_numel = 0;
  int64_t block = 0;           // int8: elements per scale
  int64_t blocks_per_row = 0;  // int8: ceil(row_numel / block)

  /// Elements (of `dtype`) of an encoded piece of `rows` rows.
  int64_t numel(int64_t rows) const;
  int64_t bytes(int64_t rows) const;
};

/// The gather's wire format for a parameter stored in `dtype`, computed in `compute`, with rows
/// of `row_numel` elements; nullopt when the gather moves `compute` unchanged. Integer and
/// packed parameters travel as they are; under kInt8, rows narrower than 16 elements travel as
/// bf16 (a scale per block would cost more than it saves on the bias and norm vectors).
std::optional<WireFormat> gather_wire_format(const MixedPrecisionPolicy& mp, c10::ScalarType dtype,
                                             c10::ScalarType compute, int64_t row_numel);

/// One parameter on one rank of its shard group, and the sizes of what the engine allocates
/// for it (ShardedParam).
struct ParamLayout {
  std::vector<int64_t> shape;  // the unsharded shape
  int64_t rows = 0;            // dim 0 (1 for a 0-d parameter)
  int64_t row_numel = 0;
  int64_t chunk_rows = 0;  // rows of every rank's padded shard
  int64_t local_rows = 0;  // of which real rows on this rank
  int world_size = 1;
  bool offload = false;
  c10::ScalarType dtype = c10::ScalarType::Float;            // as stored (the shard's)
  c10::ScalarType unsharded_dtype = c10::ScalarType::Float;  // as computed (param_dtype)
  std::optional<WireFormat> wire;
  /// A gathered copy of its own (else the shard is the parameter: one rank, its own dtype, no
  /// wire format, not offloaded).
  bool owns_unsharded = false;

  int64_t numel() const;
  int64_t shard_numel() const { return chunk_rows * row_numel; }
  int64_t local_numel() const { return local_rows * row_numel; }
  /// The padded shard, in the parameter's own dtype (on the host when offloaded).
  int64_t shard_bytes() const;
  int64_t padded_numel() const { return chunk_rows * world_size * row_numel; }
  /// The gathered parameter (alloc_unsharded): 0 unless it owns one.
  int64_t unsharded_bytes() const;
  /// What a gather sends, alive from issue to wait (gather_input): the encoded or cast piece,
  /// or the staged host copy under offload; 0 when the shard itself is sent.
  int64_t gather_input_bytes() const;
  /// What a gather receives into besides the parameter (gather_output): the wire buffer of a
  /// format, decoded into the parameter at the wait; 0 without one.
  int64_t gather_output_bytes() const;
  /// What the backend sees arrive: the wire buffer, or the gathered parameter itself.
  int64_t gather_wire_bytes() const;
  /// reshard_after_forward_size: one of `blocks` equal row blocks of the gathered parameter,
  /// kept from forward to backward (keep_block_shard); `blocks` divides world_size.
  int64_t block_rows(int blocks) const { return chunk_rows * world_size / blocks; }
  int64_t block_shard_bytes(int blocks) const;
  /// The sharded grad (this rank's real rows, in the parameter's dtype): what add_to_stash makes
  /// when the reduced output cannot back it (another dtype, or offloaded to the host).
  int64_t grad_shard_bytes() const;
  /// The unsharded grad that no-sync passes accumulate locally, in the parameter's dtype.
  int64_t kept_grad_bytes() const;
};

/// A unit's gradient reduction on one rank (ParamGroup::reduce_gradients): the trainable
/// parameters' padded shards side by side, `chunks` elements, then one 0/1 flag per parameter
/// (has it a gradient), as a row per rank of the shard group; the reduce-scatter input is the
/// N rows, its output this rank's row, in the reduce dtype. Under ReduceFormat::kInt8 (N > 1)
/// the flags start at a scale-block boundary (zeros before them) and each rank's row is encoded
/// alone, in the gather's int8 rules (int8 from 16 values on, else bf16, else as it is).
struct ReduceLayout {
  int world_size = 1;
  int64_t chunks = 0;    // gradient elements of a row
  int64_t flags_at = 0;  // where the flags start
  int64_t row = 0;       // elements of a row: flags_at + one flag per parameter
  c10::ScalarType dtype = c10::ScalarType::Float;  // the reduce dtype
  bool int8 = false;
  std::optional<WireFormat> wire;  // int8: a row's encoding (nullopt: sent as it is)

  /// The reduce-scatter input, N rows (under int8: the rows before encoding).
  int64_t input_bytes() const;
  /// This rank's row of the result; 0 with one rank (the input is the output).
  int64_t output_bytes() const;
  /// int8: what one row becomes on the wire, and the N of them sent (as many received).
  int64_t piece_bytes() const;
  int64_t wire_bytes() const { return world_size * piece_bytes(); }
  /// int8 with error feedback: what the encoding lost of each row sent, kept between steps
  /// (nothing is lost when a row is sent as it is).
  int64_t residual_bytes(bool error_feedback) const;
};

/// The dtype gradients are reduced in: the policy's reduce_dtype, else its param_dtype, else
/// the parameters' own (`master`).
c10::ScalarType reduce_dtype_of(const MixedPrecisionPolicy& mp, c10::ScalarType master);

/// The reduction of `params` trainable parameters whose padded shards add up to `chunks`
/// elements, over a shard group of `world_size`, in `reduce_dtype`, under `mp`'s reduce format.
ReduceLayout reduce_layout(int64_t chunks, int64_t params, int world_size,
                           c10::ScalarType reduce_dtype, const MixedPrecisionPolicy& mp);

/// The layout of a parameter of `shape` and `dtype` on `rank` of a shard group of `world_size`
/// ranks, under `mp` (the root without a policy: a default one), offloaded or not.
ParamLayout param_layout(const std::vector<int64_t>& shape, c10::ScalarType dtype, int rank,
                         int world_size, const MixedPrecisionPolicy& mp, bool offload);

}  // namespace fsdp::detail
