// GGUF reading (formats/gguf.h): SmolLM2-135M-Instruct's real file dequantised bitwise as
// llama.cpp's own Python reader does it (tests/python/check_gguf.py), row ranges as the whole,
// and hostile files (every truncation, bad counts, offsets, types) refused with a FormatError
// naming the problem, never a crash.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "data/corpus.h"
#include "data/pretrained_model.h"
#include "gguf.h"
#include "gguf_llama.h"
#include "harness/command.h"
#include "harness/files.h"
#include "harness/multiprocess.h"
#include "llama.h"
#include "parallelize.h"
#include "text/bpe_tokenizer.h"
#include "text/chat_template.h"
#include "unfilled_llama.h"

namespace {

namespace fs = std::filesystem;
using fsdp_models::gguf::File;
using fsdp_models::gguf::FormatError;

// The command's output; a failed command fails the test.
std::string run(const std::string& cmd) {
  const auto r = fsdp::test::run_command(cmd);
  EXPECT_EQ(r.code, 0) << cmd << "\n" << r.output;
  return r.output;
}

torch::Tensor read_floats(const std::string& path, at::IntArrayRef shape) {
  auto bytes = fsdp::test::file_bytes(path);
  auto t = torch::empty(shape, torch::kFloat32);
  EXPECT_EQ(bytes.size(), static_cast<size_t>(t.numel() * 4)) << path;
  if (bytes.size() == static_cast<size_t>(t.numel() * 4))
    std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

TEST(Gguf, SmolLM2DequantisesAsLlamaCppsReader) {
  fsdp::test::TempDir dir;
  const std::vector<std::string> names{"token_embd.weight",      "blk.0.attn_q.weight",
                                       "blk.0.attn_k.weight",    "blk.29.ffn_down.weight",
                                       "blk.0.attn_norm.weight", "output_norm.weight"};
  std::string cmd = std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR +
                    "/tests/python/check_gguf.py smollm2 " + dir.path();
  for (const auto& n : names)
    cmd += " " + n;
  const auto out = run(cmd);
  ASSERT_EQ(out.rfind("FILE ", 0), 0u) << out;
  const auto path = out.substr(5, out.find('\n') - 5);
  File f(path);
  EXPECT_EQ(f.header().version, 3u);
  EXPECT_EQ(f.tensors().size(), 272u);
  EXPECT_EQ(f.value("general.architecture").as_string("arch"), "llama");
  EXPECT_EQ(f.value("llama.block_count").as_int("blocks"), 30);
  EXPECT_EQ(f.value("llama.attention.head_count_kv").as_int("kv"), 3);
  EXPECT_EQ(f.value("tokenizer.ggml.tokens").as_array("tokens").size(), 49152u);
  EXPECT_EQ(f.value("tokenizer.ggml.merges").as_array("merges").size(), 48900u);
  for (const auto& n : names) {
    const auto& info = f.tensor(n);
    auto ours = f.read(n);
    auto ref = read_floats(dir.path() + "/" + n + ".bin", ours.sizes());
    EXPECT_TRUE(torch::equal(ours, ref)) << n << " (" << to_string(info.type) << "): max diff "
                                         << (ours - ref).abs().max().item<float>();
    // A row range is the same rows of the whole.
    const int64_t rows = info.shape[0];
    if (info.shape.size() > 1) {
      auto part = f.read(n, rows / 3, rows / 2 - rows / 3);
      EXPECT_TRUE(torch::equal(part, ours.narrow(0, rows / 3, rows / 2 - rows / 3))) << n;
    }
  }
  EXPECT_EQ(f.tensor("token_embd.weight").shape, (std::vector<int64_t>{49152, 576}));
  EXPECT_EQ(f.tensor("blk.0.attn_k.weight").shape, (std::vector<int64_t>{192, 576}));
}

// Our Llama on SmolLM2's weights gives transformers' logits: the shapes, the config (tied
// embeddings, GQA 9/3 heads, RoPE theta 1e5) and the q/k row layout are all as claimed. The
// logits are those of the file's first 2 blocks (tests/python/smollm2_reference.py's cut by
// scripts/cut_gguf.py: the same tensors and bytes, block_count 2): what this checks (each
// tensor's name and shape, the q/k permutation, a block's arithmetic, the head, sharded
// loading) is the same in every block, and 2 blocks are a quarter of the parameters. All 30
// are checked by SmolLM2ChatsAsTransformersDoes, whose greedy answer needs the whole model.
TEST(Gguf, SmolLM2LogitsEqualTransformers) {
  fsdp::test::TempDir dir;
  const std::vector<int64_t> ids{1, 504, 3458, 282, 4649, 314, 28, 2, 9690, 198, 11};
  // The cut's path (made on first use; no torch imported), then the reference started: it
  // imports torch and transformers and computes while we do.
  const auto where = run(std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR +
                         "/tests/python/smollm2_reference.py gguf smollm2:2");
  ASSERT_EQ(where.rfind("FILE ", 0), 0u) << where;
  std::string cmd = std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR +
                    "/tests/python/check_gguf.py smollm2:2 " + dir.path() + " --logits";
  for (auto i : ids)
    cmd += " " + std::to_string(i);
  fsdp::test::StartedCommand reference(cmd);
  // The whole file's config (its header alone is read)...
  const auto whole =
      fsdp_models::llama_config_from_gguf(File(fsdp_trainer::resolve_model_file("smollm2")));
  EXPECT_EQ(whole.n_layers, 30);
  EXPECT_EQ(whole.dim, 576);
  EXPECT_EQ(whole.n_heads, 9);
  EXPECT_EQ(whole.n_kv_heads, 3);
  EXPECT_EQ(whole.vocab_size, 49152);
  EXPECT_TRUE(whole.tie_embeddings);
  EXPECT_EQ(whole.rope_theta, 100000.0);
  // ...is the cut's but for the block count.
  File f(where.substr(5, where.find('\n') - 5));
  auto cfg = fsdp_models::llama_config_from_gguf(f);
  EXPECT_EQ(cfg.n_layers, 2);
  EXPECT_EQ(cfg.dim, whole.dim);
  EXPECT_EQ(cfg.n_heads, whole.n_heads);
  EXPECT_EQ(cfg.n_kv_heads, whole.n_kv_heads);
  EXPECT_EQ(cfg.ffn_hidden_dim, whole.ffn_hidden_dim);
  EXPECT_EQ(cfg.vocab_size, whole.vocab_size);
  EXPECT_EQ(cfg.tie_embeddings, whole.tie_embeddings);
  EXPECT_EQ(cfg.rope_theta, whole.rope_theta);
  EXPECT_EQ(cfg.norm_eps, whole.norm_eps);
  cfg.max_seq_len = 64;  // the tables for 8192 positions are not needed here
  auto model = fsdp::test::unfilled_llama(cfg);
  fsdp_models::load_gguf(f, model);
  torch::NoGradGuard no_grad;
  auto ours = model->forward(torch::tensor(ids).view({1, -1}))[0];

  // Sharded over 2 and 3 ranks, each rank reading only its rows: the same logits.
  std::vector<torch::Tensor> sharded;
  for (int world : {2, 3}) {
    EXPECT_WORKERS_OK(fsdp::test::run_workers(
        "gguf_sharded_logits", world,
        fsdp::test::with_env({{"GGUF", f.path()}, {"OUT", dir.path() + "/sharded.bin"}})));
    sharded.push_back(read_floats(dir.path() + "/sharded.bin", ours.sizes()));
  }

  const auto [code, out] = reference.finish();
  ASSERT_EQ(code, 0) << cmd << "\n" << out;
  auto ref = read_floats(dir.path() + "/logits.bin", ours.sizes());
  const double diff = (ours - ref).abs().max().item<double>();
  const double scale = ref.abs().max().item<double>();
  std::cout << "SmolLM2 (first 2 blocks) logits, ours vs transformers: max |diff| " << diff
            << " (largest |logit| " << scale << "); argmax equal at every position: "
            << torch::equal(ours.argmax(-1), ref.argmax(-1)) << "\n";
  // fp32 both sides, the same dequantised weights; summation order differences. The bound is
  // the one the 30 blocks met (6.8e-5 of 36.4), kept for 2: a wrong mapping or permutation is
  // off by whole units.
  EXPECT_LT(diff, 1e-4 * scale);
  EXPECT_TRUE(torch::equal(ours.argmax(-1), ref.argmax(-1)));

  for (size_t i = 0; i < sharded.size(); ++i) {
    const double d = (sharded[i] - ours).abs().max().item<double>();
    std::cout << i + 2 << " ranks: logits vs one process, max |diff| " << d << "\n";
    EXPECT_LT(d, 1e-5 * scale) << i + 2 << " ranks";
  }
}

FSDP_WORKER(gguf_sharded_logits) {
  auto pg = fsdp::init_process_group();
  File f(ctx.env("GGUF"));
  auto cfg = fsdp_models::llama_config_from_gguf(f);
  cfg.max_seq_len = 64;
  auto model = fsdp::test::unfilled_sharded_llama(cfg, pg);
  fsdp_models::load_gguf(f, model);
  torch::NoGradGuard no_grad;
  const std::vector<int64_t> ids{1, 504, 3458, 282, 4649, 314, 28, 2, 9690, 198, 11};
  auto logits = fsdp::forward(model, torch::tensor(ids).view({1, -1}))[0].contiguous();
  if (ctx.rank == 0)
    std::ofstream(ctx.env("OUT"), std::ios::binary)
        .write(static_cast<const char*>(logits.data_ptr()), logits.numel() * 4);
  return 0;
}

// SmolLM2's tokenizer read from the GGUF metadata gives the ids transformers' tokenizer (built
// from the same file) gives, on KJV verses, fortunes and a multilingual, emoji and chat-template
// sample; decoding gives the text back.
TEST(Gguf, SmolLM2TokenizerEqualsTransformers) {
  fsdp::test::TempDir dir;
  std::string corpus = fsdp::test::first_lines(fsdp_trainer::load_corpus("kjv"), 400);
  corpus += fsdp::test::first_lines(fsdp_trainer::load_corpus("fortunes"), 400);
  corpus +=
      "Voilà l'été, déjà! Größe und Übermaß. "
      "Привет, мир. "
      "こんにちは世界。你好，世界。"
      "مرحبا بالعالم\n"
      "Emoji: 🚀🔥👍🏽 👨‍👩‍👧 — "
      "“quotes” ‘single’ … "
      "naïve café x² ½ ∑ ∞\n"
      "Numbers 1234567890 3.14159 -42 1e-5 0x1F and   many    spaces\t\ttabs   \n"
      "Code: for (int i = 0; i < n; ++i) { sum += a[i]; } // it's can't we'll they've I'm I'd\n"
      "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n"
      "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|endoftext|>\n"
      "   leading spaces and trailing   ";
  const auto text_path = dir.path() + "/corpus.txt";
  std::ofstream(text_path, std::ios::binary) << corpus;
  const auto out =
      run(std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR + "/tests/python/check_tokenizer.py " +
          text_path + " " + dir.path() + "/ids.json");
  const auto at = out.find("FILE ");
  ASSERT_NE(at, std::string::npos) << out;
  File f(out.substr(at + 5, out.find('\n', at) - at - 5));
  auto tok = fsdp_trainer::BpeTokenizer::from_gguf(f);
  EXPECT_EQ(tok.vocab_size(), 49152);
  const auto ref = nlohmann::json::parse(fsdp::test::file_bytes(dir.path() + "/ids.json"));
  const auto lines = fsdp::test::split_lines(corpus);
  ASSERT_EQ(ref.size(), lines.size());
  size_t same = 0, tokens = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    const auto ours = tok.encode(lines[i]);
    const auto theirs = ref[i].get<std::vector<int64_t>>();
    tokens += theirs.size();
    if (ours == theirs) {
      ++same;
    } else {
      ADD_FAILURE() << "line " << i << ": '" << lines[i] << "'";
    }
    EXPECT_EQ(tok.decode(ours), lines[i]) << "line " << i;
  }
  std::cout << "tokenizer: " << same << " of " << lines.size() << " lines (" << tokens
            << " tokens) equal to transformers'\n";
}

// The chat template read from the file renders a conversation as transformers renders it, and
// greedy generation with our Llama gives transformers' tokens: a coherent answer.
TEST(Gguf, SmolLM2ChatsAsTransformersDoes) {
  fsdp::test::TempDir dir;
  const int new_tokens = 10;  // "The capital of France is Paris.<|im_end|>"
  const nlohmann::json request = {
      {"messages",
       {{{"role", "user"}, {"content", "What is the capital of France? Answer in one sentence."}}}},
      {"new_tokens", new_tokens}};
  std::ofstream(dir.path() + "/in.json") << request.dump();
  // The reference runs (imports, loads, generates) while we read the file and load the model.
  const auto cmd = std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR +
                   "/tests/python/check_chat.py " + dir.path() + "/in.json " + dir.path() +
                   "/out.json";
  fsdp::test::StartedCommand reference(cmd);
  File f(fsdp_trainer::resolve_model_file("smollm2"));
  fsdp_trainer::ChatTemplate chat(
      f.value("tokenizer.chat_template").as_string("tokenizer.chat_template"), f.path());
  const auto text =
      chat.render({{"user", "What is the capital of France? Answer in one sentence."}},
                  /*add_generation_prompt=*/true);
  auto tok = fsdp_trainer::BpeTokenizer::from_gguf(f);
  auto ids = tok.encode(text);
  // The whole model (30 blocks): a 2-block cut answers nonsense, and this is the test that
  // every block of the file loads as transformers reads it.
  auto cfg = fsdp_models::llama_config_from_gguf(f);
  EXPECT_EQ(cfg.n_layers, 30);
  cfg.max_seq_len = 128;
  auto model = fsdp::test::unfilled_llama(cfg);
  fsdp_models::load_gguf(f, model);

  const auto [code, out] = reference.finish();
  ASSERT_EQ(code, 0) << cmd << "\n" << out;
  const auto ref = nlohmann::json::parse(fsdp::test::file_bytes(dir.path() + "/out.json"));
  EXPECT_EQ(ref["file"].get<std::string>(), f.path());
  EXPECT_EQ(text, ref["text"].get<std::string>());
  EXPECT_EQ(ids, ref["prompt_ids"].get<std::vector<int64_t>>());
  torch::NoGradGuard no_grad;
  // Greedy generation, checked in one forward pass: a causal model's logits at position i
  // depend on tokens 0..i only, so our greedy continuation is transformers' generated ids g
  // exactly when the argmax after prompt + g[0..k) is g[k] for every k, and one pass over
  // prompt + g[0..n-1) gives all n at once (one pass per token took 10x as long).
  const auto theirs = ref["generated_ids"].get<std::vector<int64_t>>();
  ASSERT_EQ(theirs.size(), static_cast<size_t>(new_tokens));
  auto input = ids;
  input.insert(input.end(), theirs.begin(), theirs.end() - 1);
  auto logits = model->forward(torch::tensor(input).view({1, -1}))[0];
  auto next = logits.narrow(0, static_cast<int64_t>(ids.size()) - 1, new_tokens).argmax(-1);
  const std::vector<int64_t> generated(next.data_ptr<int64_t>(),
                                       next.data_ptr<int64_t>() + new_tokens);
  std::cout << "SmolLM2 answers: " << tok.decode(generated) << "\n";
  EXPECT_EQ(generated, theirs) << "transformers: " << tok.decode(theirs);
  EXPECT_NE(tok.decode(generated).find("Paris"), std::string::npos);
}

TEST(Gguf, NonChatMLTemplatesAreRefused) {
  EXPECT_THROW(fsdp_trainer::ChatTemplate("{{ bos_token }}{% for m in messages %}[INST] "
                                          "{{ m['content'] }} [/INST]{% endfor %}",
                                          "model.gguf"),
               std::runtime_error);
}

// --- Hostile files -----------------------------------------------------------------------

// A small valid GGUF image written by hand: metadata of every kind, three tensors (F32, Q8_0,
// Q4_0) with known values.
struct Writer {
  std::string b;
  template <class T>
  void put(T v) {
    b.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  void str(const std::string& s) {
    put<uint64_t>(s.size());
    b += s;
  }
};

std::string small_image() {
  Writer w;
  w.b = "GGUF";
  w.put<uint32_t>(3);
  w.put<uint64_t>(3);  // tensors
  w.put<uint64_t>(4);  // key/values
  w.str("general.architecture");
  w.put<uint32_t>(8);
  w.str("llama");
  w.str("test.count");
  w.put<uint32_t>(4);
  w.put<uint32_t>(7);
  w.str("test.flag");
  w.put<uint32_t>(7);
  w.put<uint8_t>(1);
  w.str("test.list");
  w.put<uint32_t>(9);
  w.put<uint32_t>(8);
  w.put<uint64_t>(2);
  w.str("a");
  w.str("bc");
  // Tensor infos: a [2, 3] F32 (ne = 3, 2), a [1, 32] Q8_0, a [2, 32] Q4_0.
  auto info = [&](const std::string& name, std::vector<uint64_t> ne, uint32_t type, uint64_t off) {
    w.str(name);
    w.put<uint32_t>(ne.size());
    for (auto d : ne)
      w.put<uint64_t>(d);
    w.put<uint32_t>(type);
    w.put<uint64_t>(off);
  };
  info("f32", {3, 2}, 0, 0);
  info("q8", {32, 1}, 8, 32);
  info("q4", {32, 2}, 2, 96);
  while (w.b.size() % 32)
    w.b.push_back('\0');
  // f32: 0..5
  for (int i = 0; i < 6; ++i)
    w.put<float>(static_cast<float>(i));
  while (w.b.size() % 32)
    w.b.push_back('\0');
  // q8: d = 0.5 (fp16 0x3800), values -16..15
  w.put<uint16_t>(0x3800);
  for (int j = 0; j < 32; ++j)
    w.put<int8_t>(static_cast<int8_t>(j - 16));
  while (w.b.size() % 32)
    w.b.push_back('\0');
  // q4: two blocks, d = 2 (0x4000) and d = 1 (0x3c00); byte j = (j + 1) << 4 | j
  for (uint16_t d : {uint16_t{0x4000}, uint16_t{0x3c00}}) {
    w.put<uint16_t>(d);
    for (int j = 0; j < 16; ++j)
      w.put<uint8_t>(static_cast<uint8_t>(((15 - j) << 4) | j));
  }
  return w.b;
}

std::string write(const fsdp::test::TempDir& dir, const std::string& name,
                  const std::string& bytes) {
  const auto path = dir.path() + "/" + name;
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

std::string error_of(const std::string& path) {
  try {
    File f(path);
    for (const auto& t : f.tensors())
      f.read(t.name);
  } catch (const FormatError& e) {
    return e.what();
  }
  return "";
}

TEST(Gguf, AHandWrittenFileReadsBack) {
  fsdp::test::TempDir dir;
  File f(write(dir, "ok.gguf", small_image()));
  EXPECT_EQ(f.value("test.count").as_int("count"), 7);
  EXPECT_TRUE(f.value("test.flag").as_bool("flag"));
  EXPECT_EQ(f.value("test.list").as_array("list").at(1).as_string("s"), "bc");
  EXPECT_TRUE(torch::equal(f.read("f32"), torch::arange(6, torch::kFloat32).view({2, 3})));
  EXPECT_TRUE(
      torch::equal(f.read("q8"), ((torch::arange(32, torch::kFloat32) - 16) * 0.5).view({1, 32})));
  auto q4 = f.read("q4");
  // Element j: low nibble of byte j (= j) - 8; element j + 16: high nibble (= 15 - j) - 8.
  auto lo = torch::arange(16, torch::kFloat32) - 8, hi = 7 - torch::arange(16, torch::kFloat32);
  auto block = torch::cat({lo, hi});
  EXPECT_TRUE(torch::equal(q4, torch::stack({block * 2, block})));
  EXPECT_TRUE(torch::equal(f.read("q4", 1, 1), q4.narrow(0, 1, 1)));
}

TEST(Gguf, EveryTruncationIsAFormatError) {
  fsdp::test::TempDir dir;
  const auto image = small_image();
  for (size_t n = 0; n < image.size(); ++n) {
    const auto e = error_of(write(dir, "cut.gguf", image.substr(0, n)));
    EXPECT_NE(e.find("cut.gguf"), std::string::npos) << "cut at " << n << ": '" << e << "'";
  }
}

TEST(Gguf, MalformedHeadersNameTheProblem) {
  fsdp::test::TempDir dir;
  const auto good = small_image();
  struct Case {
    size_t offset;
    std::string bytes, expect;
  };
  auto u64 = [](uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); };
  auto u32 = [](uint32_t v) { return std::string(reinterpret_cast<const char*>(&v), 4); };
  // Offsets in small_image(): magic 0, version 4, tensor count 8, kv count 16, first key 24.
  const size_t first_tensor_info = good.find("f32") - 8;
  const size_t f32_type = first_tensor_info + 8 + 3 + 4 + 16;
  const size_t q8_offset = good.find("q8") + 2 + 4 + 16 + 4;
  const std::vector<Case> cases = {
      {0, "GGML", "does not start with \"GGUF\""},
      {4, u32(1), "version 1"},
      {8, u64(uint64_t{1} << 60), "tensors, more than the file can hold"},
      {16, u64(uint64_t{1} << 60), "key/value pairs, more than the file can hold"},
      {24, u64(uint64_t{1} << 62), "truncated: a metadata key"},
      {first_tensor_info + 8 + 3, u32(5), "has 5 dimensions"},
      {f32_type, u32(12), "ggml type 12, which this reader does not dequantise"},
      {q8_offset, u64(33), "not a multiple of the alignment"},
      {q8_offset, u64(0), "overlap"},
      {q8_offset, u64(1 << 20), "runs past the end of the file"},
      // The Q8_0 tensor's type patched to Q4_0: its first 18 bytes would be read as the whole.
      {q8_offset - 4, u32(2),
       "tensor 'q8' (Q4_0, 18 bytes) leaves 46 bytes unread before "
       "tensor 'q4': its type or shape does not match its data"},
  };
  for (const auto& c : cases) {
    auto bad = good;
    bad.replace(c.offset, c.bytes.size(), c.bytes);
    const auto e = error_of(write(dir, "bad.gguf", bad));
    EXPECT_NE(e.find(c.expect), std::string::npos)
        << "expected '" << c.expect << "', got '" << e << "'";
    EXPECT_NE(e.find("bad.gguf"), std::string::npos) << e;
  }
  EXPECT_NE(error_of(dir.path() + "/missing.gguf").find("cannot open"), std::string::npos);
}

// A Llama of one block (width 4, 2 heads, 1 k/v head, MLP 8, vocabulary 3), F32, whose
// metadata say `block_count` blocks and `width` wide.
std::string tiny_llama(uint64_t block_count, uint64_t width) {
  Writer w;
  w.b = "GGUF";
  w.put<uint32_t>(3);
  const std::vector<std::pair<std::string, std::vector<uint64_t>>> tensors = {
      {"token_embd.weight", {4, 3}},     {"output_norm.weight", {4}},
      {"blk.0.attn_q.weight", {4, 4}},   {"blk.0.attn_k.weight", {4, 2}},
      {"blk.0.attn_v.weight", {4, 2}},   {"blk.0.attn_output.weight", {4, 4}},
      {"blk.0.ffn_gate.weight", {4, 8}}, {"blk.0.ffn_down.weight", {8, 4}},
      {"blk.0.ffn_up.weight", {4, 8}},   {"blk.0.attn_norm.weight", {4}},
      {"blk.0.ffn_norm.weight", {4}},
  };
  w.put<uint64_t>(tensors.size());
  w.put<uint64_t>(8);
  w.str("general.architecture");
  w.put<uint32_t>(8);
  w.str("llama");
  for (const auto& [key, value] :
       std::vector<std::pair<std::string, uint64_t>>{{"llama.block_count", block_count},
                                                     {"llama.embedding_length", width},
                                                     {"llama.attention.head_count", 2},
                                                     {"llama.attention.head_count_kv", 1},
                                                     {"llama.feed_forward_length", 8},
                                                     {"llama.context_length", 16}}) {
    w.str(key);
    w.put<uint32_t>(10);  // u64
    w.put<uint64_t>(value);
  }
  w.str("llama.attention.layer_norm_rms_epsilon");
  w.put<uint32_t>(6);
  w.put<float>(1e-5f);
  uint64_t offset = 0;
  std::vector<uint64_t> sizes;
  for (const auto& [name, ne] : tensors) {
    w.str(name);
    w.put<uint32_t>(ne.size());
    uint64_t n = 1;
    for (auto d : ne)
      w.put<uint64_t>(d), n *= d;
    w.put<uint32_t>(0);  // F32
    w.put<uint64_t>(offset);
    sizes.push_back(n * 4);
    offset += (n * 4 + 31) / 32 * 32;
  }
  while (w.b.size() % 32)
    w.b.push_back('\0');
  for (auto bytes : sizes) {
    w.b.append(bytes, '\0');
    while (w.b.size() % 32)
      w.b.push_back('\0');
  }
  return w.b;
}

TEST(Gguf, MetadataAreCheckedAgainstTheTensorTableBeforeAnyModel) {
  fsdp::test::TempDir dir;
  auto config_error = [&](const std::string& image) {
    const auto path = write(dir, "tiny.gguf", image);
    try {
      File f(path);
      fsdp_models::llama_config_from_gguf(f);
    } catch (const FormatError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(config_error(tiny_llama(1, 4)), "");
  // More blocks than the file has tensors for: refused by the first missing one, before any
  // block is built (a block count of 2^40 used to allocate until memory ran out).
  for (uint64_t blocks : {uint64_t{2}, uint64_t{1} << 40}) {
    const auto e = config_error(tiny_llama(blocks, 4));
    EXPECT_NE(e.find("tiny.gguf: no tensor 'blk.1.attn_q.weight', which llama.block_count implies"),
              std::string::npos)
        << e;
  }
  // No block at all: the metadata describe no model (a LlamaConfig message, with the file).
  const auto none = config_error(tiny_llama(0, 4));
  EXPECT_NE(none.find("tiny.gguf: its llama.* metadata describe no model: LlamaConfig::n_layers "
                      "must be positive"),
            std::string::npos)
      << none;
  // A width the tensors do not have.
  const auto wide = config_error(tiny_llama(1, 8));
  EXPECT_NE(wide.find("tiny.gguf: tensor 'token_embd.weight' is [3, 4], its llama.* metadata "
                      "make it [3, 8]"),
            std::string::npos)
      << wide;
}

}  // namespace
