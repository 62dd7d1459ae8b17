// The index of a sharded checkpoint (index.json): what save_sharded writes beside the rank
// files, and the strict parser load_sharded trusts nothing before. Its own file so that the
// fuzz target (tests/fuzz/fuzz_checkpoint_index.cpp) links the parser alone.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace fsdp::detail {

constexpr const char* kIndexFormat = "fsdp-cpp sharded checkpoint";
constexpr int kIndexVersion = 1;

/// Rows [begin, end) of a tensor, stored in `file` under the tensor's key, with one xxh3 per
/// block of block_rows rows.
struct Piece {
  std::string file;
  int64_t begin, end, block_rows;
  std::vector<uint64_t> sums;
};

/// A tensor: its global dtype and shape, and pieces tiling its rows exactly once, in order.
struct IndexTensor {
  torch::ScalarType dtype;
  std::vector<int64_t> shape;
  std::vector<Piece> pieces;  // tiling [0, rows) in order
};

/// The whole index: the caller's metadata, the optimizer, every tensor by key.
struct Index {
  std::map<std::string, std::string> metadata;
  std::string optimizer_kind;
  std::map<std::string, int64_t> steps;
  std::map<std::string, IndexTensor> tensors;
};

/// Parses and validates index.json's text (`name` prefixes the messages): every field's type,
/// plain file names, pieces inside the tensor's rows tiling them exactly once, one 16-hex-digit
/// checksum per block. Throws safetensors::FormatError.
Index parse_index_text(std::string_view text, const std::string& name);
/// The same for the file at `path`.
Index parse_index(const std::string& path);

}  // namespace fsdp::detail
