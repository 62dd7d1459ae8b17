#include "int8_reduce.h"

#include <torch/torch.h>

namespace fsdp::detail {

int64_t Int8Reduce::flags_offset(int64_t chunks) const {
  return (chunks + block_ - 1) / block_ * block_;
}

int64_t Int8Reduce::block_numel(int64_t chunks, int64_t flags) const {
  return flags_offset(chunks) + flags;
}

void Int8Reduce::prepare(const torch::Tensor& input) {
  const int64_t row = input.size(1);
  if (row == row_numel_)
    return;
  // The codec of a whole block: a row under 16 elements (a unit of a few scalars) goes as
  // bf16, or unencoded when the input is bf16 already (GatherCodec's rules).
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
  if (error_feedback_) {
    const auto& base = staged_.defined() ? staged_ : residual_;
    if (base.defined() && base.sizes() == values.sizes() && base.dtype() == values.dtype())
      values.add_(base);
  }
  torch::Tensor wire;
  if (!codec_) {
    wire = input.contiguous().view({-1}).view(torch::kByte).clone();
  } else {
    const int64_t piece = codec_->wire_numel(1);
    wire = torch::empty({n * piece}, input.options().dtype(codec_->wire_dtype()));
    for (int64_t j = 0; j < n; ++j)
      wire.narrow(0, j * piece, piece).copy_(codec_->encode(input.select(0, j).unsqueeze(0)));
    if (wire.scalar_type() != torch::kByte)
      wire = wire.view(torch::kByte);
  }
  if (error_feedback_) {
    // What the pieces decode to on their owners, subtracted from what was meant.
    auto decoded = torch::empty_like(input);
    if (codec_) {
      codec_->decode(wire.view(codec_->wire_dtype()), decoded, n);
      staged_ = values - decoded.narrow(1, 0, chunks);
    } else {
      staged_ = torch::zeros_like(values);  // sent exactly
    }
  }
  return wire;
}

void Int8Reduce::decode_mean(const torch::Tensor& received, const torch::Tensor& output) const {
  torch::NoGradGuard no_grad;
  const int64_t row = output.numel();
  TORCH_INTERNAL_ASSERT(row == row_numel_);
  const int64_t n =
      received.numel() / (codec_ ? codec_->wire_numel(1) * c10::elementSize(codec_->wire_dtype())
                                 : row * output.element_size());
  auto pieces = torch::empty({n, row}, output.options());
  if (codec_)
    codec_->decode(received.view(codec_->wire_dtype()), pieces, n);
  else
    pieces.view({-1}).copy_(received.view(output.scalar_type()));
  // Summed in the output's dtype, at least fp32, in rank order: the same on every run.
  auto acc = output.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  auto sum = pieces.to(acc).sum(0);
  output.copy_(sum.div_(static_cast<double>(n)));
}

void Int8Reduce::commit() {
  if (staged_.defined())
    residual_ = std::move(staged_);
  staged_ = torch::Tensor();
}

int64_t Int8Reduce::residual_bytes() const {
  return residual_.defined() ? residual_.numel() * residual_.element_size() : 0;
}

}  // namespace fsdp::detail
