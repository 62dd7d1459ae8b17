// ReduceFormat::kInt8 for one unit (see fsdp/mixed_precision.h): each rank's block of the
// reduce-scatter input is encoded as int8 with per-block scales, exchanged with
// reduce_scatter_exchange, and decoded and summed by its owner in fp32.
//
// A rank's block is laid out [param chunks | zeros up to a multiple of the scale block | P
// flags] (fsdp/detail/param_layout.h, ReduceLayout), so that the 0/1 flags get scale blocks of
// their own and never coarsen a gradient's scale. Error feedback keeps, per rank, what the encoding
// lost of each block it sent (the unit's unsharded gradient size, in the reduce dtype); the next
// reduction adds it before encoding. The residual is updated in place as each block is encoded:
// keeping the previous one until the pass commits would hold two of them per unit at the end of
// every backward. A failed pass therefore drops the residual (abort()), as a resume from a
// checkpoint does: what is lost is at most half a quantization step per element of one reduction.
#pragma once

#include <torch/types.h>

#include <optional>

#include <fsdp/mixed_precision.h>

#include "gather_codec.h"

namespace fsdp::detail {

class Int8Reduce {
 public:
  Int8Reduce(int64_t block, bool error_feedback) : block_(block), error_feedback_(error_feedback) {}

  /// Encodes `input` ([n, row]; the padding columns must be zero) into the wire, [n x piece]
  /// bytes with piece j for rank j. With error feedback, the residual is added to the first
  /// `chunks` columns of `input` (in place) first, and replaced by what this encoding loses.
  torch::Tensor encode(const torch::Tensor& input, int64_t chunks);
  /// Decodes what `received` holds ([n x piece] bytes, piece i from rank i) and writes the
  /// mean over ranks, summed in rank order, into `output` (row elements).
  void decode_mean(const torch::Tensor& received, const torch::Tensor& output) const;

  /// A backward pass failed after this unit encoded: its residual no longer matches what
  /// landed, and is dropped.
  void abort() { residual_ = torch::Tensor(); }

 private:
  void prepare(const torch::Tensor& input);

  int64_t block_;
  bool error_feedback_;
  int64_t row_numel_ = -1;            // the codec's row: a rank's block
  std::optional<GatherCodec> codec_;  // nullopt: the block travels as it is (bf16, tiny)
  torch::Tensor residual_;            // [n, chunks] in the input's dtype
};

}  // namespace fsdp::detail
