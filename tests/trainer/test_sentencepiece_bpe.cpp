// SentencePiece-style BPE read from a Hugging Face tokenizer.json (trainer/text/bpe_tokenizer.h):
// the family of Llama 2, Mistral and TinyLlama, and of the tokenizer our pretraining exports
// write. Three references:
// - SentencePiece itself: our trained tokenizer written as tokenizer.json and read back encodes
//   every line of the shipped corpora to SentencePiece's ids (no Python);
// - the `tokenizers` library, for the ways such files put the word-boundary U+2581 (Llama 2's
//   Prepend normalizer, Metaspace's always / first / never, with and without split): ids of
//   text with special tokens in it, and decoded text;
// - transformers' apply_chat_template with Mistral's template: a conversation's ids, and the
//   answer tokens it marks as targets.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "data/instruct_data.h"
#include "data/pretrained_model.h"
#include "gguf.h"
#include "harness/command.h"
#include "harness/files.h"
#include "text/bpe_tokenizer.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "tokenizer_samples.h"

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using fsdp_trainer::BpeTokenizer;

std::string run(const std::string& cmd) {
  const auto r = fsdp::test::run_command(cmd);
  EXPECT_EQ(r.code, 0) << cmd << "\n" << r.output;
  return r.output;
}

// Our SentencePiece tokenizer trained on the KJV, as tokenizer.json (trained once per size).
const fsdp_trainer::Tokenizer& trained(int vocab) {
  static std::map<int, fsdp_trainer::Tokenizer> cache;
  auto it = cache.find(vocab);
  if (it == cache.end())
    it = cache
             .emplace(vocab, fsdp_trainer::train_tokenizer(fsdp_trainer::load_corpus("kjv"), vocab,
                                                           "", 1234))
             .first;
  return it->second;
}

// Our SentencePiece tokenizer as a GGUF file's "llama" tokenizer metadata, as llama.cpp's
// converter writes it: pieces, scores, token types (1 normal, 2 unknown, 3 control, 6 byte).
std::map<std::string, fsdp_models::gguf::Value> gguf_metadata(const fsdp_trainer::Tokenizer& sp,
                                                              bool add_space_prefix) {
  using fsdp_models::gguf::Value;
  std::vector<Value> tokens, scores, types;
  for (int id = 0; id < sp.vocab_size(); ++id) {
    tokens.push_back(Value{sp.piece(id)});
    scores.push_back(Value{static_cast<double>(sp.score(id))});
    const int64_t type = sp.is_unknown(id) ? 2 : sp.is_control(id) ? 3 : sp.is_byte(id) ? 6 : 1;
    types.push_back(Value{type});
  }
  return {{"tokenizer.ggml.model", Value{std::string("llama")}},
          {"tokenizer.ggml.tokens", Value{tokens}},
          {"tokenizer.ggml.scores", Value{scores}},
          {"tokenizer.ggml.token_type", Value{types}},
          {"tokenizer.ggml.bos_token_id", Value{int64_t{sp.bos_id()}}},
          {"tokenizer.ggml.eos_token_id", Value{int64_t{sp.eos_id()}}},
          {"tokenizer.ggml.unknown_token_id", Value{int64_t{sp.unk_id()}}},
          {"tokenizer.ggml.add_space_prefix", Value{add_space_prefix}}};
}

