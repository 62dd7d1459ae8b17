// BpeTokenizer::from_hf_json and to_hf_json: a byte-level BPE from and to a Hugging Face
// tokenizer.json (the format of the `tokenizers` library). The file comes from outside: every field
// read is type-checked, every id bounded, and any part of the pipeline this tokenizer does not
// implement is refused by name rather than approximated, so that a file that loads encodes exactly
// as `tokenizers` does (tests/trainer/test_hf_model.cpp compares them on the shipped corpora).
#include <nlohmann/json.hpp>

#include <fsdp/core/json_depth.h>

#include <algorithm>
#include <array>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "bpe_tokenizer.h"

namespace fsdp_trainer {
namespace {

using Json = nlohmann::json;
using fsdp_models::gguf::FormatError;

// A boolean field of object `j` (`fallback` when absent or null); FormatError if it has another
// type (nlohmann's value() would throw its own exception instead).
bool flag(const Json& j, const char* key, bool fallback, const std::string& where) {
  if (!j.is_object() || !j.contains(key) || j[key].is_null())
    return fallback;
  if (!j[key].is_boolean())
    throw FormatError(where + ": '" + key + "' is not a boolean");
  return j[key].get<bool>();
}

// Sequences nest; a file nesting them deeper than any real tokenizer would is refused before
// the recursion could exhaust the stack.
constexpr int kMaxPreTokenizerDepth = 8;

// The pre-tokenizer's patterns, in order, for one pre-tokenizer description.
void add_pre_tokenizer(const Json& p, const std::string& where, bool& byte_level,
                       std::vector<std::pair<std::string, bool>>& splits, int depth = 0) {
  if (depth > kMaxPreTokenizerDepth)
    throw FormatError(where + ": pre_tokenizer Sequences nest deeper than " +
                      std::to_string(kMaxPreTokenizerDepth));
  if (!p.is_object() || !p.contains("type") || !p["type"].is_string())
    throw FormatError(where + ": a pre_tokenizer without a 'type'");
  const auto type = p["type"].get<std::string>();
  auto flag = [&](const char* key, bool fallback) {
    return ::fsdp_trainer::flag(p, key, fallback, where + ": pre_tokenizer " + type);
  };
  if (byte_level)
    throw FormatError(where + ": pre_tokenizer " + type +
                      " comes after ByteLevel; only ByteLevel last is supported");
  if (type == "Sequence") {
    if (!p.contains("pretokenizers") || !p["pretokenizers"].is_array())
      throw FormatError(where + ": pre_tokenizer Sequence without a 'pretokenizers' list");
    for (const auto& q : p["pretokenizers"])
      add_pre_tokenizer(q, where, byte_level, splits, depth + 1);
  } else if (type == "ByteLevel") {
    if (flag("add_prefix_space", false))
      throw FormatError(where + ": pre_tokenizer ByteLevel with add_prefix_space is not supported");
    if (flag("use_regex", true))
      splits.emplace_back(kGpt2Pattern, false);
    byte_level = true;
  } else if (type == "Digits") {
    // tokenizers' Digits splits on char::is_numeric: Unicode's N categories. Each digit alone,
    // or runs of them.
    splits.emplace_back(flag("individual_digits", false) ? "\\p{N}" : "\\p{N}+", false);
  } else if (type == "Split") {
    if (flag("invert", false))
      throw FormatError(where + ": pre_tokenizer Split with invert is not supported");
    const auto behavior = p.value("behavior", Json()).is_string() ? p["behavior"].get<std::string>()
                                                                  : std::string("(none)");
    if (behavior != "Isolated")
      throw FormatError(where + ": pre_tokenizer Split's behavior '" + behavior +
                        "' is not supported (only Isolated)");
    const auto pattern = p.value("pattern", Json());
    if (pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string()) {
      const auto regex = pattern["Regex"].get<std::string>();
      // \h is a hex digit to Oniguruma (what `tokenizers` uses) and horizontal space to ICU.
      for (size_t i = 0; i + 1 < regex.size(); ++i) {
        if (regex[i] != '\\')
          continue;
        if (regex[i + 1] == 'h' || regex[i + 1] == 'H')
          throw FormatError(where + ": pre_tokenizer Split's pattern uses \\" +
                            std::string(1, regex[i + 1]) +
                            ", which Oniguruma and ICU read differently");
        ++i;  // an escaped character: "\\h" is a backslash and an h
      }
      splits.emplace_back(regex, false);
    } else if (pattern.is_object() && pattern.contains("String") && pattern["String"].is_string())
      splits.emplace_back(pattern["String"].get<std::string>(), true);
    else
      throw FormatError(where + ": pre_tokenizer Split without a Regex or String pattern");
  } else {
    throw FormatError(where + ": pre_tokenizer " + type + " is not supported");
  }
}

const std::string kMetaSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's visible space

// What a SentencePiece-style tokenizer.json does around its BPE, read from its normalizer,
// pre-tokenizer and decoder.
struct SentencePieceText {
  bool prepend = false;              // a Prepend(U+2581) normalizer
  bool replace = false;              // a Replace(" " -> U+2581) normalizer
  bool metaspace = false;            // a Metaspace pre-tokenizer (replaces spaces too)
  std::string scheme = "never";      // its prepend_scheme
  bool split = false;                // its split
  bool strip_leading_space = false;  // a Strip decoder taking one leading space
  bool strip_first_token = false;    // a Metaspace decoder with a prepend scheme
};

std::string type_of(const Json& j, const std::string& where, const char* what) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string())
    throw FormatError(where + ": a " + what + " without a 'type'");
  return j["type"].get<std::string>();
}

