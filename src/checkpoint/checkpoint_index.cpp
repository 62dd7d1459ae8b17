// See checkpoint_index.h.
#include "checkpoint_index.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <climits>
#include <fstream>

#include <fsdp/checkpoint/safetensors.h>

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

}  // namespace

Index parse_index_text(std::string_view text, const std::string& name) {
  const std::string where = name + ": ";
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::exception& e) {
    throw FormatError(where + "not valid JSON (" + e.what() + ")");
  }
  try {
    if (!j.is_object() || j.value("format", "") != kIndexFormat)
      throw FormatError("not an fsdp-cpp checkpoint index");
    if (get_int(j.at("version"), "version") != kIndexVersion)
      throw FormatError("version " + j.at("version").dump() + " is not supported");
    Index idx;
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
      for (const auto& p : t.at("pieces")) {
        Piece piece;
        piece.file = p.at("file").get<std::string>();
        if (piece.file.empty() || piece.file.find('/') != std::string::npos ||
            piece.file.find("..") != std::string::npos)
          throw FormatError(what + ": file name '" + piece.file + "' is not a plain name");
        piece.begin = get_int(p.at("rows").at(0), what + " rows");
        piece.end = get_int(p.at("rows").at(1), what + " rows");
        piece.block_rows = get_int(p.at("block_rows"), what + " block_rows");
        if (piece.begin < 0 || piece.begin > piece.end || piece.end > rows || piece.block_rows < 1)
          throw FormatError(what + ": piece rows [" + std::to_string(piece.begin) + ", " +
                            std::to_string(piece.end) + ") or block_rows invalid for " +
                            std::to_string(rows) + " rows");
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
        it.pieces.push_back(std::move(piece));
      }
      std::sort(it.pieces.begin(), it.pieces.end(),
                [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
      int64_t at = 0;
      for (const auto& p : it.pieces) {
        if (p.begin != at)
          throw FormatError(what + ": its pieces do not cover rows [" + std::to_string(at) + ", " +
                            std::to_string(p.begin) + ") exactly once");
        at = p.end;
      }
      if (at != rows)
        throw FormatError(what + ": its pieces end at row " + std::to_string(at) + " of " +
                          std::to_string(rows));
      idx.tensors.emplace(key, std::move(it));
    }
    return idx;
  } catch (const FormatError& e) {
    throw FormatError(where + e.what());
  } catch (const Json::exception& e) {
    throw FormatError(where + "malformed (" + e.what() + ")");
  }
}

Index parse_index(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw FormatError(path + ": cannot open (not a checkpoint directory?)");
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  return parse_index_text(text, path);
}

}  // namespace fsdp::detail