// SentencePiece's BPE as stated, naively (quadratic): of the adjacent pairs whose concatenation
// is a normal piece, merge the one whose piece scores highest, the leftmost on ties; characters
// outside the vocabulary are their bytes' tokens. `text` has its spaces as U+2581 already.
std::vector<int64_t> naive_sentencepiece(
    const std::string& text, const std::map<std::string, fsdp_models::gguf::Value>& md) {
  const auto& tokens = md.at("tokenizer.ggml.tokens").as_array("");
  const auto& scores = md.at("tokenizer.ggml.scores").as_array("");
  const auto& types = md.at("tokenizer.ggml.token_type").as_array("");
  std::map<std::string, std::pair<int64_t, double>> normal;  // piece -> id, score
  std::map<std::string, int64_t> bytes;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const auto& t = tokens[i].as_string("");
    if (types[i].as_int("") == 1)
      normal[t] = {static_cast<int64_t>(i), scores[i].as_double("")};
    else if (types[i].as_int("") == 6)
      bytes[t] = static_cast<int64_t>(i);
  }
  std::vector<std::string> sym;
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    const size_t n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    const auto ch = text.substr(i, n);
    if (normal.count(ch)) {
      sym.push_back(ch);
    } else {
      for (const char b : ch) {
        char hex[8];
        std::snprintf(hex, sizeof hex, "<0x%02X>", static_cast<unsigned char>(b));
        sym.push_back(hex);
      }
    }
    i += n;
  }
  for (;;) {
    int best = -1;
    double best_score = 0;
    for (size_t k = 0; k + 1 < sym.size(); ++k) {
      auto it = normal.find(sym[k] + sym[k + 1]);
      if (it != normal.end() && (best < 0 || it->second.second > best_score)) {
        best = static_cast<int>(k);
        best_score = it->second.second;
      }
    }
    if (best < 0)
      break;
    sym[best] += sym[best + 1];
    sym.erase(sym.begin() + best + 1);
  }
  std::vector<int64_t> ids;
  for (const auto& x : sym)
    ids.push_back(normal.count(x) ? normal.at(x).first : bytes.at(x));
  return ids;
}

// The ways a SentencePiece-style tokenizer.json puts U+2581 in front of text, applied to ours.
std::map<std::string, Json> variants(const Json& ours) {
  const std::string space = "\xE2\x96\x81";
  const Json replace = {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", space}};
  const Json prepend = {{"type", "Prepend"}, {"prepend", space}};
  auto decoder = [&](bool strip) {
    Json d = Json::array({{{"type", "Replace"}, {"pattern", {{"String", space}}}, {"content", " "}},
                          {{"type", "ByteFallback"}},
                          {{"type", "Fuse"}}});
    if (strip)
      d.push_back({{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}});
    return Json{{"type", "Sequence"}, {"decoders", d}};
  };
  auto metaspace = [&](const char* scheme, bool split) {
    Json j = ours;
    j["normalizer"] = nullptr;
    j["pre_tokenizer"] = {{"type", "Metaspace"},
                          {"replacement", space},
                          {"prepend_scheme", scheme},
                          {"split", split}};
    j["decoder"] = decoder(std::string(scheme) != "never");
    return j;
  };
  std::map<std::string, Json> out;
  out["as-written"] = ours;
  Json legacy = ours;  // Llama 2's and Mistral's files
  legacy["normalizer"] = {{"type", "Sequence"}, {"normalizers", Json::array({prepend, replace})}};
  legacy["decoder"] = decoder(true);
  out["legacy"] = legacy;
  out["metaspace-first"] = metaspace("first", false);
  out["metaspace-always"] = metaspace("always", false);
  out["metaspace-always-split"] = metaspace("always", true);
  out["metaspace-never-split"] = metaspace("never", true);
  Json metaspace_decoder = metaspace("first", false);  // the Metaspace decoder
  metaspace_decoder["decoder"] = {
      {"type", "Sequence"},
      {"decoders",
       Json::array(
           {{{"type", "ByteFallback"}},
            {{"type", "Metaspace"}, {"replacement", space}, {"prepend_scheme", "first"}}})}};
  out["metaspace-decoder"] = metaspace_decoder;
  // A GGUF "llama" tokenizer with llama.cpp's space prefix, written as tokenizer.json.
  out["from-gguf"] = Json::parse(
      BpeTokenizer::from_gguf_metadata(gguf_metadata(trained(2048), true), "gguf").to_hf_json());
  return out;
}

}  // namespace