// The String of a Replace/Split pattern ("" if it is a Regex or absent).
std::string string_pattern(const Json& j) {
  const auto p = j.value("pattern", Json());
  return p.is_object() && p.contains("String") && p["String"].is_string()
             ? p["String"].get<std::string>()
             : std::string();
}

std::string string_field(const Json& j, const char* key) {
  return j.contains(key) && j[key].is_string() ? j[key].get<std::string>() : std::string();
}

void add_sentencepiece_normalizer(const Json& n, const std::string& where, SentencePieceText& sp,
                                  int depth = 0) {
  const auto type = type_of(n, where, "normalizer");
  if (type == "Sequence" && depth == 0 && n.contains("normalizers") &&
      n["normalizers"].is_array()) {
    for (const auto& m : n["normalizers"])
      add_sentencepiece_normalizer(m, where, sp, depth + 1);
  } else if (type == "Prepend" && string_field(n, "prepend") == kMetaSpace) {
    sp.prepend = true;
  } else if (type == "Replace" && string_pattern(n) == " " &&
             string_field(n, "content") == kMetaSpace) {
    sp.replace = true;
  } else {
    throw FormatError(where + ": normalizer " + type +
                      " is not supported (SentencePiece-style BPE: only Prepend of U+2581 "
                      "and Replace of ' ' by U+2581)");
  }
}

// Metaspace's prefix scheme, from its current field or the older add_prefix_space.
std::string metaspace_scheme(const Json& m, const std::string& where) {
  if (m.contains("prepend_scheme") && !m["prepend_scheme"].is_null()) {
    const auto scheme = string_field(m, "prepend_scheme");
    if (scheme != "always" && scheme != "first" && scheme != "never")
      throw FormatError(where + ": Metaspace's prepend_scheme is not always, first or never");
    return scheme;
  }
  return flag(m, "add_prefix_space", true, where + ": Metaspace") ? "always" : "never";
}

void read_metaspace(const Json& m, const std::string& where) {
  if (string_field(m, "replacement") != kMetaSpace)
    throw FormatError(where + ": Metaspace's replacement is not U+2581");
}

