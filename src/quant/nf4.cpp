// NF4 storage; see fsdp/quant/nf4.h.
#include <fsdp/quant/nf4.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/autograd.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace fsdp::nf4 {

const std::array<float, 16>& values() {
  // The NF4 data type of the QLoRA paper (Dettmers et al. 2023, appendix E): 7 negative and 8
  // positive normal quantiles scaled to [-1, 1], and 0. These are the format's definition, so
  // they are spelled out; tests/python/check_nf4.py re-derives them from N(0, 1)'s inverse CDF.
  static const std::array<float, 16> v{-1.0f,
                                       -0.6961928009986877f,
                                       -0.5250730514526367f,
                                       -0.39491748809814453f,
                                       -0.28444138169288635f,
                                       -0.18477343022823334f,
                                       -0.09105003625154495f,
                                       0.0f,
                                       0.07958029955625534f,
                                       0.16093020141124725f,
                                       0.24611230194568634f,
                                       0.33791524171829224f,
                                       0.44070982933044434f,
                                       0.5626170039176941f,
                                       0.7229568362236023f,
                                       1.0f};
  return v;
}

const std::array<float, 256>& scale_code() {
  // Dettmers' dynamic tree code with 7 exponent bits: for exponent e = 0..6, 2^e fractions
  // (midpoints of a float32 linspace over [0.1, 1]) times 10^(e - 6), both signs, plus 0 and 1.
  // Built with LibTorch's own linspace and float32 arithmetic, as bitsandbytes builds it, so
  // the values agree bit for bit.
  static const std::array<float, 256> code = [] {
    std::vector<double> data;
    for (int e = 0; e < 7; ++e) {
      const auto bounds = torch::linspace(0.1, 1, (int64_t{1} << e) + 1, torch::kFloat32);
      const auto means = (bounds.slice(0, 0, -1) + bounds.slice(0, 1)) / 2.0;
      const auto scaled = means * std::pow(10.0, e - 6);
      const auto* p = scaled.data_ptr<float>();
      for (int64_t i = 0; i < scaled.numel(); ++i) {
        data.push_back(p[i]);
        data.push_back(-static_cast<double>(p[i]));
      }
    }
    data.push_back(0.0);
    data.push_back(1.0);
    TORCH_INTERNAL_ASSERT(data.size() == 256);
    std::sort(data.begin(), data.end());
    std::array<float, 256> out{};
    for (size_t i = 0; i < 256; ++i)
      out[i] = static_cast<float>(data[i]);
    return out;
  }();
  return code;
}

namespace {

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Index of the value of `table` (ascending) nearest to x; a tie goes to the lower value.
template <size_t N>
uint8_t nearest(const std::array<float, N>& table, float x) {
  const auto it = std::upper_bound(table.begin(), table.end(), x);
  if (it == table.begin())
    return 0;
  size_t left = static_cast<size_t>(it - table.begin()) - 1;
  if (left + 1 < N && std::fabs(x - table[left + 1]) < std::fabs(x - table[left]))
    ++left;
  return static_cast<uint8_t>(left);
}

// NF4 index of x: how many midpoints between consecutive values (in float32) lie below x, as
// bitsandbytes' torch.bucketize against those midpoints; a value on a midpoint goes down.
uint8_t nf4_index(float x) {
  static const std::array<float, 15> mid = [] {
    std::array<float, 15> m{};
    for (size_t i = 0; i < 15; ++i)
      m[i] = (values()[i] + values()[i + 1]) / 2.0f;
    return m;
  }();
  return static_cast<uint8_t>(std::lower_bound(mid.begin(), mid.end(), x) - mid.begin());
}

torch::Tensor flat_float(const torch::Tensor& t) {
  return t.reshape({-1}).to(torch::kFloat32).contiguous();
}

}  // namespace

