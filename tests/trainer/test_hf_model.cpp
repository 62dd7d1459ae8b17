// Hugging Face model directories as fine-tuning's starting point (trainer/data/pretrained_model.h):
// SmolLM2 (its first 2 blocks) saved by transformers in three safetensors files with their index
// loads the same weights, bit for bit, as its GGUF file (NF4 layers included, and sharded over 3
// ranks); its tokenizer.json encodes the shipped corpora as the `tokenizers` library does, for
// three pre-tokenizers; its chat template renders as the GGUF's. Hostile directories (an index
// naming a path outside, a tensor in the wrong file or in two, tokenizer.json variants we do not
// implement) are refused with an error naming the file and the problem.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/fsdp.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include "data/corpus.h"
#include "data/pretrained_model.h"
#include "gguf.h"
#include "gguf_llama.h"
#include "harness/command.h"
#include "harness/files.h"
#include "harness/multiprocess.h"
#include "hf_format.h"
#include "llama.h"
#include "lora.h"
#include "parallelize.h"
#include "text/bpe_tokenizer.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "tokenizer_samples.h"
#include "unfilled_llama.h"

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

std::string run(const std::string& cmd) {
  const auto r = fsdp::test::run_command(cmd);
  EXPECT_EQ(r.code, 0) << cmd << "\n" << r.output;
  return r.output;
}

// SmolLM2's first 2 blocks (tests/python/smollm2_reference.py's cut by scripts/cut_gguf.py:
// the same tensors and bytes) as a GGUF file and as that file converted by transformers and
// saved in three safetensors files, both made and cached by the Python side on first use. What
// these tests check (the names, the q/k row permutation, the NF4 encoding, rows read across
// files, the tokenizer and template files) is the same in every block, and 2 blocks are a
// quarter of the parameters.
struct Smollm2Cut {
  std::string gguf, dir;
};

Smollm2Cut sharded_cut() {
  const auto out = run(std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR +
                       "/tests/python/check_hf_dir.py sharded smollm2:2");
  auto line = [&](const std::string& tag) {
    const auto at = out.find(tag + " ");
    return at == std::string::npos
               ? std::string()
               : out.substr(at + tag.size() + 1, out.find('\n', at) - at - tag.size() - 1);
  };
  return {line("FILE"), line("DIR")};
}

// Every parameter of two models, bitwise.
void expect_same_parameters(fsdp_models::Llama& a, fsdp_models::Llama& b) {
  auto pa = a->named_parameters(), pb = b->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  size_t same = 0;
  for (const auto& p : pa) {
    const auto& q = pb[p.key()];
    if (p.value().sizes() == q.sizes() && torch::equal(p.value(), q))
      ++same;
    else
      ADD_FAILURE() << p.key() << " differs";
  }
  std::cout << same << " of " << pa.size() << " parameters bitwise equal\n";
}