// One decoder step: its type, checked to be one that undoes SentencePiece-style encoding.
std::string sentencepiece_decoder_step(const Json& d, const std::string& where,
                                       SentencePieceText& sp) {
  const auto type = type_of(d, where, "decoder");
  if ((type == "Replace" && string_pattern(d) == kMetaSpace && string_field(d, "content") == " ") ||
      type == "ByteFallback" || type == "Fuse")
    return type;
  if (type == "Strip" && string_field(d, "content") == " " && d.value("stop", Json()) == 0 &&
      (d.value("start", Json()) == 0 || d.value("start", Json()) == 1)) {
    sp.strip_leading_space = d["start"] == 1;
    return type;
  }
  if (type == "Metaspace") {
    read_metaspace(d, where + ": decoder");
    sp.strip_first_token = metaspace_scheme(d, where + ": decoder") != "never";
    return type;
  }
  throw FormatError(where + ": decoder " + type +
                    " is not supported (SentencePiece-style BPE: Replace of U+2581 by ' ', "
                    "ByteFallback, Fuse, Strip of one leading ' ', Metaspace)");
}

// The decoder, which must be one of the layouts that undo the encoding: `tokenizers` applies
// the steps in order (Strip before Fuse strips every token, Metaspace after Fuse sees one token),
// so the order is checked, not only the steps.
void read_sentencepiece_decoder(const Json& d, const std::string& where, SentencePieceText& sp) {
  std::vector<std::string> steps;
  if (type_of(d, where, "decoder") == "Sequence" && d.contains("decoders") &&
      d["decoders"].is_array()) {
    for (const auto& e : d["decoders"])
      steps.push_back(sentencepiece_decoder_step(e, where, sp));
  } else {
    steps.push_back(sentencepiece_decoder_step(d, where, sp));
  }
  using Steps = std::vector<std::string>;
  const bool replace = steps == Steps{"Replace", "ByteFallback", "Fuse"} ||
                       steps == Steps{"Replace", "ByteFallback", "Fuse", "Strip"};
  const bool metaspace = steps == Steps{"ByteFallback", "Metaspace"} ||
                         steps == Steps{"ByteFallback", "Metaspace", "Fuse"};
  if (!replace && !metaspace) {
    std::string layout;
    for (const auto& step : steps)
      layout += (layout.empty() ? "" : ", ") + step;
    throw FormatError(where + ": decoder [" + layout +
                      "] is not supported (SentencePiece-style BPE: Replace, ByteFallback, Fuse "
                      "and optionally Strip; or ByteFallback, Metaspace and optionally Fuse)");
  }
  sp.strip_leading_space = replace && sp.strip_leading_space;
  sp.strip_first_token = metaspace && sp.strip_first_token;
}

std::string dump_json(const Json& out) {
  try {
    return out.dump();
  } catch (const Json::exception&) {  // nlohmann refuses invalid UTF-8 (error 316)
    throw FormatError(
        "tokenizer.json: a token or pattern is not valid UTF-8, which JSON text cannot hold");
  }
}

// A string field of `j` ("" when absent or null); FormatError if it has another type.
std::string optional_string(const Json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || j[key].is_null())
    return "";
  if (!j[key].is_string())
    throw FormatError(where + ": '" + key + "' is not a string");
  return j[key].get<std::string>();
}

// The tokenizer.json's model: a BPE without what is not implemented. Returns whether it has
// byte_fallback, which marks the SentencePiece family (characters, then their bytes); without
// it the model must be byte-level.
bool check_bpe_model(const Json& j, const std::string& path) {
  if (!j.is_object() || !j.contains("model") || !j["model"].is_object())
    throw FormatError(path + ": no 'model' object");
  const auto& model = j["model"];
  const auto type = optional_string(model, "type", path + ": model");
  if (type != "BPE")
    throw FormatError(path + ": model type '" + type + "' is not supported (only BPE)");
  const bool sentencepiece = flag(model, "byte_fallback", false, path + ": model");
  if (!optional_string(model, "continuing_subword_prefix", path).empty() ||
      !optional_string(model, "end_of_word_suffix", path).empty())
    throw FormatError(path +
                      ": BPE's continuing_subword_prefix / end_of_word_suffix are not "
                      "supported");
  if (model.contains("dropout") && !model["dropout"].is_null() &&
      !(model["dropout"].is_number() && model["dropout"].get<double>() == 0))
    throw FormatError(path + ": BPE dropout is not supported");
  return sentencepiece;
}

