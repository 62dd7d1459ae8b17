#include "gather_codec.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace fsdp::detail {
namespace {

// 1.5 * 2^23: see the rounding in encode().
constexpr float kRoundMagic = 12582912.f;

int64_t rows_of(const torch::Tensor& t, int64_t row_numel) {
  return row_numel == 0 ? 0 : t.numel() / row_numel;
}

}  // namespace

GatherCodec::GatherCodec(const WireFormat& format) : format_(format) {}

std::optional<GatherCodec> GatherCodec::make(const MixedPrecisionPolicy& mp,
                                             torch::ScalarType dtype, torch::ScalarType compute,
                                             int64_t row_numel) {
  const auto format = gather_wire_format(mp, dtype, compute, row_numel);
  if (!format)
    return std::nullopt;
  return GatherCodec(*format);
}

int64_t GatherCodec::wire_numel(int64_t rows) const {
  return format_.numel(rows);
}

torch::Tensor GatherCodec::encode(const torch::Tensor& shard, bool portable) const {
  torch::NoGradGuard no_grad;
  if (!format_.int8)
    return shard.to(format_.dtype).contiguous().view({-1});
  const int64_t rows = rows_of(shard, format_.row_numel);
  auto src = shard.to(torch::kFloat).contiguous();
  if (portable || !src.is_cpu())
    return encode_portable(src, rows);
  auto wire = torch::zeros({wire_numel(rows)}, shard.options().dtype(torch::kByte));
  // Block maxima with ATen's reductions (vectorised, NaN-propagating).
  std::vector<torch::Tensor> maxima;
  for (const auto& b : row_blocks(src.view({rows, format_.row_numel})))
    maxima.push_back(b.abs().amax(2));
  auto amax = torch::cat(maxima, 1).contiguous();
  const float* x = src.data_ptr<float>();
  const float* block_max = amax.data_ptr<float>();
  auto* scales = reinterpret_cast<float*>(wire.data_ptr<uint8_t>());
  auto* q = reinterpret_cast<int8_t*>(wire.data_ptr<uint8_t>() + rows * format_.blocks_per_row * 4);
  // The quantisation is written by hand: ATen's quantize_per_channel wants double scales and
  // a qint8 tensor to copy out of; this writes the wire layout directly, in a loop the
  // auto-vectoriser takes (no libm call, no branch).
  at::parallel_for(
      0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, format_.row_numel)),
      [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          for (int64_t b = 0; b < format_.blocks_per_row; ++b) {
            const int64_t start = r * format_.row_numel + b * format_.block;
            const int64_t len = std::min(format_.block, format_.row_numel - b * format_.block);
            // A NaN or infinite value makes the block decode to NaN: divergence stays
            // visible.
            const float bmax = block_max[r * format_.blocks_per_row + b];
            const float scale =
                std::isfinite(bmax) ? bmax / 127.f : std::numeric_limits<float>::quiet_NaN();
            scales[r * format_.blocks_per_row + b] = scale;
            if (!(scale > 0.f))
              continue;  // all zeros (or NaN): q stays 0
            const float* xb = x + start;
            int8_t* qb = q + start;
            for (int64_t k = 0; k < len; ++k) {
              // Round to nearest even without nearbyint (a libm call per value on
              // baseline x86-64): adding and subtracting 1.5 * 2^23 leaves the rounded
              // integer for |v| < 2^22, and |v| <= 127 here.
              float v = xb[k] / scale;
              v = (v + kRoundMagic) - kRoundMagic;
              v = std::min(127.f, std::max(-127.f, v));
              qb[k] = static_cast<int8_t>(static_cast<int32_t>(v));
            }
          }
        }
      });
  return wire;
}