TEST(HfModel, SmolLM2ShardedDirectoryLoadsAsItsGguf) {
  const auto [gguf, dir] = sharded_cut();
  ASSERT_FALSE(gguf.empty() || dir.empty());
  const auto files = fsdp_models::hf_weight_files(dir);
  // transformers' max_shard_size="20MB" on 141 MB: the embedding alone (over the limit), then
  // the blocks, the second across two files.
  EXPECT_EQ(files.size(), 3u);
  const auto from_dir = fsdp_trainer::pretrained_config(dir);
  const auto from_gguf = fsdp_trainer::pretrained_config(gguf);
  EXPECT_EQ(from_gguf.n_layers, 2);
  EXPECT_EQ(from_dir.vocab_size, from_gguf.vocab_size);
  EXPECT_EQ(from_dir.dim, from_gguf.dim);
  EXPECT_EQ(from_dir.n_layers, from_gguf.n_layers);
  EXPECT_EQ(from_dir.n_heads, from_gguf.n_heads);
  EXPECT_EQ(from_dir.n_kv_heads, from_gguf.n_kv_heads);
  EXPECT_EQ(from_dir.ffn_hidden_dim, from_gguf.ffn_hidden_dim);
  EXPECT_EQ(from_dir.rope_theta, from_gguf.rope_theta);
  EXPECT_EQ(from_dir.tie_embeddings, from_gguf.tie_embeddings);
  // GGUF stores the epsilon as float32, config.json its float64 reading: the same float32.
  EXPECT_EQ(static_cast<float>(from_dir.norm_eps), static_cast<float>(from_gguf.norm_eps));

  auto cfg = from_gguf;
  cfg.max_seq_len = 64;
  for (const bool nf4 : {false, true}) {
    auto a = fsdp::test::unfilled_llama(cfg), b = fsdp::test::unfilled_llama(cfg);
    if (nf4) {
      fsdp_models::use_nf4(*a, /*quantize=*/false);
      fsdp_models::use_nf4(*b, /*quantize=*/false);
    }
    fsdp_trainer::load_pretrained(dir, a);
    fsdp_trainer::load_pretrained(gguf, b);
    SCOPED_TRACE(nf4 ? "NF4" : "fp32");
    expect_same_parameters(a, b);
  }
  // Sharded over 3 ranks (rows not divisible by 3), each rank reading its rows across the three
  // files: the same logits as the GGUF file loaded whole.
  fsdp::test::TempDir out;
  EXPECT_WORKERS_OK(fsdp::test::run_workers(
      "hf_dir_sharded_logits", 3,
      fsdp::test::with_env({{"DIR", dir}, {"OUT", out.path() + "/logits.pt"}})));
  auto whole = fsdp::test::unfilled_llama(cfg);
  fsdp_trainer::load_pretrained(gguf, whole);
  torch::NoGradGuard no_grad;
  const std::vector<int64_t> ids{1, 504, 3458, 282, 4649, 314, 28, 2, 9690, 198, 11};
  auto ref = whole->forward(torch::tensor(ids).view({1, -1}))[0];
  torch::Tensor sharded;
  torch::load(sharded, out.path() + "/logits.pt");
  const double diff = (sharded - ref).abs().max().item<double>();
  std::cout << "3 ranks from the directory vs the GGUF in one process: logits max |diff| " << diff
            << "\n";
  EXPECT_LT(diff, 1e-5 * ref.abs().max().item<double>());
}

FSDP_WORKER(hf_dir_sharded_logits) {
  auto pg = fsdp::init_process_group();
  const auto dir = ctx.env("DIR");
  auto cfg = fsdp_trainer::pretrained_config(dir);
  cfg.max_seq_len = 64;
  auto model = fsdp::test::unfilled_sharded_llama(cfg, pg);
  fsdp_trainer::load_pretrained(dir, model);
  torch::NoGradGuard no_grad;
  const std::vector<int64_t> ids{1, 504, 3458, 282, 4649, 314, 28, 2, 9690, 198, 11};
  auto logits = fsdp::forward(model, torch::tensor(ids).view({1, -1}))[0].contiguous();
  if (ctx.rank == 0)
    torch::save(logits, ctx.env("OUT"));
  return 0;
}