// A byte-level BPE's text rules: no normalizer, a pre-tokenizer with ByteLevel (its patterns
// into `splits`), a ByteLevel decoder.
void read_byte_level_rules(const Json& j, const std::string& path,
                           std::vector<std::pair<std::string, bool>>& splits) {
  if (j.contains("normalizer") && !j["normalizer"].is_null())
    throw FormatError(path + ": normalizer " +
                      optional_string(j["normalizer"], "type", path + ": normalizer") +
                      " is not supported (byte-level BPE has none)");
  if (!j.contains("pre_tokenizer") || j["pre_tokenizer"].is_null())
    throw FormatError(path + ": no pre_tokenizer (byte-level BPE needs ByteLevel)");
  bool byte_level = false;
  add_pre_tokenizer(j["pre_tokenizer"], path, byte_level, splits);
  if (!byte_level)
    throw FormatError(path +
                      ": the pre_tokenizer has no ByteLevel and the model no byte_fallback; "
                      "only byte-level and SentencePiece-style BPE are read");
  if (j.contains("decoder") && !j["decoder"].is_null() &&
      optional_string(j["decoder"], "type", path + ": decoder") != "ByteLevel")
    throw FormatError(path + ": decoder " +
                      optional_string(j["decoder"], "type", path + ": decoder") +
                      " is not supported (only ByteLevel)");
}

// A SentencePiece-style BPE's text rules: its normalizer, Metaspace pre-tokenizer and decoder,
// which together must make spaces U+2581 and undo it.
void read_sentencepiece_rules(const Json& j, const std::string& path, SentencePieceText& sp) {
  if (j.contains("normalizer") && !j["normalizer"].is_null())
    add_sentencepiece_normalizer(j["normalizer"], path, sp);
  if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null()) {
    const auto& p = j["pre_tokenizer"];
    const auto type = type_of(p, path, "pre_tokenizer");
    if (type != "Metaspace")
      throw FormatError(path + ": pre_tokenizer " + type +
                        " is not supported with byte_fallback (SentencePiece-style BPE: "
                        "none, or Metaspace)");
    read_metaspace(p, path + ": pre_tokenizer");
    sp.metaspace = true;
    sp.scheme = metaspace_scheme(p, path + ": pre_tokenizer");
    sp.split = flag(p, "split", true, path + ": pre_tokenizer Metaspace");
  }
  if (!sp.replace && !sp.metaspace)
    throw FormatError(path +
                      ": a BPE with byte_fallback whose spaces are not made U+2581 (by a "
                      "Replace normalizer or a Metaspace pre-tokenizer) is not supported");
  if (!j.contains("decoder") || j["decoder"].is_null())
    throw FormatError(path +
                      ": no decoder (SentencePiece-style BPE needs one undoing "
                      "U+2581 and byte fallback)");
  read_sentencepiece_decoder(j["decoder"], path, sp);
}

// Every id's text, the vocabulary's and the added tokens' (special): each id once, each text
// once, no id without a text.
struct HfVocabulary {
  std::vector<std::string> tokens;
  std::vector<bool> is_special;
};

