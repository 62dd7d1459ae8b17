// See checkpoint_index.h.
#include "checkpoint_index.h"

#include <xxhash.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <set>
#include <tuple>
#include <utility>

#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/core/file.h>
#include <fsdp/core/json_depth.h>

namespace fsdp::detail {
namespace {

using Json = nlohmann::json;
using safetensors::FormatError;

int64_t get_int(const Json& v, const std::string& what) {
  if (!v.is_number_integer() && !v.is_number_unsigned())
    throw FormatError(what + " is not an integer");
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
    throw FormatError(what + " is out of range");
  return v.get<int64_t>();
}

// The rank a piece's file belongs to: "rank-00003.safetensors" -> 3; -1 for any other name.
int64_t rank_of_file(const std::string& file) {
  constexpr std::string_view prefix = "rank-", suffix = ".safetensors";
  if (file.size() != prefix.size() + 5 + suffix.size() || !file.starts_with(prefix) ||
      !file.ends_with(suffix))
    return -1;
  const auto digits = file.substr(prefix.size(), 5);
  if (digits.find_first_not_of("0123456789") != std::string::npos)
    return -1;
  return std::stoll(digits);
}

// A range [b, e) from a two-element array, inside [0, limit).
std::pair<int64_t, int64_t> get_range(const Json& v, const std::string& what, int64_t limit) {
  if (!v.is_array() || v.size() != 2)
    throw FormatError(what + " is not a [begin, end] pair");
  const int64_t b = get_int(v.at(0), what), e = get_int(v.at(1), what);
  if (b < 0 || b > e || e > limit)
    throw FormatError(what + " [" + std::to_string(b) + ", " + std::to_string(e) +
                      ") is not inside [0, " + std::to_string(limit) + ")");
  return {b, e};
}

Piece parse_piece(const Json& p, const std::string& what, int64_t world_size, int64_t rows,
                  int64_t cols, int64_t version) {
  Piece piece;
  piece.file = p.at("file").get<std::string>();
  if (piece.file.empty() || piece.file.find('/') != std::string::npos ||
      piece.file.find("..") != std::string::npos)
    throw FormatError(what + ": file name '" + piece.file + "' is not a plain name");
  const int64_t file_rank = rank_of_file(piece.file);
  if (file_rank < 0 || file_rank >= world_size)
    throw FormatError(what + ": file '" + piece.file + "' is not the file of a rank of the " +
                      std::to_string(world_size) + " that saved it (rank-NNNNN.safetensors)");
  std::tie(piece.begin, piece.end) = get_range(p.at("rows"), what + ": piece rows", rows);
  piece.block_rows = get_int(p.at("block_rows"), what + " block_rows");
  if (piece.block_rows < 1)
    throw FormatError(what + ": block_rows invalid (" + std::to_string(piece.block_rows) +
                      ", not >= 1)");
  piece.col_end = cols;
  if (version >= 3 && p.contains("cols")) {
    if (cols == 1 && p.at("cols") != Json::array({0, 1}))
      throw FormatError(what + ": columns given for a tensor of under two dimensions");
    std::tie(piece.col_begin, piece.col_end) = get_range(p.at("cols"), what + ": piece cols", cols);
    if (piece.col_begin == piece.col_end)
      throw FormatError(what + ": a piece of no columns");
  }
  if (version >= 3 && p.contains("at")) {
    piece.at = get_int(p.at("at"), what + " at");
    // The file's tensor is checked against it when read; here only what no file can hold.
    if (piece.at < 0 || piece.at > (int64_t{1} << 48))
      throw FormatError(what + ": piece at row " + std::to_string(piece.at) + " is out of range");
  }
  const int64_t blocks = (piece.end - piece.begin + piece.block_rows - 1) / piece.block_rows;
  const auto& sums = p.at("xxh3");
  if (!sums.is_array() || static_cast<int64_t>(sums.size()) != blocks)
    throw FormatError(what + ": expected " + std::to_string(blocks) + " checksums");
  for (const auto& s : sums) {
    const auto h = s.get<std::string>();
    if (h.size() != 16 || h.find_first_not_of("0123456789abcdef") != std::string::npos)
      throw FormatError(what + ": checksum '" + h + "' is not 16 hex digits");
    piece.sums.push_back(std::stoull(h, nullptr, 16));
  }
  return piece;
}

// Sorts `pieces` by (col_begin, begin) and checks that they tile [0, rows) x [0, cols) exactly
// once: bands of columns one after the other, each band's rows covered once, in order.
void check_tiling(std::vector<Piece>& pieces, const std::string& what, int64_t rows, int64_t cols) {
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) {
    return std::tie(a.col_begin, a.begin) < std::tie(b.col_begin, b.begin);
  });
  int64_t col = 0;
  size_t i = 0;
  do {
    const int64_t band_begin = i < pieces.size() ? pieces[i].col_begin : col;
    const int64_t band_end = i < pieces.size() ? pieces[i].col_end : cols;
    if (band_begin < col)
      throw FormatError(what + ": its pieces overlap in columns [" + std::to_string(band_begin) +
                        ", " + std::to_string(col) + ")");
    if (band_begin > col)
      throw FormatError(what + ": its pieces do not cover columns [" + std::to_string(col) + ", " +
                        std::to_string(band_begin) + ")");
    int64_t at = 0;
    for (; i < pieces.size() && pieces[i].col_begin == band_begin; ++i) {
      const auto& p = pieces[i];
      if (p.col_end != band_end)
        throw FormatError(what + ": pieces of columns [" + std::to_string(band_begin) + ", " +
                          std::to_string(band_end) + ") and [" + std::to_string(p.col_begin) +
                          ", " + std::to_string(p.col_end) + ") overlap");
      if (p.begin != at)
        throw FormatError(what + ": its pieces do not cover rows [" + std::to_string(at) + ", " +
                          std::to_string(p.begin) + ") exactly once");
      at = p.end;
    }
    if (at != rows)
      throw FormatError(what + ": its pieces end at row " + std::to_string(at) + " of " +
                        std::to_string(rows));
    col = band_end;
  } while (col < cols);
  if (i != pieces.size())
    throw FormatError(what + ": pieces past its last column");
}