// The three shipped corpora (KJV verses, fortunes, the instruction set's JSONL lines) and a
// sample of scripts, emoji, numbers, spacing, code and chat markup.
TEST(HfModel, SmolLM2TokenizerJsonEncodesAsTokenizersDoes) {
  fsdp::test::TempDir dir;
  const auto corpus = fsdp::test::tokenizer_corpus();
  const auto text_path = dir.path() + "/corpus.txt";
  std::ofstream(text_path, std::ios::binary) << corpus;
  run(std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR +
      "/tests/python/check_hf_dir.py tokenizers " + text_path + " " + dir.path());
  const auto ref = Json::parse(fsdp::test::file_bytes(dir.path() + "/ids.json"));
  const auto lines = fsdp::test::split_lines(corpus);
  const auto gguf = fsdp_trainer::pretrained_tokenizer(fsdp_trainer::resolve_model_file("smollm2"));
  for (const char* variant : {"saved", "digits", "split"}) {
    SCOPED_TRACE(variant);
    const auto path = dir.path() + "/" + variant + "/tokenizer.json";
    auto tok = fsdp_trainer::BpeTokenizer::from_hf_json(fsdp::test::file_bytes(path), path,
                                                        "<|im_start|>", "<|im_end|>");
    EXPECT_EQ(tok.vocab_size(), 49152);
    EXPECT_EQ(tok.bos_id(), 1);
    EXPECT_EQ(tok.eos_id(), 2);
    const auto& theirs = ref[variant];
    ASSERT_EQ(theirs.size(), lines.size());
    size_t same = 0, tokens = 0, as_gguf = 0;
    for (size_t i = 0; i < lines.size(); ++i) {
      const auto ours = tok.encode(lines[i]);
      const auto want = theirs[i].get<std::vector<int64_t>>();
      tokens += want.size();
      if (ours == want)
        ++same;
      else
        ADD_FAILURE() << "line " << i << ": '" << lines[i] << "'";
      as_gguf += ours == gguf.encode(lines[i]);
      EXPECT_EQ(tok.decode(ours), lines[i]) << "line " << i;
    }
    std::cout << variant << ": " << same << " of " << lines.size() << " lines (" << tokens
              << " tokens) equal to tokenizers'; " << as_gguf << " equal to the GGUF's\n";
    // The directory's own tokenizer.json is the GGUF's tokenizer; the other pre-tokenizers cut
    // digits differently, so they must differ somewhere (else the test would not see them).
    if (std::string(variant) == "saved")
      EXPECT_EQ(as_gguf, lines.size());
    else
      EXPECT_LT(as_gguf, lines.size());
  }
}

// A pretraining run's tokenizer (SentencePiece BPE with byte fallback) written as tokenizer.json:
// transformers' AutoTokenizer loads it from the files an export carries and encodes every line
// of the shipped corpora and the sample to our ids, and decodes our ids back to the line. Two
// models: a small vocabulary (most text through single characters and bytes) and the demo's.
TEST(HfModel, PretrainingTokenizerJsonEncodesAsSentencePieceDoes) {
  fsdp::test::TempDir dir;
  const auto corpus = fsdp::test::tokenizer_corpus();
  const auto lines = fsdp::test::split_lines(corpus);
  const auto kjv = fsdp_trainer::load_corpus("kjv");
  for (const int vocab : {512, 2048}) {
    SCOPED_TRACE(vocab);
    const auto tok = fsdp_trainer::train_tokenizer(kjv, vocab, "", 1234);
    const auto model_dir = dir.path() + "/v" + std::to_string(vocab);
    fs::create_directories(model_dir);
    for (const auto& [name, bytes] : fsdp_trainer::tokenizer_export_files(tok, 1 << 20))
      std::ofstream(model_dir + "/" + name, std::ios::binary) << bytes;
    const auto cases_path = model_dir + "/cases.jsonl";
    {
      std::ofstream cases(cases_path, std::ios::binary);
      for (const auto& line : lines)
        cases << Json{{"text", line}, {"ids", tok.encode(line)}}.dump() << "\n";
      // Whole multi-line texts as well (our encoder cuts them at line ends).
      cases << Json{{"text", corpus.substr(0, 2000)}, {"ids", tok.encode(corpus.substr(0, 2000))}}
                   .dump()
            << "\n";
    }
    const auto out = run(std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR +
                         "/tests/python/check_sp_tokenizer.py " + model_dir + " " + cases_path);
    std::cout << out;
    const auto n = std::to_string(lines.size() + 1);
    EXPECT_NE(out.find("encoded " + n + "/" + n + " decoded " + n + "/" + n), std::string::npos)
        << out;
    EXPECT_NE(out.find("vocab " + std::to_string(vocab) + " bos <s> eos </s> unk <unk>"),
              std::string::npos)
        << out;
  }
}