HfVocabulary read_vocabulary(const Json& j, const std::string& path, bool sentencepiece) {
  const auto& model = j["model"];
  // Ids: the vocabulary's and the added tokens'; every id below the largest must have a token,
  // so no id can exceed their count (checked before anything is sized by an id).
  if (!model.contains("vocab") || !model["vocab"].is_object())
    throw FormatError(path + ": model has no 'vocab' object");
  const int64_t max_id = static_cast<int64_t>(model["vocab"].size()) +
                         (j.contains("added_tokens") && j["added_tokens"].is_array()
                              ? static_cast<int64_t>(j["added_tokens"].size())
                              : 0);
  HfVocabulary t;
  auto place = [&](int64_t id, const std::string& text, const char* what) {
    if (id < 0 || id >= max_id)
      throw FormatError(path + ": " + what + " '" + text + "' has id " + std::to_string(id) +
                        ", outside [0, " + std::to_string(max_id) + ")");
    if (static_cast<size_t>(id) >= t.tokens.size()) {
      t.tokens.resize(static_cast<size_t>(id) + 1);
      t.is_special.resize(static_cast<size_t>(id) + 1, false);
    }
    auto& slot = t.tokens[static_cast<size_t>(id)];
    return std::pair<std::string*, bool>(&slot, slot.empty());
  };
  for (const auto& [text, id] : model["vocab"].items()) {
    if (!id.is_number_integer())
      throw FormatError(path + ": vocab entry '" + text + "' has no integer id");
    if (text.empty())
      throw FormatError(path + ": the vocab holds an empty token");
    auto [slot, fresh] = place(id.get<int64_t>(), text, "vocab entry");
    if (!fresh)
      throw FormatError(path + ": tokens '" + *slot + "' and '" + text + "' share id " +
                        std::to_string(id.get<int64_t>()));
    *slot = text;
  }
  if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
    if (!j["added_tokens"].is_array())
      throw FormatError(path + ": 'added_tokens' is not a list");
    for (const auto& a : j["added_tokens"]) {
      if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() ||
          !a.contains("content") || !a["content"].is_string() ||
          a["content"].get<std::string>().empty())
        throw FormatError(path + ": an added token without an integer 'id' and a 'content'");
      const auto content = a["content"].get<std::string>();
      for (const char* key : {"lstrip", "rstrip", "single_word"})
        if (flag(a, key, false, path + ": added token"))
          throw FormatError(path + ": added token '" + content + "' uses " + key +
                            ", which is not supported");
      // `tokenizers` matches a normalized added token in the normalized text ("<x>" as "▁<x>"
      // after a Prepend), so the normalizer runs across it: not implemented. Without a
      // normalizer (byte-level) the flag changes nothing.
      if (sentencepiece && flag(a, "normalized", !flag(a, "special", false, path + ": added token"),
                                path + ": added token"))
        throw FormatError(path + ": added token '" + content +
                          "' is normalized, which is not supported with a SentencePiece-style "
                          "normalizer");
      auto [slot, fresh] = place(a["id"].get<int64_t>(), content, "added token");
      if (!fresh && *slot != content)
        throw FormatError(path + ": added token '" + content + "' has the id of '" + *slot + "'");
      *slot = content;
      t.is_special[static_cast<size_t>(a["id"].get<int64_t>())] = true;
    }
  }
  std::unordered_map<std::string, size_t> seen;  // one id per text: the vocabulary maps text -> id
  for (size_t id = 0; id < t.tokens.size(); ++id) {
    if (!t.tokens[id].empty()) {
      if (auto [it, fresh] = seen.emplace(t.tokens[id], id); !fresh)
        throw FormatError(path + ": token '" + t.tokens[id] + "' has two ids, " +
                          std::to_string(it->second) + " and " + std::to_string(id));
    }
    if (t.tokens[id].empty())
      throw FormatError(path + ": id " + std::to_string(id) + " has no token (ids must be 0.." +
                        std::to_string(t.tokens.size() - 1) + " without gaps)");
  }
  return t;
}

