// Tokenizer::to_hf_json: the trainer's SentencePiece BPE written as a Hugging Face tokenizer.json,
// so that an export of a pretraining run loads with AutoTokenizer and encodes to our ids. Written
// for the models train_tokenizer makes (BPE, byte fallback, no normalization); the text handling
// is checked before writing, the model type cannot be (see below).
//
// What makes the two encoders agree (tests/trainer/test_trainer.cpp compares them through the
// `tokenizers` library on the shipped corpora):
// - Text: our models are trained with normalization "identity", no dummy prefix and no whitespace
//   clean-up, so SentencePiece only writes each space as U+2581; the tokenizer.json normalizer
//   does exactly that (Replace " " -> "▁"), and the decoder undoes it.
// - Words: SentencePiece splits the text before a run of U+2581, and no learned piece crosses
//   such a point (a piece holds U+2581 only at its start, or only U+2581). So BPE over the whole
//   text merges exactly what BPE per word merges: no pre-tokenizer is needed (as transformers'
//   own Llama conversion).
// - Merges: SentencePiece merges, among adjacent pairs whose concatenation is a piece, the one
//   whose piece has the highest score (leftmost first on ties). `tokenizers` merges the pair of
//   lowest rank. Ranking every split (left, right) of a piece by that piece's score gives the
//   same order; pieces of equal score would be ordered by id, and our BPE models give every
//   learned piece its own score.
// - Characters outside the vocabulary become their UTF-8 bytes <0xXX> in both (byte fallback).
// One difference remains: `tokenizers` matches the special pieces (<unk>, <s>, </s>) where text
// spells them, SentencePiece never does; text holding them gets other ids (the corpora do not).
#include <sentencepiece_processor.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tokenizer.h"
#include "utf8.h"