void GatherCodec::decode(const torch::Tensor& wire, const torch::Tensor& dst, int64_t pieces,
                         bool portable) const {
  torch::NoGradGuard no_grad;
  TORCH_INTERNAL_ASSERT(dst.is_contiguous() && wire.is_contiguous());
  const int64_t rows = pieces == 0 ? 0 : rows_of(dst, format_.row_numel) / pieces;
  TORCH_INTERNAL_ASSERT(wire.numel() == pieces * wire_numel(rows) &&
                        wire.scalar_type() == wire_dtype());
  if (!format_.int8) {
    dst.view({-1}).copy_(wire);
    return;
  }
  if (portable || !dst.is_cpu()) {
    decode_portable(wire, dst, pieces, rows);
    return;
  }
  const int64_t piece_bytes = wire_numel(rows);
  const uint8_t* base = wire.data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dst.scalar_type(), "int8 decode", [&] {
    scalar_t* out = dst.data_ptr<scalar_t>();
    at::parallel_for(
        0, pieces * rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, format_.row_numel)),
        [&](int64_t begin, int64_t end) {
          for (int64_t gr = begin; gr < end; ++gr) {
            const int64_t piece = gr / rows, r = gr % rows;
            const uint8_t* p = base + piece * piece_bytes;
            const auto* q = reinterpret_cast<const int8_t*>(p + rows * format_.blocks_per_row * 4);
            scalar_t* row = out + gr * format_.row_numel;
            for (int64_t b = 0; b < format_.blocks_per_row; ++b) {
              float scale;
              std::memcpy(&scale, p + (r * format_.blocks_per_row + b) * 4, sizeof scale);
              const int64_t start = b * format_.block;
              const int64_t len = std::min(format_.block, format_.row_numel - start);
              const int8_t* qb = q + r * format_.row_numel + start;
              for (int64_t i = 0; i < len; ++i)
                row[start + i] = static_cast<scalar_t>(static_cast<float>(qb[i]) * scale);
            }
          }
        });
  });
}

std::vector<torch::Tensor> GatherCodec::row_blocks(const torch::Tensor& m) const {
  const int64_t n = m.size(0), full = format_.row_numel / format_.block,
                tail = format_.row_numel - full * format_.block;
  std::vector<torch::Tensor> out;
  if (full > 0)
    out.push_back(m.narrow(1, 0, full * format_.block).view({n, full, format_.block}));
  if (tail > 0)
    out.push_back(m.narrow(1, full * format_.block, tail).view({n, 1, tail}));
  return out;
}

// The same format with ATen ops only (any device): scale = block max / 127 as a tensor
// division, torch::round (half to even, as the CPU loop's rounding), the same clamp.
torch::Tensor GatherCodec::encode_portable(const torch::Tensor& src, int64_t rows) const {
  std::vector<torch::Tensor> scales, values;
  for (const auto& b : row_blocks(src.view({rows, format_.row_numel}))) {
    auto amax = b.abs().amax(2, /*keepdim=*/true);
    auto scale = torch::where(amax.isfinite(), amax / torch::full_like(amax, 127.f),
                              torch::full_like(amax, std::numeric_limits<float>::quiet_NaN()));
    auto q = (b / scale).round().clamp(-127, 127);
    q = torch::where(scale > 0, q, torch::zeros_like(q)).to(torch::kChar);
    scales.push_back(scale.squeeze(2));
    values.push_back(q.reshape({rows, -1}));
  }
  auto wire = torch::zeros({wire_numel(rows)}, src.options().dtype(torch::kByte));
  const int64_t scale_bytes = rows * format_.blocks_per_row * 4,
                value_bytes = rows * format_.row_numel;
  if (rows > 0 && format_.row_numel > 0) {
    wire.narrow(0, 0, scale_bytes)
        .copy_(torch::cat(scales, 1).contiguous().view(torch::kByte).view({-1}));
    wire.narrow(0, scale_bytes, value_bytes)
        .copy_(torch::cat(values, 1).contiguous().view(torch::kByte).view({-1}));
  }
  return wire;
}

void GatherCodec::decode_portable(const torch::Tensor& wire, const torch::Tensor& dst,
                                  int64_t pieces, int64_t rows) const {
  const int64_t n = pieces * rows;
  if (n == 0 || format_.row_numel == 0)
    return;
  const int64_t scale_bytes = rows * format_.blocks_per_row * 4;
  auto w = wire.view({pieces, wire_numel(rows)});
  auto scales = w.narrow(1, 0, scale_bytes)
                    .contiguous()
                    .view(torch::kFloat)
                    .view({n, format_.blocks_per_row});
  auto q = w.narrow(1, scale_bytes, rows * format_.row_numel)
               .contiguous()
               .view(torch::kChar)
               .view({n, format_.row_numel})
               .to(torch::kFloat);
  auto out = row_blocks(dst.view({n, format_.row_numel}));
  auto values = row_blocks(q);
  int64_t column = 0;  // of the first scale of the block group
  for (size_t i = 0; i < out.size(); ++i) {
    const int64_t k = out[i].size(1);
    out[i].copy_(values[i] * scales.narrow(1, column, k).unsqueeze(2));
    column += k;
  }
}

}  // namespace fsdp::detail