torch::Tensor block_absmax(const torch::Tensor& w) {
  auto flat = flat_float(w);
  const int64_t n = flat.numel(), blocks = ceil_div(n, kBlock);
  auto out = torch::empty({blocks}, torch::kFloat32);
  const float* src = flat.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, blocks, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float m = 0;
      for (int64_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i)
        m = std::max(m, std::fabs(src[i]));
      dst[b] = m;
    }
  });
  return out;
}

Quantized quantize_absmax(const torch::Tensor& absmax) {
  TORCH_CHECK(absmax.dim() == 1 && absmax.scalar_type() == torch::kFloat32,
              "nf4::quantize_absmax: absmax must be 1-D float32");
  Quantized q;
  // The mean through ATen's reduction, as bitsandbytes computes it (the sum's order decides
  // the last bit).
  q.offset = absmax.mean().reshape({1});
  const float offset = q.offset.item<float>();
  const int64_t n = absmax.numel(), blocks = ceil_div(n, kScaleBlock);
  q.absmax_codes = torch::empty({n}, torch::kUInt8);
  q.scales = torch::empty({blocks}, torch::kFloat32);
  const float* a = absmax.contiguous().data_ptr<float>();
  uint8_t* codes = q.absmax_codes.data_ptr<uint8_t>();
  float* scales = q.scales.data_ptr<float>();
  const auto& table = scale_code();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t end = std::min(n, (b + 1) * kScaleBlock);
    float m = 0;
    for (int64_t i = b * kScaleBlock; i < end; ++i)
      m = std::max(m, std::fabs(a[i] - offset));
    scales[b] = m;
    for (int64_t i = b * kScaleBlock; i < end; ++i)
      codes[i] = m > 0 ? nearest(table, (a[i] - offset) / m) : nearest(table, 0.0f);
  }
  return q;
}

torch::Tensor encode(const torch::Tensor& w, const torch::Tensor& absmax) {
  auto flat = flat_float(w);
  const int64_t n = flat.numel();
  TORCH_CHECK(n % kBlock == 0, "nf4::encode: ", n, " elements are not whole blocks of ", kBlock);
  TORCH_CHECK(absmax.numel() == n / kBlock && absmax.scalar_type() == torch::kFloat32,
              "nf4::encode: ", absmax.numel(), " absmaxes for ", n / kBlock, " blocks");
  auto out = torch::empty({n / 2}, torch::kUInt8);
  const float* src = flat.data_ptr<float>();
  auto am = absmax.contiguous();
  const float* a = am.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n / kBlock, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      // bitsandbytes scales by the reciprocal (one rounding more than a division) and clamps.
      const float inv = 1.0f / std::max(a[b], 1e-38f);
      for (int64_t i = b * kBlock; i < (b + 1) * kBlock; i += 2) {
        const float x0 = std::clamp(src[i] * inv, -1.0f, 1.0f);
        const float x1 = std::clamp(src[i + 1] * inv, -1.0f, 1.0f);
        dst[i / 2] = static_cast<uint8_t>(nf4_index(x0) << 4 | nf4_index(x1));
      }
    }
  });
  return out;
}

Quantized quantize(const torch::Tensor& w) {
  TORCH_CHECK(w.numel() % 2 == 0, "nf4::quantize: an even number of elements is needed, got ",
              w.numel());
  auto absmax = block_absmax(w);
  auto q = quantize_absmax(absmax);
  const int64_t n = w.numel(), whole = n / kBlock * kBlock;
  auto flat = flat_float(w);
  auto codes = encode(flat.narrow(0, 0, whole), absmax.narrow(0, 0, whole / kBlock));
  if (whole < n) {  // a short last block: encode it padded to a whole one
    auto tail = torch::zeros({kBlock}, torch::kFloat32);
    tail.narrow(0, 0, n - whole).copy_(flat.narrow(0, whole, n - whole));
    auto tail_codes = encode(tail, absmax.narrow(0, whole / kBlock, 1));
    codes = torch::cat({codes, tail_codes.narrow(0, 0, (n - whole) / 2)});
  }
  q.codes = codes;
  return q;
}