TEST(HfModel, SmolLM2DirectoryChatsAsItsGguf) {
  const auto [gguf, dir] = sharded_cut();  // the cut carries the whole file's template
  ASSERT_FALSE(gguf.empty() || dir.empty());
  fsdp_trainer::ChatTemplate a(fsdp_trainer::pretrained_chat_template(dir), dir);
  fsdp_trainer::ChatTemplate b(fsdp_trainer::pretrained_chat_template(gguf), gguf);
  const std::vector<fsdp_trainer::ChatMessage> chat{{"user", "What is the capital of France?"},
                                                    {"assistant", "Paris."},
                                                    {"user", "And of Italy?"}};
  EXPECT_EQ(a.render(chat, true), b.render(chat, true));
  EXPECT_EQ(a.default_system(), b.default_system());
  EXPECT_FALSE(a.default_system().empty());
  const auto tok = fsdp_trainer::pretrained_tokenizer(dir);
  EXPECT_EQ(tok.encode(a.render(chat, true)),
            fsdp_trainer::pretrained_tokenizer(gguf).encode(b.render(chat, true)));
}

// ---- hostile directories --------------------------------------------------------------------

// A tiny Llama saved as a Hugging Face directory in one file; the tests below rearrange it.
struct TinyDir {
  fsdp::test::TempDir tmp;
  std::string dir;
  fsdp_models::LlamaConfig cfg;
  static fsdp_models::LlamaConfig config() {
    fsdp_models::LlamaConfig c;
    c.vocab_size = 64;
    c.dim = 32;
    c.ffn_hidden_dim = 64;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.max_seq_len = 16;
    return c;
  }
  TinyDir() {
    cfg = config();
    dir = tmp.path() + "/model";
    EXPECT_WORKERS_OK(
        fsdp::test::run_workers("tiny_hf_save", 1, fsdp::test::with_env({{"DIR", dir}})));
  }
};

fsdp_models::LlamaConfig tiny_config() {
  return TinyDir::config();
}

FSDP_WORKER(tiny_hf_save) {
  auto pg = fsdp::init_process_group();
  fsdp_models::Llama model(tiny_config(), fsdp_models::ModelInit().seed(3));
  fsdp_models::save_hf(ctx.env("DIR"), model, *pg);
  return 0;
}

void write_safetensors(const std::string& path, const std::map<std::string, torch::Tensor>& ts) {
  std::vector<fsdp::safetensors::TensorSpec> specs;
  for (const auto& [name, t] : ts)
    specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  fsdp::safetensors::Writer w(path, specs, {{"format", "pt"}});
  for (const auto& [name, t] : ts)
    w.write(name, t);
  w.finish();
}

// Splits `dir`'s model.safetensors in two files named `first` and `second` (tensors of layer 1
// in the second), with an index as transformers writes it; `edit` may change the index.
void split_in_two(const std::string& dir, const std::string& second_name,
                  const std::function<void(Json&)>& edit = {}) {
  const auto single = dir + "/model.safetensors";
  fsdp::safetensors::Reader reader(single);
  std::map<std::string, torch::Tensor> a, b;
  Json map = Json::object();
  for (const auto& t : reader.header().tensors) {
    const bool second = t.name.find("layers.1.") != std::string::npos;
    (second ? b : a)[t.name] = reader.read(t.name);
    map[t.name] = second ? second_name : "model-00001-of-00002.safetensors";
  }
  write_safetensors(dir + "/model-00001-of-00002.safetensors", a);
  write_safetensors(dir + "/" + second_name, b);
  fs::remove(single);
  Json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", map}};
  if (edit)
    edit(index);
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump();
}