namespace fsdp_trainer {
namespace {

using Json = nlohmann::ordered_json;

}  // namespace

namespace {

// Refuses a model whose text handling the export does not reproduce.
void check_exportable(const sentencepiece::SentencePieceProcessor& sp, const std::string& path) {
  // SentencePiece's public header keeps the model's settings (a protobuf) opaque, so the
  // text handling is checked by what it does: spaces, a tab and a ligature (which NFKC would
  // rewrite) must come back from the pieces exactly, spaces as U+2581.
  const std::string probe = "  a  \t\xEF\xAC\x81";
  std::vector<std::string> pieces;
  if (!sp.Encode(probe, &pieces).ok() || pieces.empty() || sp.unk_id() < 0)
    throw std::runtime_error(path + ": cannot be written as tokenizer.json: it does not encode");
  std::string seen;
  for (const auto& p : pieces) {
    if (p.size() == 6 && p.rfind("<0x", 0) == 0 && p.back() == '>')
      seen += static_cast<char>(std::stoi(p.substr(3, 2), nullptr, 16));
    else
      seen += p;
  }
  if (seen !=
      "\xE2\x96\x81\xE2\x96\x81"
      "a"
      "\xE2\x96\x81\xE2\x96\x81\t\xEF\xAC\x81")
    throw std::runtime_error(path +
                             ": cannot be written as tokenizer.json: it was trained with "
                             "text normalization (a dummy prefix, whitespace clean-up or NFKC), "
                             "which the export does not reproduce");
}

// The merges that make each normal piece from two others, strongest first, as "left right".
Json merges_json(const sentencepiece::SentencePieceProcessor& sp,
                 const std::unordered_map<std::string, int>& normal, const std::string& path) {
  struct Merge {
    float score;
    int id;
    std::string left, right;
  };
  std::vector<Merge> merges;
  for (const auto& [piece, id] : normal) {
    for (size_t k = utf8_lead_length(piece[0]); k < piece.size();
         k += utf8_lead_length(static_cast<unsigned char>(piece[k]))) {
      auto left = piece.substr(0, k), right = piece.substr(k);
      if (normal.count(left) && normal.count(right))
        merges.push_back({sp.GetScore(id), id, std::move(left), std::move(right)});
    }
  }
  std::sort(merges.begin(), merges.end(), [](const Merge& a, const Merge& b) {
    if (a.score != b.score)
      return a.score > b.score;
    if (a.id != b.id)
      return a.id < b.id;
    return a.left.size() < b.left.size();
  });
  // "left right" strings, the form every `tokenizers` version reads (pieces hold no ASCII
  // space: SentencePiece writes it as U+2581).
  Json merge_list = Json::array();
  for (const auto& m : merges) {
    if (m.left.find(' ') != std::string::npos || m.right.find(' ') != std::string::npos)
      throw std::runtime_error(path + ": the piece '" + m.left + m.right +
                               "' holds a space, which tokenizer.json merges cannot");
    merge_list.push_back(m.left + " " + m.right);
  }

  return merge_list;
}

}  // namespace

std::string Tokenizer::to_hf_json() const {
  const auto& sp = this->sp();
  const int n = sp.GetPieceSize();
  check_exportable(sp, path_);
  Json vocab = Json::object();
  Json added = Json::array();
  std::unordered_map<std::string, int> normal;  // the pieces merges may use and produce
  for (int id = 0; id < n; ++id) {
    const auto piece = sp.IdToPiece(id);
    if (vocab.contains(piece))
      throw std::runtime_error(path_ + ": the piece '" + piece + "' has two ids");
    vocab[piece] = id;
    if (sp.IsControl(id) || sp.IsUnknown(id))
      added.push_back({{"id", id},
                       {"content", piece},
                       {"single_word", false},
                       {"lstrip", false},
                       {"rstrip", false},
                       {"normalized", false},
                       {"special", true}});
    else if (!sp.IsByte(id) && !sp.IsUnused(id))
      normal.emplace(piece, id);
  }

  Json merge_list = merges_json(sp, normal, path_);

  const std::string space = "\xE2\x96\x81";  // U+2581, SentencePiece's visible space
  Json j;
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  j["added_tokens"] = std::move(added);
  j["normalizer"] = {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", space}};
  j["pre_tokenizer"] = nullptr;
  j["post_processor"] = nullptr;
  j["decoder"] = {{"type", "Sequence"},
                  {"decoders",
                   {{{"type", "Replace"}, {"pattern", {{"String", space}}}, {"content", " "}},
                    {{"type", "ByteFallback"}},
                    {{"type", "Fuse"}}}}};
  j["model"] = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", sp.IdToPiece(sp.unk_id())},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", true},
                {"byte_fallback", true},
                {"vocab", std::move(vocab)},
                {"merges", std::move(merge_list)}};
  try {
    return j.dump(2) + "\n";
  } catch (const Json::exception&) {
    throw std::runtime_error(path_ + ": a piece is not valid UTF-8");
  }
}

}  // namespace fsdp_trainer

namespace fsdp_trainer {

std::map<std::string, std::string> tokenizer_export_files(const Tokenizer& tok,
                                                          int64_t model_max_length) {
  auto text = [&](int id) { return id >= 0 ? Json(tok.piece(id)) : Json(); };
  Json config = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                 {"bos_token", text(tok.bos_id())},
                 {"eos_token", text(tok.eos_id())},
                 {"unk_token", text(tok.unk_id())},
                 // Decoding gives the text back as it was (no " ." -> "." clean-up).
                 {"clean_up_tokenization_spaces", false},
                 {"model_max_length", model_max_length}};
  Json generation = {{"bos_token_id", tok.bos_id() >= 0 ? Json(tok.bos_id()) : Json()},
                     {"eos_token_id", tok.eos_id() >= 0 ? Json(tok.eos_id()) : Json()}};
  return {{"tokenizer.json", tok.to_hf_json()},
          {"tokenizer_config.json", config.dump(2) + "\n"},
          {"generation_config.json", generation.dump(2) + "\n"}};
}

}  // namespace fsdp_trainer
