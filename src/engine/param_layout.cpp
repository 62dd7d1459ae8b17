// See include/fsdp/detail/param_layout.h.
#include <fsdp/detail/param_layout.h>

#include <c10/util/Exception.h>

#include <algorithm>

namespace fsdp::detail {
namespace {

// Rows narrower than this travel as bf16 under kInt8: int8 plus a 4-byte scale only beats
// bf16's 2 bytes per value from 5 values per block on, and the bias and norm vectors these
// are weigh nothing next to the matrices.
constexpr int64_t kMinInt8Row = 16;

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

int64_t round_up(int64_t v, int64_t to) {
  return ceil_div(v, to) * to;
}

int64_t element_size(c10::ScalarType t) {
  return static_cast<int64_t>(c10::elementSize(t));
}

}  // namespace

int64_t WireFormat::numel(int64_t rows) const {
  if (!int8)
    return rows * row_numel;
  return round_up(rows * blocks_per_row * 4 + rows * row_numel, 4);
}

int64_t WireFormat::bytes(int64_t rows) const {
  return numel(rows) * element_size(dtype);
}

std::optional<WireFormat> gather_wire_format(const MixedPrecisionPolicy& mp, c10::ScalarType dtype,
                                             c10::ScalarType compute, int64_t row_numel) {
  if (!c10::isFloatingType(dtype))
    return std::nullopt;  // packed or integer parameters are gathered as they are
  WireFormat w;
  w.row_numel = row_numel;
  w.dtype = compute;
  switch (mp.gather_format()) {
    case GatherFormat::kComputeDtype:
      return std::nullopt;
    case GatherFormat::kBFloat16:
      w.dtype = c10::ScalarType::BFloat16;
      break;
    case GatherFormat::kFloat16:
      w.dtype = c10::ScalarType::Half;
      break;
    case GatherFormat::kInt8:
      TORCH_CHECK(mp.int8_block_size() >= 1,
                  "fsdp MixedPrecisionPolicy: int8_block_size must be at least 1, got ",
                  mp.int8_block_size());
      if (row_numel >= kMinInt8Row) {
        w.int8 = true;
        w.dtype = c10::ScalarType::Byte;
        w.block = mp.int8_block_size();
        w.blocks_per_row = ceil_div(row_numel, w.block);
        return w;
      }
      w.dtype = c10::ScalarType::BFloat16;
      break;
  }
  if (w.dtype == compute)
    return std::nullopt;
  return w;
}

int64_t ParamLayout::numel() const {
  int64_t n = 1;
  for (auto d : shape)
    n *= d;
  return n;
}

int64_t ParamLayout::shard_bytes() const {
  return shard_numel() * element_size(dtype);
}

int64_t ParamLayout::unsharded_bytes() const {
  return owns_unsharded ? padded_numel() * element_size(unsharded_dtype) : 0;
}

int64_t ParamLayout::block_shard_bytes(int blocks) const {
  return block_rows(blocks) * row_numel * element_size(unsharded_dtype);
}

int64_t ParamLayout::grad_shard_bytes() const {
  return local_numel() * element_size(dtype);
}

int64_t ParamLayout::kept_grad_bytes() const {
  return numel() * element_size(dtype);
}

int64_t ParamLayout::gather_input_bytes() const {
  if (wire)
    return wire->bytes(chunk_rows);
  if (unsharded_dtype != dtype)
    return shard_numel() * element_size(unsharded_dtype);
  if (offload)
    return shard_numel() * element_size(dtype);
  return 0;
}

int64_t ParamLayout::gather_output_bytes() const {
  return wire ? world_size * wire->bytes(chunk_rows) : 0;
}

int64_t ParamLayout::gather_wire_bytes() const {
  return wire ? gather_output_bytes() : padded_numel() * element_size(unsharded_dtype);
}

int64_t ReduceLayout::input_bytes() const {
  return world_size * row * element_size(dtype);
}

int64_t ReduceLayout::output_bytes() const {
  return world_size > 1 ? row * element_size(dtype) : 0;
}

int64_t ReduceLayout::piece_bytes() const {
  return wire ? wire->bytes(1) : row * element_size(dtype);
}

int64_t ReduceLayout::residual_bytes(bool error_feedback) const {
  return int8 && error_feedback && wire ? world_size * chunks * element_size(dtype) : 0;
}

c10::ScalarType reduce_dtype_of(const MixedPrecisionPolicy& mp, c10::ScalarType master) {
  if (mp.reduce_dtype())
    return *mp.reduce_dtype();
  return mp.param_dtype() ? *mp.param_dtype() : master;
}

ReduceLayout reduce_layout(int64_t chunks, int64_t params, int world_size,
                           c10::ScalarType reduce_dtype, const MixedPrecisionPolicy& mp) {
  ReduceLayout l;
  l.world_size = world_size;
  l.chunks = chunks;
  l.dtype = reduce_dtype;
  l.int8 = world_size > 1 && mp.reduce_format() == ReduceFormat::kInt8;
  TORCH_CHECK(!l.int8 || mp.int8_block_size() >= 1,
              "fsdp MixedPrecisionPolicy: int8_block_size must be at least 1, got ",
              mp.int8_block_size());
  // int8: the flags get scale blocks of their own, so that they never coarsen a gradient's.
  l.flags_at = l.int8 ? round_up(chunks, mp.int8_block_size()) : chunks;
  l.row = l.flags_at + params;
  if (l.int8) {
    l.wire = gather_wire_format(MixedPrecisionPolicy()
                                    .gather_format(GatherFormat::kInt8)
                                    .int8_block_size(mp.int8_block_size()),
                                reduce_dtype, reduce_dtype, l.row);
  }
  return l;
}

ParamLayout param_layout(const std::vector<int64_t>& shape, c10::ScalarType dtype, int rank,
                         int world_size, const MixedPrecisionPolicy& mp, bool offload) {
  TORCH_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "fsdp: rank ", rank,
              " of a shard group of ", world_size);
  ParamLayout l;
  l.shape = shape;
  l.world_size = world_size;
  l.offload = offload;
  l.dtype = dtype;
  // A 0-d parameter is sharded as a single row; an empty one keeps rows of one element so that
  // the padded pieces stay well formed.
  l.rows = shape.empty() ? 1 : shape[0];
  const int64_t numel = l.numel();
  l.row_numel = l.rows == 0 ? (shape.empty() ? 0 : 1) : numel / l.rows;
  l.chunk_rows = ceil_div(l.rows, world_size);
  l.local_rows = std::clamp<int64_t>(l.rows - rank * l.chunk_rows, 0, l.chunk_rows);
  l.unsharded_dtype = mp.param_dtype() && c10::isFloatingType(dtype) ? *mp.param_dtype() : dtype;
  l.wire = gather_wire_format(mp, dtype, l.unsharded_dtype, l.row_numel);
  l.owns_unsharded = world_size > 1 || l.unsharded_dtype != dtype || l.wire || offload;
  return l;
}

}  // namespace fsdp::detail