torch::Tensor dequantize_absmax(const torch::Tensor& absmax_codes, const torch::Tensor& scales,
                                const torch::Tensor& offset) {
  TORCH_CHECK(absmax_codes.scalar_type() == torch::kUInt8 &&
                  scales.scalar_type() == torch::kFloat32 &&
                  offset.scalar_type() == torch::kFloat32 && offset.numel() == 1,
              "nf4::dequantize_absmax: expects uint8 codes, float32 scales and one float32 offset");
  const int64_t n = absmax_codes.numel();
  TORCH_CHECK(scales.numel() == ceil_div(n, kScaleBlock),
              "nf4::dequantize_absmax: ", scales.numel(), " scales for ", n, " absmaxes");
  if (!absmax_codes.device().is_cpu() || !scales.device().is_cpu())
    return dequantize_absmax_ops(absmax_codes, scales, offset);
  auto codes = absmax_codes.contiguous();
  auto sc = scales.contiguous();
  auto out = torch::empty({n}, torch::kFloat32);
  const float off = offset.item<float>();
  const auto& table = scale_code();
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* s = sc.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i)
    o[i] = table[c[i]] * s[i / kScaleBlock] + off;
  return out;
}

namespace {

template <typename T>
void expand(const uint8_t* codes, const float* absmax, T* out, int64_t n) {
  const auto& table = values();
  at::parallel_for(0, ceil_div(n, kBlock), 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float a = absmax[b];
      const int64_t end = std::min(n, (b + 1) * kBlock);
      for (int64_t i = b * kBlock; i < end; ++i) {
        const uint8_t byte = codes[i / 2];
        const uint8_t idx = (i % 2 == 0) ? byte >> 4 : byte & 0x0f;
        out[i] = static_cast<T>(table[idx] * a);
      }
    }
  });
}

}  // namespace

torch::Tensor dequantize_absmax_ops(const torch::Tensor& absmax_codes, const torch::Tensor& scales,
                                    const torch::Tensor& offset) {
  const int64_t n = absmax_codes.numel();
  TORCH_CHECK(scales.numel() == ceil_div(n, kScaleBlock) && offset.numel() == 1,
              "nf4::dequantize_absmax: ", scales.numel(), " scales for ", n, " absmaxes");
  const auto device = absmax_codes.device();
  const auto& code = scale_code();
  auto table = torch::tensor(std::vector<float>(code.begin(), code.end()),
                             torch::TensorOptions().device(device));
  // table[code] * scale of its block of 256, then + offset: two roundings, as the kernel's.
  auto per_absmax = scales.to(device).repeat_interleave(kScaleBlock).narrow(0, 0, n);
  return table.index_select(0, absmax_codes.reshape({-1}).to(torch::kLong)) * per_absmax +
         offset.to(device).reshape({});
}

torch::Tensor dequantize_ops(const torch::Tensor& codes, const torch::Tensor& absmax_codes,
                             const torch::Tensor& scales, const torch::Tensor& offset,
                             torch::IntArrayRef shape, torch::ScalarType dtype) {
  const int64_t n = c10::multiply_integers(shape);
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.numel() == ceil_div(n, 2),
              "nf4::dequantize: ", codes.numel(), " code bytes for ", n, " elements");
  TORCH_CHECK(absmax_codes.numel() == ceil_div(n, kBlock),
              "nf4::dequantize: ", absmax_codes.numel(), " absmaxes for ", n, " elements");
  // Everything where the codes are (the result's device).
  auto absmax = dequantize_absmax_ops(absmax_codes.to(codes.device()), scales, offset);
  // Flat first: byte i holds elements 2i (high nibble) and 2i + 1, whatever the codes' shape.
  auto c = codes.reshape({-1});
  auto table = torch::tensor(std::vector<float>(values().begin(), values().end()),
                             torch::TensorOptions().device(c.device()));
  auto hi = torch::bitwise_right_shift(c, 4).to(torch::kLong);
  auto lo = torch::bitwise_and(c, 15).to(torch::kLong);
  auto idx = torch::stack({hi, lo}, 1).reshape({-1}).narrow(0, 0, n);
  auto padded = torch::zeros({ceil_div(n, kBlock) * kBlock}, table.options());
  padded.narrow(0, 0, n).copy_(table.index_select(0, idx));
  auto w = padded.view({-1, kBlock}) * absmax.view({-1, 1});
  return w.reshape({-1}).narrow(0, 0, n).reshape(shape).to(dtype);
}