std::string load_error(const std::string& dir, const fsdp_models::LlamaConfig& cfg) {
  fsdp_models::Llama model(cfg);
  try {
    fsdp_models::load_hf(dir, model);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(HfModel, ShardedFilesLoadAndHostileIndexesAreRefused) {
  {
    TinyDir t;
    fsdp_models::Llama saved(t.cfg);
    fsdp_models::load_hf(t.dir, saved);
    split_in_two(t.dir, "model-00002-of-00002.safetensors");
    fsdp_models::Llama loaded(t.cfg, fsdp_models::ModelInit().seed(7));
    fsdp_models::load_hf(t.dir, loaded);
    expect_same_parameters(loaded, saved);
  }
  {  // a file name that leaves the directory
    TinyDir t;
    split_in_two(t.dir, "model-00002-of-00002.safetensors", [](Json& j) {
      j["weight_map"]["model.norm.weight"] = "../model-00001-of-00002.safetensors";
    });
    const auto e = load_error(t.dir, t.cfg);
    EXPECT_NE(e.find("not a file name inside the directory"), std::string::npos) << e;
    EXPECT_NE(e.find("model.safetensors.index.json"), std::string::npos) << e;
  }
  {  // the index places a tensor in a file that does not hold it
    TinyDir t;
    split_in_two(t.dir, "model-00002-of-00002.safetensors", [](Json& j) {
      j["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors";
    });
    const auto e = load_error(t.dir, t.cfg);
    EXPECT_NE(e.find("places tensor 'model.norm.weight'"), std::string::npos) << e;
  }
  {  // a file the index names is missing
    TinyDir t;
    split_in_two(t.dir, "model-00002-of-00002.safetensors");
    fs::remove(t.dir + "/model-00002-of-00002.safetensors");
    const auto e = load_error(t.dir, t.cfg);
    EXPECT_NE(e.find("model-00002-of-00002.safetensors, which is not in"), std::string::npos) << e;
  }
  {  // a tensor in two files
    TinyDir t;
    split_in_two(t.dir, "model-00002-of-00002.safetensors");
    fsdp::safetensors::Reader first(t.dir + "/model-00001-of-00002.safetensors");
    std::map<std::string, torch::Tensor> both;
    fsdp::safetensors::Reader second(t.dir + "/model-00002-of-00002.safetensors");
    for (const auto& e : second.header().tensors)
      both[e.name] = second.read(e.name);
    both["model.norm.weight"] = first.read("model.norm.weight");
    fs::remove(t.dir + "/model-00002-of-00002.safetensors");
    write_safetensors(t.dir + "/model-00002-of-00002.safetensors", both);
    const auto e = load_error(t.dir, t.cfg);
    EXPECT_NE(e.find("tensor 'model.norm.weight' is also in"), std::string::npos) << e;
  }
  {  // neither file
    TinyDir t;
    fs::remove(t.dir + "/model.safetensors");
    const auto e = load_error(t.dir, t.cfg);
    EXPECT_NE(e.find("neither model.safetensors nor model.safetensors.index.json"),
              std::string::npos)
        << e;
  }
}

// A small byte-level tokenizer.json: the 256 byte tokens, one merge, one added token.
Json tiny_tokenizer() {
  Json vocab = Json::object();
  // GPT-2's alphabet for the printable ASCII range is the bytes themselves; the others are
  // letters from U+0100 on. Only ASCII letters are used here.
  int id = 0;
  for (char c = 'a'; c <= 'z'; ++c)
    vocab[std::string(1, c)] = id++;
  vocab["ab"] = id++;
  Json j = {
      {"version", "1.0"},
      {"added_tokens", Json::array({{{"id", id},
                                     {"content", "<|end|>"},
                                     {"special", true},
                                     {"lstrip", false},
                                     {"rstrip", false},
                                     {"single_word", false},
                                     {"normalized", false}}})},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", Json::array({"a b"})}}}};
  return j;
}

std::string tokenizer_error(const Json& j) {
  try {
    fsdp_trainer::BpeTokenizer::from_hf_json(j.dump(), "t/tokenizer.json", "", "<|end|>");
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(HfModel, TokenizerJsonOutsideWhatIsImplementedIsRefusedByName) {
  auto ok = tiny_tokenizer();
  auto tok = fsdp_trainer::BpeTokenizer::from_hf_json(ok.dump(), "t", "", "<|end|>");
  EXPECT_EQ(tok.encode("abc<|end|>"), (std::vector<int64_t>{26, 2, 27}));
  EXPECT_EQ(tok.eos_id(), 27);
  struct Case {
    const char* name;
    std::function<void(Json&)> edit;
    const char* message;
  };
  const std::vector<Case> cases{
      {"unigram", [](Json& j) { j["model"]["type"] = "Unigram"; }, "model type 'Unigram'"},
      {"byte fallback", [](Json& j) { j["model"]["byte_fallback"] = true; }, "byte_fallback"},
      {"normalizer",
       [](Json& j) {
         j["normalizer"] = {{"type", "NFC"}};
       },
       "normalizer NFC"},
      {"metaspace",
       [](Json& j) {
         j["pre_tokenizer"] = {{"type", "Metaspace"}};
       },
       "pre_tokenizer Metaspace"},
      {"prefix space", [](Json& j) { j["pre_tokenizer"]["add_prefix_space"] = true; },
       "add_prefix_space"},
      {"split merged",
       [](Json& j) {
         j["pre_tokenizer"] = {
             {"type", "Sequence"},
             {"pretokenizers",
              {{{"type", "Split"}, {"pattern", {{"Regex", "\\d"}}}, {"behavior", "MergedWithNext"}},
               {{"type", "ByteLevel"}, {"use_regex", false}}}}};
       },
       "behavior 'MergedWithNext'"},
      {"bad regex",
       [](Json& j) {
         j["pre_tokenizer"] = {
             {"type", "Sequence"},
             {"pretokenizers",
              {{{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}},
               {{"type", "ByteLevel"}, {"use_regex", false}}}}};
       },
       "is not a regular expression"},
      {"id beyond the count", [](Json& j) { j["model"]["vocab"]["ab"] = 40; }, "outside [0, 28)"},
      {"duplicate merge", [](Json& j) { j["model"]["merges"].push_back("a b"); }, "listed twice"},
      {"hex digit class",
       [](Json& j) {
         j["pre_tokenizer"] = {
             {"type", "Sequence"},
             {"pretokenizers",
              {{{"type", "Split"}, {"pattern", {{"Regex", "\\h+"}}}, {"behavior", "Isolated"}},
               {{"type", "ByteLevel"}, {"use_regex", false}}}}};
       },
       "uses \\h"},
      {"negative id", [](Json& j) { j["model"]["vocab"]["ab"] = -1; }, "outside"},
      {"shared id", [](Json& j) { j["model"]["vocab"]["ab"] = 0; }, "share id 0"},
      {"merge out of vocabulary", [](Json& j) { j["model"]["merges"].push_back("b c"); },
       "merge 1 ('b', 'c')"},
      {"merge not a pair", [](Json& j) { j["model"]["merges"].push_back("abc"); }, "merge 1 'abc'"},
      {"lstrip", [](Json& j) { j["added_tokens"][0]["lstrip"] = true; }, "uses lstrip"},
      {"eos unknown", [](Json& j) { j["added_tokens"] = Json::array(); }, "eos token '<|end|>'"},
      {"decoder",
       [](Json& j) {
         j["decoder"] = {{"type", "Metaspace"}};
       },
       "decoder Metaspace"},
      {"not json", nullptr, "not valid JSON"},
  };
  for (const auto& c : cases) {
    std::string e;
    if (c.edit) {
      auto j = tiny_tokenizer();
      c.edit(j);
      e = tokenizer_error(j);
    } else {
      try {
        fsdp_trainer::BpeTokenizer::from_hf_json("{\"model\": ", "t/tokenizer.json", "", "");
      } catch (const std::exception& ex) {
        e = ex.what();
      }
    }
    EXPECT_NE(e.find(c.message), std::string::npos) << c.name << ": '" << e << "'";
    EXPECT_NE(e.find("t/tokenizer.json"), std::string::npos) << c.name << ": '" << e << "'";
  }
}

}  // namespace
