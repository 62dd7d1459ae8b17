// NF4 layers (use_nf4 in lora.h: a Linear's weight as 4-bit codes, 8-bit block absmaxes and
// their float scales and offset) filled from a file's float weights, whatever the file's
// format: GGUF (gguf_llama.cpp) and Hugging Face safetensors (hf_format.cpp) both read the
// weight's rows in the model's order and hand them here, so a model quantizes to the same
// bytes from either file when the floats are the same.
#pragma once

#include <torch/types.h>

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <fsdp/state_dict.h>

namespace fsdp_models {

/// One NF4 layer's four shards, in the order of nf4_parts().
using Nf4Shards = std::array<const fsdp::ParamShard*, 4>;

/// The suffixes of the four NF4 tensors of a layer: ".weight_nf4", ".weight_absmax",
/// ".weight_absmax_scale", ".weight_absmax_offset".
const std::array<const char*, 4>& nf4_parts();

/// The layer ("layers.0.attention.wq") if `name` is one of its NF4 tensors, "" otherwise.
std::string nf4_layer(const std::string& name);

/// The NF4 layers among `shards`, each with its four shards (all present: checked).
std::map<std::string, Nf4Shards> nf4_layers(const std::vector<fsdp::ParamShard>& shards);

/// Rows [row, row + rows) of the layer's float weight, in the model's row order, as float32
/// [rows, cols].
using WeightRows = std::function<torch::Tensor(int64_t row, int64_t rows)>;

/// Quantizes the [rows, cols] weight `read` gives into `shards` (this rank's part of each). The
/// 8-bit absmaxes need every block's absmax, so the whole weight streams through a bounded
/// buffer on every rank (the absmaxes are 1/64 of the weight); the 4-bit codes only the rank's
/// own rows. The caller has checked the file's shape against the layer's.
void load_nf4_layer(int64_t rows, int64_t cols, const WeightRows& read, const Nf4Shards& shards);

}  // namespace fsdp_models