// Our tokenizer.json read back encodes as SentencePiece does: every line of the corpora, a
// 2,000-byte multi-line text, at two vocabulary sizes; decoding gives the text back; and the
// tokenizer written again by to_hf_json reads back to the same encoder.
TEST(SentencePieceBpe, ReadsOurTokenizerJsonAsSentencePieceEncodes) {
  const auto corpus = fsdp::test::tokenizer_corpus();
  auto texts = fsdp::test::split_lines(corpus);
  texts.push_back(corpus.substr(0, 2000));
  for (const int vocab : {512, 2048}) {
    SCOPED_TRACE(vocab);
    const auto& sp = trained(vocab);
    const auto tok = BpeTokenizer::from_hf_json(sp.to_hf_json(), "ours", "<s>", "</s>");
    const auto again = BpeTokenizer::from_hf_json(tok.to_hf_json(), "again", "<s>", "</s>");
    EXPECT_FALSE(tok.byte_level());
    EXPECT_EQ(tok.vocab_size(), vocab);
    EXPECT_EQ(tok.bos_id(), sp.bos_id());
    EXPECT_EQ(tok.eos_id(), sp.eos_id());
    size_t same = 0, decoded = 0, rewritten = 0;
    std::string first;  // the first text that differs
    for (const auto& text : texts) {
      const auto ids = sp.encode(text);
      const auto ours = tok.encode_plain(text);
      const bool a = std::vector<int64_t>(ids.begin(), ids.end()) == ours;
      const bool b = tok.decode(ours) == text;
      const bool c = again.encode_plain(text) == ours;
      same += a;
      decoded += b;
      rewritten += c;
      if (!(a && b && c) && first.empty())
        first = text;
    }
    EXPECT_EQ(first, "");
    EXPECT_EQ(same, texts.size());
    EXPECT_EQ(decoded, texts.size());
    EXPECT_EQ(rewritten, texts.size());
    // A run of byte tokens that is not UTF-8 (a text cut inside a character) decodes as the
    // ByteFallback decoder writes it, one U+FFFD per token, in both tokenizers.
    const std::vector<int> cut = {3 + 0xE2, 3 + 0x0D,
                                  static_cast<int>(tok.encode_plain("a").at(0))};
    ASSERT_EQ(sp.piece(cut[0]), "<0xE2>");
    ASSERT_EQ(sp.piece(cut[1]), "<0x0D>");
    EXPECT_EQ(sp.decode_for_display(cut),
              "\xEF\xBF\xBD\xEF\xBF\xBD"
              "a");
    EXPECT_EQ(tok.decode(std::vector<int64_t>(cut.begin(), cut.end())),
              "\xEF\xBF\xBD\xEF\xBF\xBD"
              "a");
    std::cout << "vocab " << vocab << ": " << same << "/" << texts.size()
              << " texts encode to SentencePiece's ids\n";
  }
}

// Seven ways of putting the word-boundary U+2581 (and a GGUF "llama" tokenizer written as
// tokenizer.json), compared with the `tokenizers` library on the
// corpora's lines and on text around special tokens, where they differ: the ids of encode
// (special tokens matched) and decode's text.
TEST(SentencePieceBpe, PrefixSchemesEncodeAndDecodeAsTheTokenizersLibrary) {
  fsdp::test::TempDir dir;
  auto texts = fsdp::test::split_lines(fsdp::test::tokenizer_corpus());
  for (const char* t :
       {"<s>hello</s> hello", " leading", "  two leading", "a<s></s>b", "<s>", "</s> after",
        "before </s>", "<s>[INST] What is it? [/INST]It is.</s>[INST] And? [/INST]", "x\n y",
        "\xE2\x96\x81literal", " \xE2\x96\x81 mixed", "", " ", "<unk> unknown"})
    texts.emplace_back(t);
  const auto ours = Json::parse(trained(2048).to_hf_json());
  const auto cases_path = dir.path() + "/cases.jsonl";
  std::ofstream cases(cases_path, std::ios::binary);
  for (const auto& [name, json] : variants(ours)) {
    const auto path = dir.path() + "/" + name + ".json";
    std::ofstream(path, std::ios::binary) << json.dump();
    const auto tok = BpeTokenizer::from_hf_json(json.dump(), path, "<s>", "</s>");
    const auto again = BpeTokenizer::from_hf_json(tok.to_hf_json(), path, "<s>", "</s>");
    for (const auto& text : texts) {
      const auto ids = tok.encode(text);
      EXPECT_EQ(again.encode(text), ids) << name << " written back: '" << text << "'";
      cases
          << Json{{"file", path}, {"text", text}, {"ids", ids}, {"decoded", tok.decode(ids)}}.dump()
          << "\n";
    }
  }
  cases.close();
  const auto out = run(std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR +
                       "/tests/python/check_sp_variants.py tokenizers " + cases_path);
  std::cout << out;
  const auto n = std::to_string(texts.size());
  for (const auto& [name, json] : variants(ours))
    EXPECT_NE(out.find(name + ".json: encoded " + n + "/" + n + " decoded " + n + "/" + n),
              std::string::npos)
        << name << "\n"
        << out;
}