// Every optimizer tensor and step count names a parameter of the index: a renamed key would
// otherwise load as "this parameter had no state" and train on silently.
void check_optimizer(const Index& idx) {
  static const std::set<std::string> kinds{"", "adamw", "adam", "sgd"};
  if (!kinds.count(idx.optimizer_kind))
    throw FormatError("optimizer kind '" + idx.optimizer_kind +
                      "' is none of adamw, adam, sgd (or empty)");
  for (const auto& [name, step] : idx.steps) {
    if (idx.optimizer_kind.empty())
      throw FormatError("an optimizer step for '" + name + "' but no optimizer kind");
    if (step < 0)
      throw FormatError("optimizer step of '" + name + "' is negative (" + std::to_string(step) +
                        ")");
    if (!idx.tensors.count("model/" + name))
      throw FormatError("optimizer step for '" + name + "', which is no tensor of the index");
  }
  for (const auto& [key, t] : idx.tensors) {
    if (key.starts_with("model/"))
      continue;
    if (!key.starts_with("optim/"))
      throw FormatError("tensor '" + key + "' is neither model/ nor optim/ state");
    const auto slash = key.rfind('/');
    const std::string param = key.substr(6, slash > 6 ? slash - 6 : 0);
    const auto model = idx.tensors.find("model/" + param);
    if (slash <= 6 || model == idx.tensors.end())
      throw FormatError("tensor '" + key + "' is optimizer state of no parameter of the index");
    if (!idx.steps.count(param))
      throw FormatError("tensor '" + key + "' has no optimizer step for '" + param + "'");
    if (model->second.shape != t.shape)
      throw FormatError("tensor '" + key + "' has another shape than 'model/" + param + "'");
  }
}

}  // namespace

