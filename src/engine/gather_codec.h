// The wire formats of the all-gather (MixedPrecisionPolicy::gather_format): how a rank's
// padded shard is encoded before the gather, and how the gathered pieces become the unsharded
// parameter in its compute dtype.
//
// A piece is one rank's padded shard: `rows` rows of row_numel elements. Encoded, it is
//   cast formats (bf16, fp16): the rows in that dtype;
//   int8: [rows * blocks_per_row fp32 scales][rows * row_numel int8 values][0-3 bytes of
//         padding, so that the next rank's scales stay 4-byte aligned], as uint8.
// Blocks are cut within rows, so a row is encoded the same whichever rank holds it: the
// decoded parameter does not depend on the number of ranks.
#pragma once

#include <torch/types.h>

#include <optional>
#include <vector>

#include <fsdp/detail/param_layout.h>
#include <fsdp/mixed_precision.h>

namespace fsdp::detail {

class GatherCodec {
 public:
  /// The codec of a parameter whose rows have `row_numel` elements, stored in `dtype` and
  /// computed in `compute`; nullopt when the gather moves the compute dtype unchanged. Which
  /// format, and its sizes, are the parameter's layout's (fsdp/detail/param_layout.h).
  static std::optional<GatherCodec> make(const MixedPrecisionPolicy& mp, torch::ScalarType dtype,
                                         torch::ScalarType compute, int64_t row_numel);

  /// Dtype and element count of an encoded piece of `rows` rows.
  torch::ScalarType wire_dtype() const { return format_.dtype; }
  int64_t wire_numel(int64_t rows) const;
  bool is_int8() const { return format_.int8; }

  /// Encodes `shard` (contiguous, `rows` x row_numel elements, any floating dtype) into a new
  /// 1-d tensor of wire_numel(rows) elements, on the shard's device.
  /// `portable`: int8 with ATen ops only, the path tensors off the CPU take (the CPU path is a
  /// hand-written loop over host memory); both give the same bytes.
  torch::Tensor encode(const torch::Tensor& shard, bool portable = false) const;
  /// Decodes `pieces` consecutive encoded pieces of `wire` (1-d, pieces * wire_numel(rows))
  /// into `dst` (contiguous, pieces * rows x row_numel elements, the compute dtype).
  void decode(const torch::Tensor& wire, const torch::Tensor& dst, int64_t pieces,
              bool portable = false) const;

 private:
  explicit GatherCodec(const WireFormat& format);
  /// Views [n, k, len] of the blocks of `m` ([n, row_numel], any dtype): the k full blocks of
  /// each row, then its shorter last block, if any.
  std::vector<torch::Tensor> row_blocks(const torch::Tensor& m) const;
  torch::Tensor encode_portable(const torch::Tensor& src, int64_t rows) const;
  void decode_portable(const torch::Tensor& wire, const torch::Tensor& dst, int64_t pieces,
                       int64_t rows) const;

  WireFormat format_;  // which format, and its sizes (fsdp/detail/param_layout.h)
};

}  // namespace fsdp::detail