// Mistral's chat template with a Llama-2-style tokenizer.json in a model directory: the
// conversation's ids are transformers' apply_chat_template(tokenize=True), and the targets are
// the answers' tokens and their eos.
TEST(SentencePieceBpe, MistralChatsEncodeAsTransformersApplyChatTemplate) {
  fsdp::test::TempDir dir;
  auto json = variants(Json::parse(trained(2048).to_hf_json())).at("legacy");
  std::ofstream(dir.path() + "/tokenizer.json", std::ios::binary) << json.dump();
  // PreTrainedTokenizerFast uses tokenizer.json as it is; transformers 5's LlamaTokenizer class
  // would replace its pre-tokenization with its own (docs/trainer.md).
  const Json config = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                       {"bos_token", "<s>"},
                       {"eos_token", "</s>"},
                       {"unk_token", "<unk>"},
                       {"chat_template", fsdp::test::mistral_template(" + ' ' ")}};
  std::ofstream(dir.path() + "/tokenizer_config.json") << config.dump();
  const auto tok = fsdp_trainer::pretrained_tokenizer(dir.path());
  const fsdp_trainer::ChatTemplate tmpl(fsdp_trainer::pretrained_chat_template(dir.path()),
                                        dir.path(), "<s>", "</s>");
  ASSERT_EQ(tmpl.family(), fsdp_trainer::ChatFamily::kMistral);
  const std::vector<std::vector<fsdp_trainer::ChatMessage>> chats = {
      {{"user", "Who wrote the book?"}, {"assistant", "Moses, by tradition."}},
      {{"user", " In the beginning "},
       {"assistant", "God created the heaven and the earth."},
       {"user", "And then?\n"},
       {"assistant", "  Light, on the first day.\n"}},
      {{"user", "a \xE2\x96\x81 b\xE2\x96\x81"}, {"assistant", "\xE2\x96\x81x \xE2\x96\x81"}},
      {{"user", "Say [/INST] or [INST]"},
       {"assistant", "[INST] no [/INST] \xC3\xA9t\xC3\xA9 \xF0\x9F\x9A\x80"}}};
  const auto cases_path = dir.path() + "/chats.jsonl";
  {
    std::ofstream cases(cases_path, std::ios::binary);
    for (const auto& chat : chats) {
      const auto ex = fsdp_trainer::encode_conversation(chat, tok, tmpl);
      Json messages = Json::array();
      std::string answers;
      for (const auto& m : chat) {
        messages.push_back({{"role", m.role}, {"content", m.content}});
        if (m.role == "assistant")
          answers += m.content + "</s>";
      }
      // A U+2581 of the text is a space to the tokens, as in `tokenizers`.
      std::string spaced;
      for (size_t i = 0; i < answers.size(); ++i) {
        if (answers.compare(i, 3, "\xE2\x96\x81") == 0) {
          spaced += ' ';
          i += 2;
        } else {
          spaced += answers[i];
        }
      }
      // The target tokens spell the answers and their eos (with the word-boundary space the
      // tokenizer put before the first, here inside the [/INST] line: none).
      std::string target;
      for (size_t i = 0; i < ex.ids.size(); ++i)
        if (ex.target[i])
          target += tok.token_bytes(ex.ids[i]);
      EXPECT_EQ(target, spaced);
      cases << Json{{"messages", messages}, {"ids", ex.ids}}.dump() << "\n";
    }
  }
  const auto out = run(std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR +
                       "/tests/python/check_sp_variants.py chat " + dir.path() + " " + cases_path);
  std::cout << out;
  const auto n = std::to_string(chats.size());
  EXPECT_NE(out.find("chats " + n + "/" + n + " equal"), std::string::npos) << out;
}

