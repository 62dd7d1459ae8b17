// See nf4_load.h.
#include "nf4_load.h"

#include <fsdp/quant/nf4.h>

#include <algorithm>

namespace fsdp_models {

const std::array<const char*, 4>& nf4_parts() {
  static const std::array<const char*, 4> parts{".weight_nf4", ".weight_absmax",
                                                ".weight_absmax_scale", ".weight_absmax_offset"};
  return parts;
}

namespace {

std::string layer_of(const std::string& name, size_t* part) {
  for (size_t i = 0; i < 4; ++i) {
    const std::string suffix = nf4_parts()[i];
    if (name.ends_with(suffix)) {
      *part = i;
      return name.substr(0, name.size() - suffix.size());
    }
  }
  return "";
}

}  // namespace

std::string nf4_layer(const std::string& name) {
  size_t part = 0;
  return layer_of(name, &part);
}

std::map<std::string, Nf4Shards> nf4_layers(const std::vector<fsdp::ParamShard>& shards) {
  std::map<std::string, Nf4Shards> out;
  for (const auto& s : shards) {
    size_t part = 0;
    if (const auto layer = layer_of(s.name, &part); !layer.empty())
      out[layer][part] = &s;
  }
  for (const auto& [layer, parts] : out)
    for (size_t i = 0; i < 4; ++i)
      TORCH_CHECK(parts[i], "NF4 layer '", layer, "' lacks ", nf4_parts()[i]);
  return out;
}

void load_nf4_layer(int64_t rows, int64_t cols, const WeightRows& read, const Nf4Shards& parts) {
  const auto* codes = parts[0];
  TORCH_CHECK(codes->global_shape == std::vector<int64_t>({rows, cols / 2}), "NF4 layer '",
              codes->name, "' does not hold a [", rows, ", ", cols, "] weight");
  const int64_t per_row = cols / fsdp::nf4::kBlock;
  const int64_t chunk = std::max<int64_t>(1, (int64_t{4} << 20) / (cols * 4));
  std::vector<torch::Tensor> absmax;
  for (int64_t r = 0; r < rows; r += chunk)
    absmax.push_back(fsdp::nf4::block_absmax(read(r, std::min(chunk, rows - r))));
  const auto all = torch::cat(absmax);
  const auto q = fsdp::nf4::quantize_absmax(all);
  const std::array<torch::Tensor, 4> full{torch::Tensor(), q.absmax_codes, q.scales, q.offset};
  for (size_t i = 1; i < 4; ++i) {
    const auto* s = parts[i];
    TORCH_CHECK(s->global_shape == full[i].sizes().vec(), "NF4 layer '", codes->name, "': '",
                s->name, "' does not fit its weight's absmaxes");
    if (s->rows > 0)  // the float32 scales are stored as int32 bit patterns (see use_nf4)
      s->shard.copy_(full[i].view(s->shard.scalar_type()).narrow(0, s->row_begin, s->rows));
  }
  for (int64_t r = 0; r < codes->rows; r += chunk) {
    const int64_t n = std::min(chunk, codes->rows - r), first = codes->row_begin + r;
    auto bytes = fsdp::nf4::encode(read(first, n), all.narrow(0, first * per_row, n * per_row));
    codes->shard.narrow(0, r, n).copy_(bytes.view({n, cols / 2}));
  }
}

}  // namespace fsdp_models