std::string index_checksum(std::string_view compact_json) {
  char buf[17];
  std::snprintf(
      buf, sizeof buf, "%016llx",
      static_cast<unsigned long long>(XXH3_64bits(compact_json.data(), compact_json.size())));
  return buf;
}

Index parse_index_text(std::string_view text, const std::string& name) {
  const std::string where = name + ": ";
  if (const auto deep = json_too_deep(text); !deep.empty())
    throw FormatError(where + deep);
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::exception& e) {
    throw FormatError(where + "not valid JSON (" + e.what() + ")");
  }
  try {
    if (!j.is_object() || j.value("format", "") != kIndexFormat)
      throw FormatError("not an fsdp-cpp checkpoint index");
    const int64_t version = get_int(j.at("version"), "version");
    if (version < 1 || version > kIndexVersion)
      throw FormatError("version " + j.at("version").dump() + " is not supported (1 to " +
                        std::to_string(kIndexVersion) + " are)");
    Index idx;
    idx.world_size = get_int(j.at("world_size"), "world_size");
    if (idx.world_size < 1 || idx.world_size > 99999)
      throw FormatError("world_size " + std::to_string(idx.world_size) +
                        " is not a number of ranks (1 to 99999)");
    for (auto& [k, v] : j.at("metadata").items()) {
      if (!v.is_string())
        throw FormatError("metadata '" + k + "' is not a string");
      idx.metadata[k] = v.get<std::string>();
    }
    const auto& opt = j.at("optimizer");
    idx.optimizer_kind = opt.at("kind").get<std::string>();
    for (auto& [k, v] : opt.at("steps").items())
      idx.steps[k] = get_int(v, "optimizer step of '" + k + "'");
    for (auto& [key, t] : j.at("tensors").items()) {
      const std::string what = "tensor '" + key + "'";
      IndexTensor it;
      it.dtype = safetensors::dtype_from_name(t.at("dtype").get<std::string>());
      for (const auto& d : t.at("shape")) {
        const int64_t dim = get_int(d, what + " shape");
        if (dim < 0)
          throw FormatError(what + ": negative dimension");
        it.shape.push_back(dim);
      }
      const int64_t rows = it.shape.empty() ? 1 : it.shape[0];
      const int64_t cols = it.shape.size() < 2 ? 1 : it.shape[1];
      for (const auto& p : t.at("pieces"))
        it.pieces.push_back(parse_piece(p, what, idx.world_size, rows, cols, version));
      check_tiling(it.pieces, what, rows, cols);
      idx.tensors.emplace(key, std::move(it));
    }
    check_optimizer(idx);
    // Last: a field edited into another valid value (a step, a row range, a random state) is
    // caught only here, and a malformed one is better named by the checks above.
    if (version >= 2) {
      const auto stored = j.find(kIndexChecksumKey);
      if (stored == j.end() || !stored->is_string())
        throw FormatError(std::string("'") + kIndexChecksumKey + "', its checksum, is missing");
      const std::string want = stored->get<std::string>();
      j.erase(kIndexChecksumKey);
      if (index_checksum(j.dump()) != want)
        throw FormatError(
            "its contents do not match its checksum (edited or damaged since it was saved)");
    }
    return idx;
  } catch (const FormatError& e) {
    throw FormatError(where + e.what());
  } catch (const Json::exception& e) {
    throw FormatError(where + "malformed (" + e.what() + ")");
  }
}

Index parse_index(const std::string& path) {
  std::string text;
  try {
    text = read_small_file(path, kMaxIndexBytes);
  } catch (const std::runtime_error& e) {
    throw FormatError(std::string(e.what()) + " (not a checkpoint directory?)");
  }
  return parse_index_text(text, path);
}

}  // namespace fsdp::detail
