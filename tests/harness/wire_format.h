// What a parameter looks like after the all-gather's wire format (GatherFormat), computed with
// ATen ops, independently of the library's codec: tests compare the codec and whole training
// runs against it.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

namespace fsdp::test {

/// int8 round trip of the rows of `rows` (2-d) in blocks of `block` values per row: scale =
/// block absmax / 127 (a true division), values rounded to nearest even and clamped to 127.
inline torch::Tensor int8_reference(const torch::Tensor& rows, int64_t block) {
  std::vector<torch::Tensor> parts;
  const int64_t width = rows.size(1);
  for (int64_t s = 0; s < width; s += block) {
    auto blk = rows.narrow(1, s, std::min(block, width - s));
    auto amax = blk.abs().amax(1, /*keepdim=*/true);
    auto scale = amax / torch::full_like(amax, 127);
    auto q = (blk / scale).round().clamp(-127, 127);
    parts.push_back(torch::where(scale > 0, q, torch::zeros_like(q)) * scale);
  }
  return torch::cat(parts, 1);
}

/// A parameter as its unit computes with it when gathered in `format` ("", "bf16", "int8"):
/// int8 for rows of at least 16 values, bf16 for narrower ones.
inline torch::Tensor wire_round(const torch::Tensor& w, const std::string& format, int64_t block) {
  if (format.empty())
    return w;
  const int64_t rows = w.dim() == 0 ? 1 : w.size(0);
  auto m = w.reshape({rows, -1});
  if (format == "int8" && m.size(1) >= 16)
    return int8_reference(m, block).view_as(w);
  return w.to(torch::kBFloat16).to(w.scalar_type());
}

}  // namespace fsdp::test
