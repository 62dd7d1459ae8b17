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
// Version 2 adds "index_xxh3", the index's checksum of itself (index_checksum). Version 3 adds
// a piece's "cols" (a block of columns of a tensor split by columns over a tensor-parallel
// group) and "at" (its first row in the file's tensor, which then holds several pieces). Older
// indexes are still read, version 1 with every check but the checksum.
constexpr int kIndexVersion = 3;
constexpr const char* kIndexChecksumKey = "index_xxh3";
// index.json lists one checksum per ~4 MiB of rows: 64 MiB of it describes petabytes. More is
// not an index (a link to /dev/zero, a wrong file), and is refused before it is read.
constexpr uint64_t kMaxIndexBytes = uint64_t{64} << 20;

/// Rows [begin, end) and columns [col_begin, col_end) of a tensor (the whole of its columns
/// unless it was split by them; [0, 1) for a tensor of under two dimensions), stored in `file`
/// under the tensor's key from the file tensor's row `at`, with one xxh3 per block of
/// block_rows rows.
struct Piece {
  std::string file;
  int64_t begin = 0, end = 0, block_rows = 1;
  int64_t col_begin = 0, col_end = 1, at = 0;
  std::vector<uint64_t> sums;
};

/// A tensor: its global dtype and shape, and pieces tiling it exactly once: bands of columns
/// tiling [0, cols), each band's pieces tiling [0, rows); sorted by (col_begin, begin).
struct IndexTensor {
  torch::ScalarType dtype;
  std::vector<int64_t> shape;
  std::vector<Piece> pieces;
};

/// The whole index: the caller's metadata, the optimizer, every tensor by key.
struct Index {
  int64_t world_size = 0;  // ranks that saved it; pieces live in rank-<r>.safetensors, r < this
  std::map<std::string, std::string> metadata;
  std::string optimizer_kind;
  std::map<std::string, int64_t> steps;
  std::map<std::string, IndexTensor> tensors;
};

/// The checksum of an index: xxh3 of the compact JSON (`dump()` of the object without
/// kIndexChecksumKey, keys sorted), as 16 hex digits.
std::string index_checksum(std::string_view compact_json);

/// Parses and validates index.json's text (`name` prefixes the messages): every field's type,
/// plain file names of rank files of the saving world, pieces inside the tensor tiling it
/// exactly once (see IndexTensor), one 16-hex-digit checksum per block; every optimizer tensor and
/// step count belonging to a parameter of the index (same shape, steps >= 0); and, last, the
/// index's own checksum. Throws safetensors::FormatError.
Index parse_index_text(std::string_view text, const std::string& name);
/// The same for the file at `path`.
Index parse_index(const std::string& path);

}  // namespace fsdp::detail