// The merges by rank ("left right" -> rank), each of two ordinary tokens (`ids`) making a third.
std::unordered_map<std::string, int> read_merges(
    const Json& model, const std::string& path,
    const std::unordered_map<std::string, int64_t>& ids) {
  std::unordered_map<std::string, int> ranks;
  if (!model.contains("merges") || !model["merges"].is_array())
    throw FormatError(path + ": model has no 'merges' list");
  const auto& merges = model["merges"];
  for (size_t r = 0; r < merges.size(); ++r) {
    const auto& m = merges[r];
    std::string left, right;
    if (m.is_string()) {  // "left right" (the older layout)
      const auto s = m.get<std::string>();
      const auto space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
        throw FormatError(path + ": merge " + std::to_string(r) + " '" + s +
                          "' is not two tokens separated by a space");
      }
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      throw FormatError(path + ": merge " + std::to_string(r) + " is not a pair of tokens");
    }
    // Tokens BPE works on never hold a space (GPT-2's alphabet maps it to 'Ġ', SentencePiece's
    // text has U+2581), which keeps the "left right" key unambiguous. Added tokens are matched
    // whole and never come out of BPE (plain text must not become a control token): a merge
    // using or making one is refused.
    if (left.empty() || right.empty() || left.find(' ') != std::string::npos ||
        right.find(' ') != std::string::npos || !ids.count(left) || !ids.count(right) ||
        !ids.count(left + right))
      throw FormatError(path + ": merge " + std::to_string(r) + " ('" + left + "', '" + right +
                        "') is not of two ordinary vocabulary tokens making a third");
    // `tokenizers` keeps the last rank of a merge listed twice, a map would keep the first:
    // such a file is refused rather than read either way.
    if (!ranks.emplace(left + " " + right, static_cast<int>(r)).second)
      throw FormatError(path + ": merge " + std::to_string(r) + " ('" + left + "', '" + right +
                        "') is listed twice");
  }
  return ranks;
}

}  // namespace

BpeTokenizer BpeTokenizer::from_hf_json(const std::string& json_text, const std::string& path,
                                        const std::string& bos, const std::string& eos) {
  if (const auto deep = fsdp::json_too_deep(json_text); !deep.empty())
    throw FormatError(path + ": " + deep);
  Json j;
  try {
    j = Json::parse(json_text);
  } catch (const Json::exception& e) {
    throw FormatError(path + ": not valid JSON (" + e.what() + ")");
  }
  if (!j.is_object() || !j.contains("model") || !j["model"].is_object())
    throw FormatError(path + ": no 'model' object");
  const auto& model = j["model"];
  const bool sentencepiece = check_bpe_model(j, path);
  std::vector<std::pair<std::string, bool>> splits;
  SentencePieceText sp;
  if (!sentencepiece)
    read_byte_level_rules(j, path, splits);
  else
    read_sentencepiece_rules(j, path, sp);

  BpeTokenizer t;
  {
    auto vocabulary = read_vocabulary(j, path, sentencepiece);
    t.tokens_ = std::move(vocabulary.tokens);
    t.is_special_ = std::move(vocabulary.is_special);
  }
  for (size_t id = 0; id < t.tokens_.size(); ++id) {
    if (t.is_special_[id])
      t.specials_.emplace_back(t.tokens_[id], static_cast<int64_t>(id));
    else
      t.ids_.emplace(t.tokens_[id], static_cast<int64_t>(id));
  }
  std::stable_sort(t.specials_.begin(), t.specials_.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });

  t.merge_rank_ = read_merges(model, path, t.ids_);
  t.ignore_merges_ = flag(model, "ignore_merges", false, path + ": model");
  if (sentencepiece) {
    t.byte_level_ = false;
    t.metaspace_ = sp.metaspace;
    t.split_at_space_ = sp.metaspace && sp.split;
    t.space_prefix_ = sp.prepend              ? SpacePrefix::kEverySegment
                      : sp.scheme == "always" ? SpacePrefix::kUnlessSpace
                      : sp.scheme == "first"  ? SpacePrefix::kFirstSegment
                                              : SpacePrefix::kNone;
    t.decode_prefix_ = sp.strip_leading_space ? DecodePrefix::kStripLeadingSpace
                       : sp.strip_first_token ? DecodePrefix::kStripFirstToken
                                              : DecodePrefix::kKeep;
    t.index_byte_tokens(path);
    const auto unk = optional_string(model, "unk_token", path + ": model");
    if (!unk.empty()) {
      if (const int64_t s = t.special_id(unk); s >= 0)
        t.unk_ = s;
      else if (auto it = t.ids_.find(unk); it != t.ids_.end())
        t.unk_ = it->second;
      else
        throw FormatError(path + ": the unk_token '" + unk + "' is not in the vocabulary");
    }
  }

  auto id_of = [&](const std::string& text, const char* what) -> int64_t {
    if (text.empty())
      return -1;
    if (const int64_t s = t.special_id(text); s >= 0)
      return s;
    if (auto it = t.ids_.find(text); it != t.ids_.end())
      return it->second;
    throw FormatError(path + ": the " + what + " token '" + text + "' is not in the vocabulary");
  };
  t.bos_ = id_of(bos, "bos");
  t.eos_ = id_of(eos, "eos");
  t.init_byte_alphabet();
  t.set_splits(splits, path, /*from_file=*/true);
  return t;
}