// What a SentencePiece-style file may do that we do not implement is refused, naming the file
// and the part.
TEST(SentencePieceBpe, FilesOutsideWhatIsImplementedAreRefusedByName) {
  const auto ours = Json::parse(trained(512).to_hf_json());
  const std::string space = "\xE2\x96\x81";
  struct Case {
    const char* name;
    std::function<void(Json&)> edit;
    const char* message;
  };
  const std::vector<Case> cases{
      {"NFKC",
       [](Json& j) {
         j["normalizer"] = {{"type", "NFKC"}};
       },
       "normalizer NFKC"},
      {"replace other", [&](Json& j) { j["normalizer"]["content"] = "_"; }, "normalizer Replace"},
      {"nested sequences",
       [&](Json& j) {
         j["normalizer"] = {
             {"type", "Sequence"},
             {"normalizers",
              Json::array({{{"type", "Sequence"}, {"normalizers", Json::array()}}})}};
       },
       "normalizer Sequence"},
      {"no space replacement", [](Json& j) { j["normalizer"] = nullptr; }, "are not made U+2581"},
      {"byte level",
       [](Json& j) {
         j["pre_tokenizer"] = {{"type", "ByteLevel"}};
       },
       "pre_tokenizer ByteLevel is not supported with byte_fallback"},
      {"metaspace replacement",
       [](Json& j) {
         j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "_"}};
       },
       "Metaspace's replacement"},
      {"prepend scheme",
       [&](Json& j) {
         j["pre_tokenizer"] = {
             {"type", "Metaspace"}, {"replacement", space}, {"prepend_scheme", "sometimes"}};
       },
       "prepend_scheme"},
      {"no decoder", [](Json& j) { j["decoder"] = nullptr; }, "no decoder"},
      {"decoder without bytes", [](Json& j) { j["decoder"]["decoders"].erase(1); },
       "decoder [Replace, Fuse] is not supported"},
      {"strip before fuse",
       [](Json& j) {
         auto& d = j["decoder"]["decoders"];
         d = Json::array(
             {d[0], d[1], {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}, d[2]});
       },
       "decoder [Replace, ByteFallback, Strip, Fuse]"},
      {"normalized added token", [](Json& j) { j["added_tokens"][1]["normalized"] = true; },
       "added token '<s>' is normalized"},
      {"merge making an added token",
       [](Json& j) {  // the first merge's result, also an added token
         auto made = j["model"]["merges"][0].get<std::string>();
         made.erase(made.find(' '), 1);
         j["added_tokens"].push_back({{"id", j["model"]["vocab"][made]},
                                      {"content", made},
                                      {"special", true},
                                      {"normalized", false}});
       },
       "is not of two ordinary vocabulary tokens making a third"},
      {"other decoder",
       [](Json& j) {
         j["decoder"] = {{"type", "WordPiece"}};
       },
       "decoder WordPiece"},
      {"strip two",
       [](Json& j) {
         j["decoder"]["decoders"].push_back(
             {{"type", "Strip"}, {"content", " "}, {"start", 2}, {"stop", 0}});
       },
       "decoder Strip"},
      {"unknown unk", [](Json& j) { j["model"]["unk_token"] = "<nothing>"; },
       "unk_token '<nothing>'"},
  };
  for (const auto& c : cases) {
    auto j = ours;
    c.edit(j);
    std::string e;
    try {
      BpeTokenizer::from_hf_json(j.dump(), "t/tokenizer.json", "<s>", "</s>");
    } catch (const std::exception& ex) {
      e = ex.what();
    }
    EXPECT_NE(e.find(c.message), std::string::npos) << c.name << ": '" << e << "'";
    EXPECT_NE(e.find("t/tokenizer.json"), std::string::npos) << c.name << ": '" << e << "'";
  }
  // A text needing a byte the vocabulary lacks is refused, naming the byte.
  auto j = ours;
  j["model"]["vocab"].erase("<0xE2>");
  for (auto& [text, id] : j["model"]["vocab"].items())  // ids stay 0..n-1 without the gap
    if (id.get<int64_t>() > 3 + 0xE2)
      id = id.get<int64_t>() - 1;
  Json merges = Json::array();
  for (const auto& m : j["model"]["merges"]) {
    const auto s = m.get<std::string>();
    if (s.find("\xE2") == std::string::npos)
      merges.push_back(m);
  }
  j["model"]["merges"] = merges;
  const auto tok = BpeTokenizer::from_hf_json(j.dump(), "t/tokenizer.json", "<s>", "</s>");
  EXPECT_FALSE(tok.can_encode_byte(0xE2));
  EXPECT_TRUE(tok.can_encode_byte(0xE3));
  EXPECT_EQ(tok.decode(tok.encode_plain("abc")), "abc");
  try {
    tok.encode_plain("\xE2\x82\xAC");  // the euro sign, not in the KJV's vocabulary
    ADD_FAILURE() << "encoded without a token for 0xE2";
  } catch (const fsdp_trainer::UnencodableByte& e) {
    EXPECT_EQ(e.byte, 0xE2);
  }
}

