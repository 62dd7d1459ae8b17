#include "int8_reduce.h"

#include <torch/torch.h>

namespace fsdp::detail {

void Int8Reduce::prepare(const torch::Tensor& input) {
  const int64_t row = input.size(1);
  if (row == row_numel_)
    return;
  // The codec of a whole block: a row under 16 elements goes as bf16, or unencoded when the
  // input is bf16 already (GatherCodec's rules).
  row_numel_ = row;
  codec_ = GatherCodec::make(
      MixedPrecisionPolicy().gather_format(GatherFormat::kInt8).int8_block_size(block_),
      input.scalar_type(), input.scalar_type(), row);
}

torch::Tensor Int8Reduce::encode(const torch::Tensor& input, int64_t chunks) {
  torch::NoGradGuard no_grad;
  prepare(input);
  const int64_t n = input.size(0);
  auto values = input.narrow(1, 0, chunks);
  const bool feedback = error_feedback_ && codec_.has_value();  // unencoded: nothing lost
  if (feedback) {
    if (residual_.defined() && residual_.sizes() == values.sizes() &&
        residual_.dtype() == values.dtype())
      values.add_(residual_);
    else
      residual_ = torch::empty_like(values);
  }
  if (!codec_)
    return input.contiguous().view({-1}).view(torch::kByte).clone();
  const int64_t piece = codec_->wire_numel(1);
  auto wire = torch::empty({n * piece}, input.options().dtype(codec_->wire_dtype()));
  // One row at a time: its piece, and (error feedback) what its owner will decode, subtracted
  // from what was meant; a row's worth of decoded values is alive at once.
  torch::Tensor decoded =
      feedback ? torch::empty({1, row_numel_}, input.options()) : torch::Tensor();
  for (int64_t j = 0; j < n; ++j) {
    auto dst = wire.narrow(0, j * piece, piece);
    dst.copy_(codec_->encode(input.select(0, j).unsqueeze(0)));
    if (feedback) {
      codec_->decode(dst, decoded, 1);
      auto residual = residual_.select(0, j);
      torch::sub_out(residual, values.select(0, j), decoded.select(0, 0).narrow(0, 0, chunks));
    }
  }
  return wire.scalar_type() == torch::kByte ? wire : wire.view(torch::kByte);
}

void Int8Reduce::decode_mean(const torch::Tensor& received, const torch::Tensor& output) const {
  torch::NoGradGuard no_grad;
  const int64_t row = output.numel();
  TORCH_INTERNAL_ASSERT(row == row_numel_);
  const int64_t piece_bytes = codec_
                                  ? codec_->wire_numel(1) * c10::elementSize(codec_->wire_dtype())
                                  : row * output.element_size();
  const int64_t n = received.numel() / piece_bytes;
  auto pieces = torch::empty({n, row}, output.options());
  if (codec_)
    codec_->decode(received.view(codec_->wire_dtype()), pieces, n);
  else
    pieces.view({-1}).copy_(received.view(output.scalar_type()));
  // Summed in at least fp32, in rank order: the same on every run.
  const auto acc = output.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  output.copy_(pieces.to(acc).sum(0).div_(static_cast<double>(n)));
}

}  // namespace fsdp::detail