namespace {

// The vocabulary (every token with its id, the special ones too, as transformers writes them)
// and the added tokens (the special ones).
std::pair<Json, Json> vocab_json(const std::vector<std::string>& tokens,
                                 const std::vector<bool>& is_special) {
  Json vocab = Json::object();
  Json added = Json::array();
  for (size_t id = 0; id < tokens.size(); ++id) {
    if (vocab.contains(tokens[id]))
      throw fsdp_models::gguf::FormatError(
          "tokenizer.json: the token '" + tokens[id] + "' has two ids, " +
          std::to_string(vocab[tokens[id]].get<size_t>()) + " and " + std::to_string(id));
    vocab[tokens[id]] = id;
    if (is_special[id])
      added.push_back({{"id", id},
                       {"content", tokens[id]},
                       {"single_word", false},
                       {"lstrip", false},
                       {"rstrip", false},
                       {"normalized", false},
                       {"special", true}});
  }
  return {vocab, added};
}

// The merges, [left, right] pairs in rank order.
Json merges_json(const std::unordered_map<std::string, int>& merge_rank) {
  // Merges in rank order. Ranks may have gaps (a GGUF file listing a merge twice: its later
  // rank never applies) or be shared (a GGUF "llama" file's pieces of equal score, which merge
  // leftmost first): tokenizer.json has no shared ranks, so those are ordered by their text,
  // and `tokenizers` may merge them in another order than we do.
  std::vector<std::pair<int, const std::string*>> by_rank;
  for (const auto& [pair, rank] : merge_rank)
    by_rank.emplace_back(rank, &pair);
  std::sort(by_rank.begin(), by_rank.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first < b.first : *a.second < *b.second;
  });
  Json merges = Json::array();
  for (const auto& [rank, pair] : by_rank) {
    const auto space = pair->find(' ');
    merges.push_back({pair->substr(0, space), pair->substr(space + 1)});
  }
  return merges;
}

// The byte-level pre-tokenizer from the patterns read (never the file's own JSON, which could
// nest anything): GPT-2's pattern alone is ByteLevel's own; otherwise Split steps (Digits'
// patterns are Splits of the same pattern) then ByteLevel without a pattern.
Json byte_level_pre_tokenizer(const std::vector<std::pair<std::string, bool>>& splits) {
  Json pre;
  const Json byte_level = {{"type", "ByteLevel"},
                           {"add_prefix_space", false},
                           {"trim_offsets", true},
                           {"use_regex", false}};
  if (splits.size() == 1 && !splits[0].second && splits[0].first == kGpt2Pattern) {
    pre = byte_level;
    pre["use_regex"] = true;
  } else {
    Json steps = Json::array();
    for (const auto& [pattern, literal] : splits)
      steps.push_back({{"type", "Split"},
                       {"pattern", {{literal ? "String" : "Regex", pattern}}},
                       {"behavior", "Isolated"},
                       {"invert", false}});
    steps.push_back(byte_level);
    pre = {{"type", "Sequence"}, {"pretokenizers", steps}};
  }
  return pre;
}

