// BpeTokenizer from a GGUF file's tokenizer metadata (llama.cpp's keys): a byte-level BPE
// (tokenizer.ggml.model "gpt2": tokens, merges, token types) or a SentencePiece BPE ("llama":
// tokens with scores and types, no merges). The metadata comes from outside: every array's
// length is checked against the tokens', every id bounded.
#include <algorithm>
#include <string>
#include <vector>

#include "bpe_tokenizer.h"
#include "utf8.h"

namespace fsdp_trainer {

namespace gguf = fsdp_models::gguf;

namespace {

// The metadata's values by key, FormatError naming the file and key when one is missing.
struct Metadata {
  const std::map<std::string, gguf::Value>& md;
  const std::string& path;

  std::string key(const std::string& k) const { return path + ": " + k; }
  const gguf::Value& value(const std::string& k) const {
    auto it = md.find(k);
    if (it == md.end())
      throw gguf::FormatError(path + ": no metadata key '" + k + "'");
    return it->second;
  }
  // An optional token id key (-1 when absent), bounded by the vocabulary.
  int64_t token_id(const std::string& k, size_t tokens) const {
    if (!md.count(k))
      return -1;
    const int64_t id = value(k).as_int(key(k));
    if (id < 0 || id >= static_cast<int64_t>(tokens))
      throw gguf::FormatError(key(k) + " is " + std::to_string(id) + ", outside the " +
                              std::to_string(tokens) + " tokens");
    return id;
  }
};

// llama.cpp's token types.
constexpr int64_t kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6;

// SentencePiece pieces are at most 16 characters by default (Llama's longest: 16 U+2581, 48
// bytes); a token this long is no piece, and would cost its length squared in merges.
constexpr size_t kMaxPieceBytes = 128;

}  // namespace

BpeTokenizer BpeTokenizer::from_gguf(const gguf::File& f) {
  return from_gguf_metadata(f.metadata(), f.path());
}

BpeTokenizer BpeTokenizer::from_gguf_metadata(const std::map<std::string, gguf::Value>& md,
                                              const std::string& path) {
  const Metadata m{md, path};
  auto key = [&](const std::string& k) { return m.key(k); };
  auto value = [&](const std::string& k) -> const gguf::Value& { return m.value(k); };
  const auto model = value("tokenizer.ggml.model").as_string(key("tokenizer.ggml.model"));
  if (model == "llama")
    return from_gguf_sentencepiece(md, path);
  if (model != "gpt2")
    throw gguf::FormatError(key("tokenizer.ggml.model") + " is '" + model +
                            "'; only byte-level BPE (gpt2) and SentencePiece BPE (llama) are read");
  BpeTokenizer t;
  const auto& tokens = value("tokenizer.ggml.tokens").as_array(key("tokenizer.ggml.tokens"));
  const auto& types = value("tokenizer.ggml.token_type").as_array(key("tokenizer.ggml.token_type"));
  const auto& merges = value("tokenizer.ggml.merges").as_array(key("tokenizer.ggml.merges"));
  if (types.size() != tokens.size())
    throw gguf::FormatError(key("tokenizer.ggml.token_type") + " has " +
                            std::to_string(types.size()) + " entries for " +
                            std::to_string(tokens.size()) + " tokens");
  t.is_special_.assign(tokens.size(), false);
  for (size_t i = 0; i < tokens.size(); ++i) {
    t.tokens_.push_back(tokens[i].as_string(key("tokenizer.ggml.tokens")));
    // llama.cpp's token types: 3 control (<|im_start|>...), 4 user-defined; both are matched
    // whole in text, as Hugging Face's added tokens are. Only ordinary tokens are BPE's results:
    // a special token that happens to be spelled like a merge never comes out of plain text.
    const auto type = types[i].as_int(key("tokenizer.ggml.token_type"));
    if (type == 3 || type == 4) {
      t.is_special_[i] = true;
      t.specials_.emplace_back(t.tokens_.back(), static_cast<int64_t>(i));
    } else {
      t.ids_.emplace(t.tokens_.back(), static_cast<int64_t>(i));
    }
  }
  std::sort(t.specials_.begin(), t.specials_.end(),
            [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  for (size_t r = 0; r < merges.size(); ++r) {
    const auto& m = merges[r].as_string(key("tokenizer.ggml.merges"));
    if (m.find(' ') == std::string::npos)
      throw gguf::FormatError(key("tokenizer.ggml.merges") + " entry " + std::to_string(r) +
                              " is not two tokens separated by a space");
    t.merge_rank_.emplace(m, static_cast<int>(r));
  }
  t.bos_ = m.token_id("tokenizer.ggml.bos_token_id", tokens.size());
  t.eos_ = m.token_id("tokenizer.ggml.eos_token_id", tokens.size());
  t.init_byte_alphabet();
  t.set_splits({{kGpt2Pattern, false}}, path, /*from_file=*/false);
  return t;
}

namespace {

// The merges a SentencePiece model's scores stand for (see from_gguf_sentencepiece): every split
// of a normal piece into two normal pieces, ranked by the piece's score ("left right" -> rank).
std::unordered_map<std::string, int> merges_from_scores(
    const std::vector<std::string>& tokens, const std::vector<int64_t>& type,
    const std::vector<double>& score, const std::unordered_map<std::string, int64_t>& ids) {
  std::unordered_map<std::string, int> ranks;
  struct Merge {
    double score;
    size_t id;
    size_t left_bytes;
  };
  auto normal = [&](const std::string& s) {
    auto it = ids.find(s);
    return it != ids.end() && type[static_cast<size_t>(it->second)] == kNormal;
  };
  std::vector<Merge> merges;
  for (size_t id = 0; id < tokens.size(); ++id) {
    const auto& piece = tokens[id];
    // A piece holding an ASCII space never comes out of BPE here (spaces are U+2581 by then),
    // and would make the "left right" key ambiguous.
    if (type[id] != kNormal || piece.find(' ') != std::string::npos)
      continue;
    for (size_t k = utf8_lead_length(static_cast<unsigned char>(piece[0])); k < piece.size();
         k += utf8_lead_length(static_cast<unsigned char>(piece[k])))
      if (normal(piece.substr(0, k)) && normal(piece.substr(k)))
        merges.push_back({score[id], id, k});
  }
  // Pieces of equal score share a rank: BPE then merges the leftmost such pair first, as
  // SentencePiece and llama.cpp do (converters that know no scores give every piece the same).
  std::sort(merges.begin(), merges.end(),
            [](const Merge& a, const Merge& b) { return a.score > b.score; });
  int rank = -1;
  for (size_t r = 0; r < merges.size(); ++r) {
    if (r == 0 || merges[r].score != merges[r - 1].score)
      ++rank;
    const auto& piece = tokens[merges[r].id];
    ranks.emplace(piece.substr(0, merges[r].left_bytes) + " " + piece.substr(merges[r].left_bytes),
                  rank);
  }
  return ranks;
}

}  // namespace

// SentencePiece's BPE merges, among adjacent symbols whose concatenation is a piece, the one
// whose piece scores highest (leftmost on ties); BPE by merge rank does the same when every split
// of a piece into two pieces is a merge ranked by that piece's score (equal scores sharing a
// rank, which the BPE loop breaks leftmost first), which is how this reader turns scores into
// merges. Spaces are written as
// U+2581 and, unless tokenizer.ggml.add_space_prefix is false, one is put before the text after
// every special token and at the start, as llama.cpp does (Llama 2's "legacy" behaviour);
// decoding drops that leading space again. Control, user-defined and unknown tokens are matched
// whole in text, as for byte-level GGUF files and Hugging Face's added tokens.
BpeTokenizer BpeTokenizer::from_gguf_sentencepiece(const std::map<std::string, gguf::Value>& md,
                                                   const std::string& path) {
  const Metadata m{md, path};
  const auto& tokens = m.value("tokenizer.ggml.tokens").as_array(m.key("tokenizer.ggml.tokens"));
  const auto& types =
      m.value("tokenizer.ggml.token_type").as_array(m.key("tokenizer.ggml.token_type"));
  const auto& scores = m.value("tokenizer.ggml.scores").as_array(m.key("tokenizer.ggml.scores"));
  for (const auto* a : {&types, &scores})
    if (a->size() != tokens.size())
      throw gguf::FormatError(
          m.key(a == &types ? "tokenizer.ggml.token_type" : "tokenizer.ggml.scores") + " has " +
          std::to_string(a->size()) + " entries for " + std::to_string(tokens.size()) + " tokens");
  BpeTokenizer t;
  t.byte_level_ = false;
  t.is_special_.assign(tokens.size(), false);
  std::vector<int64_t> type(tokens.size());
  std::vector<double> score(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    t.tokens_.push_back(tokens[i].as_string(m.key("tokenizer.ggml.tokens")));
    type[i] = types[i].as_int(m.key("tokenizer.ggml.token_type"));
    score[i] = scores[i].as_double(m.key("tokenizer.ggml.scores"));
    const auto& text = t.tokens_.back();
    if (type[i] < kNormal || type[i] > kByte)
      throw gguf::FormatError(m.key("tokenizer.ggml.token_type") + " of token " +
                              std::to_string(i) + " is " + std::to_string(type[i]) +
                              ", not a llama.cpp token type (1-6)");
    if (text.empty() || (type[i] == kNormal && text.size() > kMaxPieceBytes))
      throw gguf::FormatError(
          m.key("tokenizer.ggml.tokens") + ": token " + std::to_string(i) +
          (text.empty() ? " is empty"
                        : " is longer than " + std::to_string(kMaxPieceBytes) + " bytes"));
    if (type[i] == kUnknown || type[i] == kControl || type[i] == kUserDefined) {
      t.is_special_[i] = true;
      t.specials_.emplace_back(text, static_cast<int64_t>(i));
    } else if (type[i] != kUnused && !t.ids_.emplace(text, static_cast<int64_t>(i)).second) {
      throw gguf::FormatError(m.key("tokenizer.ggml.tokens") + ": token '" + text +
                              "' has two ids, " + std::to_string(t.ids_.at(text)) + " and " +
                              std::to_string(i));
    }
  }
  std::stable_sort(t.specials_.begin(), t.specials_.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });

  t.merge_rank_ = merges_from_scores(t.tokens_, type, score, t.ids_);

  t.bos_ = m.token_id("tokenizer.ggml.bos_token_id", tokens.size());
  t.eos_ = m.token_id("tokenizer.ggml.eos_token_id", tokens.size());
  t.unk_ = m.token_id("tokenizer.ggml.unknown_token_id", tokens.size());
  const bool prefix =
      !md.count("tokenizer.ggml.add_space_prefix") ||
      m.value("tokenizer.ggml.add_space_prefix").as_bool(m.key("tokenizer.ggml.add_space_prefix"));
  t.space_prefix_ = prefix ? SpacePrefix::kEverySegment : SpacePrefix::kNone;
  t.decode_prefix_ = prefix ? DecodePrefix::kStripLeadingSpace : DecodePrefix::kKeep;
  t.index_byte_tokens(path);
  t.init_byte_alphabet();
  t.set_splits({}, path, /*from_file=*/false);
  return t;
}

}  // namespace fsdp_trainer