// A GGUF file's "llama" tokenizer (SentencePiece: pieces with scores, no merges): without a space
// prefix it encodes every corpus line to SentencePiece's own ids; with llama.cpp's prefix (its
// default) as the Llama-2-style tokenizer.json, special tokens inside the text included, whose
// ids the test above checks against the `tokenizers` library.
TEST(SentencePieceBpe, GgufLlamaTokenizerEncodesAsSentencePiece) {
  auto texts = fsdp::test::split_lines(fsdp::test::tokenizer_corpus());
  for (const int vocab : {512, 2048}) {
    SCOPED_TRACE(vocab);
    const auto& sp = trained(vocab);
    const auto plain = BpeTokenizer::from_gguf_metadata(gguf_metadata(sp, false), "plain.gguf");
    const auto prefixed = BpeTokenizer::from_gguf_metadata(gguf_metadata(sp, true), "p.gguf");
    const auto legacy = BpeTokenizer::from_hf_json(
        variants(Json::parse(sp.to_hf_json())).at("legacy").dump(), "legacy", "<s>", "</s>");
    EXPECT_EQ(plain.bos_id(), sp.bos_id());
    EXPECT_EQ(plain.eos_id(), sp.eos_id());
    size_t same = 0, decoded = 0, as_legacy = 0, legacy_decoded = 0;
    for (const auto& text : texts) {
      const auto ids = sp.encode(text);
      const auto ours = plain.encode_plain(text);
      same += std::vector<int64_t>(ids.begin(), ids.end()) == ours;
      decoded += plain.decode(ours) == text;
      const auto with_specials = text + "</s><s> " + text;
      const auto p = prefixed.encode(with_specials);
      as_legacy += p == legacy.encode(with_specials);
      legacy_decoded += prefixed.decode(p) == legacy.decode(p);
    }
    EXPECT_EQ(same, texts.size());
    EXPECT_EQ(decoded, texts.size());
    EXPECT_EQ(as_legacy, texts.size());
    EXPECT_EQ(legacy_decoded, texts.size());
    std::cout << "vocab " << vocab << ": GGUF llama tokenizer " << same << "/" << texts.size()
              << " as SentencePiece, " << as_legacy << "/" << texts.size()
              << " with its prefix as the legacy tokenizer.json\n";
  }
  // Pieces of equal score (converters that know no scores write -1000 for every piece) merge
  // leftmost first, as SentencePiece's rule says: compared with the rule applied naively, with
  // the real scores and with all of them equal.
  for (const bool tied : {false, true}) {
    auto md = gguf_metadata(trained(512), false);
    if (tied)
      for (auto& v : std::get<std::vector<fsdp_models::gguf::Value>>(md["tokenizer.ggml.scores"].v))
        v = fsdp_models::gguf::Value{-1000.0};
    const auto tok = BpeTokenizer::from_gguf_metadata(md, "tied.gguf");
    size_t same = 0;
    for (const auto& text : texts) {
      std::string spaced;
      for (const char c : text)
        spaced += c == ' ' ? std::string("\xE2\x96\x81") : std::string(1, c);
      same += tok.encode_plain(text) == naive_sentencepiece(spaced, md);
    }
    EXPECT_EQ(same, texts.size()) << (tied ? "tied scores" : "real scores");
    std::cout << (tied ? "all scores equal: " : "real scores: ") << same << "/" << texts.size()
              << " as SentencePiece's rule applied naively\n";
  }
  // Bad metadata is refused naming the key.
  auto md = gguf_metadata(trained(512), true);
  md["tokenizer.ggml.scores"] = fsdp_models::gguf::Value{std::vector<fsdp_models::gguf::Value>{}};
  try {
    BpeTokenizer::from_gguf_metadata(md, "bad.gguf");
    ADD_FAILURE() << "scores of another length were read";
  } catch (const fsdp_models::gguf::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("bad.gguf: tokenizer.ggml.scores has 0 entries"),
              std::string::npos)
        << e.what();
  }
}