// The SentencePiece-style pipeline as read (Prepend / Replace normalizers or a Metaspace
// pre-tokenizer; a decoder undoing them), in the layout transformers' Llama conversion writes:
// the normalizer, the pre-tokenizer and the decoder.
std::array<Json, 3> sentencepiece_pipeline(const SentencePieceText& sp) {
  const Json prepend = {{"type", "Prepend"}, {"prepend", kMetaSpace}};
  const Json replace = {
      {"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", kMetaSpace}};
  Json normalizer, pre;
  if (sp.metaspace) {
    if (sp.prepend)
      normalizer = prepend;
    pre = {{"type", "Metaspace"},
           {"replacement", kMetaSpace},
           {"prepend_scheme", sp.scheme},
           {"split", sp.split}};
  } else {
    normalizer = sp.prepend
                     ? Json{{"type", "Sequence"}, {"normalizers", Json::array({prepend, replace})}}
                     : replace;
  }
  Json decoders = Json::array();
  decoders.push_back(
      {{"type", "Replace"}, {"pattern", {{"String", kMetaSpace}}}, {"content", " "}});
  decoders.push_back({{"type", "ByteFallback"}});
  decoders.push_back({{"type", "Fuse"}});
  if (sp.strip_leading_space)
    decoders.push_back({{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}});
  else if (sp.strip_first_token)  // after Replace: strips nothing
    decoders = Json::array({{{"type", "ByteFallback"}},
                            {{"type", "Metaspace"},
                             {"replacement", kMetaSpace},
                             {"prepend_scheme", "always"},
                             {"split", true}}});
  return {normalizer, pre, Json{{"type", "Sequence"}, {"decoders", decoders}}};
}

}  // namespace

std::string BpeTokenizer::to_hf_json() const {
  const auto [vocab, added] = vocab_json(tokens_, is_special_);
  Json normalizer, pre, decoder, unk;
  if (byte_level_) {
    pre = byte_level_pre_tokenizer(splits_);
    decoder = {{"type", "ByteLevel"},
               {"add_prefix_space", true},
               {"trim_offsets", true},
               {"use_regex", true}};
  } else {
    SentencePieceText sp;
    sp.metaspace = metaspace_;
    sp.prepend = space_prefix_ == SpacePrefix::kEverySegment;
    sp.scheme = space_prefix_ == SpacePrefix::kUnlessSpace    ? "always"
                : space_prefix_ == SpacePrefix::kFirstSegment ? "first"
                                                              : "never";
    sp.split = split_at_space_;
    sp.strip_leading_space = decode_prefix_ == DecodePrefix::kStripLeadingSpace;
    sp.strip_first_token = decode_prefix_ == DecodePrefix::kStripFirstToken;
    auto pipeline = sentencepiece_pipeline(sp);
    normalizer = std::move(pipeline[0]);
    pre = std::move(pipeline[1]);
    decoder = std::move(pipeline[2]);
    if (unk_ >= 0)
      unk = tokens_[static_cast<size_t>(unk_)];
  }
  const Json out = {{"version", "1.0"},
                    {"truncation", nullptr},
                    {"padding", nullptr},
                    {"added_tokens", added},
                    {"normalizer", normalizer},
                    {"pre_tokenizer", pre},
                    {"post_processor", nullptr},
                    {"decoder", decoder},
                    {"model",
                     {{"type", "BPE"},
                      {"dropout", nullptr},
                      {"unk_token", unk},
                      {"continuing_subword_prefix", nullptr},
                      {"end_of_word_suffix", nullptr},
                      {"fuse_unk", !byte_level_},
                      {"byte_fallback", !byte_level_},
                      {"ignore_merges", ignore_merges_},
                      {"vocab", vocab},
                      {"merges", merges_json(merge_rank_)}}}};
  return dump_json(out);
}

}  // namespace fsdp_trainer