torch::Tensor dequantize(const torch::Tensor& codes, const torch::Tensor& absmax_codes,
                         const torch::Tensor& scales, const torch::Tensor& offset,
                         torch::IntArrayRef shape, torch::ScalarType dtype) {
  const int64_t n = c10::multiply_integers(shape);
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.numel() == ceil_div(n, 2),
              "nf4::dequantize: ", codes.numel(), " code bytes for ", n, " elements");
  TORCH_CHECK(absmax_codes.numel() == ceil_div(n, kBlock),
              "nf4::dequantize: ", absmax_codes.numel(), " absmaxes for ", n, " elements");
  if (!codes.device().is_cpu() || !absmax_codes.device().is_cpu() || !scales.device().is_cpu())
    return dequantize_ops(codes, absmax_codes, scales, offset, shape, dtype);
  auto absmax = dequantize_absmax(absmax_codes, scales, offset);
  auto c = codes.contiguous();
  auto out = torch::empty(shape, torch::TensorOptions().dtype(dtype));
  const uint8_t* cp = c.data_ptr<uint8_t>();
  const float* ap = absmax.data_ptr<float>();
  switch (dtype) {
    case torch::kFloat32:
      expand(cp, ap, out.data_ptr<float>(), n);
      break;
    case torch::kBFloat16:
      expand(cp, ap, out.data_ptr<c10::BFloat16>(), n);
      break;
    case torch::kHalf:
      expand(cp, ap, out.data_ptr<c10::Half>(), n);
      break;
    case torch::kFloat64:
      expand(cp, ap, out.data_ptr<double>(), n);
      break;
    default:
      TORCH_CHECK(false, "nf4::dequantize: unsupported dtype ", dtype);
  }
  return out;
}

namespace {

// y = x W^T, saving the quantized tensors rather than W.
struct Nf4Linear : public torch::autograd::Function<Nf4Linear> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& codes, const torch::Tensor& absmax_codes,
                               const torch::Tensor& scales, const torch::Tensor& offset,
                               int64_t out_features, int64_t in_features) {
    ctx->save_for_backward({codes, absmax_codes, scales, offset});
    ctx->saved_data["out"] = out_features;
    ctx->saved_data["in"] = in_features;
    auto w = dequantize(codes, absmax_codes, scales, offset, {out_features, in_features},
                        x.scalar_type());
    return torch::matmul(x, w.t());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& g = grads[0];
    auto w = dequantize(saved[0], saved[1], saved[2], saved[3],
                        {ctx->saved_data["out"].toInt(), ctx->saved_data["in"].toInt()},
                        g.scalar_type());
    return {torch::matmul(g, w), torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor(),     torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& codes,
                     const torch::Tensor& absmax_codes, const torch::Tensor& scales,
                     const torch::Tensor& offset, int64_t out_features, int64_t in_features) {
  TORCH_CHECK(x.size(-1) == in_features, "nf4::linear: input has ", x.size(-1),
              " features, the weight ", in_features);
  return Nf4Linear::apply(x, codes, absmax_codes, scales, offset, out_features, in_features);
}

}  // namespace fsdp::nf4
