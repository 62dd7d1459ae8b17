// Hugging Face directories (formats/hf_format.h), checked by Python's own libraries: a GPT and a
// Llama (tied and untied, with and without GPT's q/k/v bias) exported from 2 or 3 ranks; Python
// `safetensors` finds every tensor equal to ours under its own mapping, `transformers` loads the
// directory without missing or unexpected weights and computes our logits within 1e-5
// (tests/python/check_hf.py). The way back: the export and a model written by transformers'
// save_pretrained load on other numbers of ranks than wrote them, to the same parameters
// (bitwise) and logits. Configs our models cannot represent are refused naming the field.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <type_traits>

#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/fsdp.h>
#include <nlohmann/json.hpp>

#include "gpt.h"
#include "harness/command.h"
#include "harness/errors.h"
#include "harness/files.h"
#include "harness/multiprocess.h"
#include "harness/sharding.h"
#include "hf_format.h"
#include "llama.h"

namespace {

namespace fs = std::filesystem;
using fsdp_models::GPT;
using fsdp_models::GPTConfig;
using fsdp_models::Llama;
using fsdp_models::LlamaConfig;
using fsdp_models::ModelInit;

// Values for every parameter, norms and biases included (an initialised model has constant
// ones, which would hide a mix-up), depending only on the name.
torch::Tensor random_global(const std::string& name, at::IntArrayRef shape) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(std::hash<std::string>{}(name));
  return torch::randn(shape, gen) * 0.3;
}

void fill_random(torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  for (auto& s : fsdp::param_shards(model)) {
    auto full = random_global(s.name, s.global_shape);
    s.shard.copy_(fsdp::test::rows_held(full, s));
  }
}

GPTConfig gpt_config(const std::string& variant) {
  auto c = GPTConfig::preset("gpt2-test");  // 22 wide, 2 heads, vocab 67
  c.tie_embeddings = variant != "untied";
  c.attn_bias = variant != "untied";  // the untied one also lacks the q/k/v bias
  return c;
}

LlamaConfig llama_config(const std::string& variant) {
  auto c = LlamaConfig::preset("llama-test");  // 44 wide, 2 query heads, 1 k/v head
  c.tie_embeddings = variant == "tied";
  c.rope_theta = 500.0;  // not the default: config.json must carry it
  return c;
}

// A model of FAMILY / VARIANT, sharded over `pg` (or whole without one).
struct AnyModel {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::function<void(const std::string&, fsdp::ProcessGroup&, const fsdp_models::ExportOptions&)>
      save;
  std::function<void(const std::string&)> load;
};

// Sharded over `pg` unless it is null.
template <typename Model, typename Config, typename Parallelize>
AnyModel wrap(const Config& cfg, const std::shared_ptr<fsdp::ProcessGroup>& pg,
              Parallelize parallelize) {
  Model model(cfg, ModelInit().seed(1));
  if (pg)
    parallelize(model, fsdp::FullyShardOptions(pg));
  AnyModel m;
  m.module = model.ptr();
  m.forward = [model](const torch::Tensor& x) mutable { return fsdp::forward(model, x); };
  m.save = [model](const std::string& dir, fsdp::ProcessGroup& g,
                   const fsdp_models::ExportOptions& o) mutable {
    if constexpr (std::is_same_v<Model, Llama>)
      fsdp_models::save_hf(dir, model, g, /*skip_adapters=*/false, o);
    else
      fsdp_models::save_hf(dir, model, g, o);
  };
  m.load = [model](const std::string& dir) mutable { fsdp_models::load_hf(dir, model); };
  return m;
}

AnyModel make_model(const std::string& family, const std::string& variant,
                    const std::shared_ptr<fsdp::ProcessGroup>& pg) {
  if (family == "gpt") {
    return wrap<GPT>(gpt_config(variant), pg, [](GPT& m, const fsdp::FullyShardOptions& o) {
      fsdp_models::parallelize_gpt(m, o);
    });
  }
  return wrap<Llama>(llama_config(variant), pg, [](Llama& m, const fsdp::FullyShardOptions& o) {
    fsdp_models::parallelize_llama(m, o);
  });
}

torch::Tensor fixed_input(int64_t vocab) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(99);
  return torch::randint(vocab, {2, 11}, gen);
}

FSDP_WORKER(hf_export) {
  auto pg = fsdp::init_process_group();
  auto m = make_model(ctx.env("FAMILY"), ctx.env("VARIANT"), pg);
  fill_random(*m.module);
  fsdp_models::ExportOptions o;
  if (ctx.env("DTYPE") == "bf16")
    o.dtype = torch::kBFloat16;
  else if (ctx.env("DTYPE") == "fp16")
    o.dtype = torch::kFloat16;
  o.shard_bytes = static_cast<int64_t>(ctx.env_double("SHARD_BYTES", 0));
  m.save(ctx.env("DIR"), *pg, o);
  return 0;
}

// Loads DIR and compares with REFERENCE's logits on its input_ids (within TOLERANCE) and, with
// SAME_PARAMS=1, every parameter with random_global (bitwise).
FSDP_WORKER(hf_load) {
  auto pg = fsdp::init_process_group();
  auto m = make_model(ctx.env("FAMILY"), ctx.env("VARIANT"), pg);
  m.load(ctx.env("DIR"));
  if (ctx.env("SAME_PARAMS") == "1") {
    for (auto& s : fsdp::param_shards(*m.module)) {
      auto full = random_global(s.name, s.global_shape);
      if (ctx.env("DTYPE") == "bf16")  // stored rounded: read back as the rounded values
        full = full.to(torch::kBFloat16).to(torch::kFloat32);
      WORKER_CHECK(torch::equal(s.shard, full.narrow(0, s.row_begin, s.rows))) << s.name;
    }
  }
  fsdp::safetensors::Reader reference(ctx.env("REFERENCE"));
  torch::NoGradGuard no_grad;
  auto logits = m.forward(reference.read("input_ids"));
  const double diff = (logits - reference.read("logits")).abs().max().item<double>();
  const double tolerance =
      ctx.env_double("TOLERANCE", 0) *
      (ctx.env("DTYPE") == "bf16" ? reference.read("logits").abs().max().item<double>() : 1.0);
  WORKER_CHECK(diff <= tolerance) << "logits differ by " << diff;
  if (pg->rank() == 0)
    std::printf("logits max |diff| %.3g\n", diff);
  return 0;
}

// Loading transformers' directories runs Python beside the ranks: a longer timeout.
fsdp::test::RunOptions env(std::vector<std::pair<std::string, std::string>> vars) {
  auto o = fsdp::test::with_env(std::move(vars));
  o.timeout = std::chrono::seconds(120);
  return o;
}

std::string python(const std::string& args) {
  return std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR + "/tests/python/check_hf.py " + args;
}

// The model in one process (no FSDP): its parameters under our names, an input and its logits.
void write_reference(const std::string& family, const std::string& variant,
                     const std::string& path) {
  auto m = make_model(family, variant, nullptr);
  fill_random(*m.module);
  const int64_t vocab =
      family == "gpt" ? gpt_config(variant).vocab_size : llama_config(variant).vocab_size;
  auto ids = fixed_input(vocab);
  torch::Tensor logits;
  {
    torch::NoGradGuard no_grad;
    logits = m.forward(ids);
  }
  std::map<std::string, torch::Tensor> tensors{{"input_ids", ids}, {"logits", logits}};
  for (const auto& p : m.module->named_parameters())
    tensors[p.key()] = p.value().detach();
  std::vector<fsdp::safetensors::TensorSpec> specs;
  for (const auto& [name, t] : tensors)
    specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  fsdp::safetensors::Writer w(path, specs);
  for (const auto& [name, t] : tensors)
    w.write(name, t);
  w.finish();
}

// Exported from `ranks` ranks, checked by Python, loaded back on another number of ranks (the
// shards of the file and of the ranks fall differently). One Python process checks the export
// and writes transformers' own directories (torch and transformers are imported once).
void export_and_check(const std::string& family, const std::string& variant, int ranks) {
  const auto root = fsdp::test::fresh_dir("hf-" + family + "-" + variant);
  const auto dir = (root / "hf").string(), ours = (root / "ours.safetensors").string();
  write_reference(family, variant, ours);
  EXPECT_WORKERS_OK(fsdp::test::run_workers(
      "hf_export", ranks, env({{"FAMILY", family}, {"VARIANT", variant}, {"DIR", dir}})));
  ASSERT_TRUE(fs::exists(fs::path(dir) / "config.json"));
  EXPECT_FALSE(fs::exists(dir + ".tmp"));
  // A directory written by transformers itself (save_pretrained, from our config.json) must
  // load and compute transformers' logits. transformers' GPT-2 has a q/k/v bias and ours has
  // none: a directory whose bias is not zero is refused, one whose bias is zero loads.
  const auto theirs = (root / "theirs").string(), logits = (root / "theirs.safetensors").string();
  const auto biased = (root / "biased").string(),
             biased_logits = (root / "biased.safetensors").string();
  const bool qkv_bias = family != "gpt" || gpt_config(variant).attn_bias;
  std::string commands = "export " + dir + " " + ours;
  if (qkv_bias) {
    commands += " + make " + theirs + " " + dir + " 7 " + logits;
  } else {
    commands += " + make " + biased + " " + dir + " 7 " + biased_logits;
    commands += " + make " + theirs + " " + dir + " 7 " + logits + " --zero-qkv-bias";
  }
  const auto py = fsdp::test::run_command(python(commands));
  ASSERT_EQ(py.code, 0) << py.output;
  std::printf("%s", py.output.c_str());
  EXPECT_WORKERS_OK(fsdp::test::run_workers("hf_load", ranks == 2 ? 3 : 2,
                                            env({{"FAMILY", family},
                                                 {"VARIANT", variant},
                                                 {"DIR", dir},
                                                 {"REFERENCE", ours},
                                                 {"SAME_PARAMS", "1"},
                                                 {"TOLERANCE", "1e-6"}})));
  if (!qkv_bias) {
    auto refused = fsdp::test::run_workers("hf_load", 2,
                                           env({{"FAMILY", family},
                                                {"VARIANT", variant},
                                                {"DIR", biased},
                                                {"REFERENCE", biased_logits}}));
    EXPECT_FALSE(refused.ok());
    EXPECT_NE(refused.outputs[0].find("tensor 'transformer.h.0.attn.c_attn.bias' is not zero"),
              std::string::npos)
        << refused.describe();
  }
  EXPECT_WORKERS_OK(fsdp::test::run_workers("hf_load", 3,
                                            env({{"FAMILY", family},
                                                 {"VARIANT", variant},
                                                 {"DIR", theirs},
                                                 {"REFERENCE", logits},
                                                 {"TOLERANCE", "1e-5"}})));
  fs::remove_all(root);
}

TEST(HuggingFace, GptTiedExportedFromThreeRanks) {
  export_and_check("gpt", "tied", 3);
}

TEST(HuggingFace, GptUntiedWithoutQkvBiasFromTwoRanks) {
  export_and_check("gpt", "untied", 2);
}

TEST(HuggingFace, LlamaUntiedFromThreeRanks) {
  export_and_check("llama", "untied", 3);
}

TEST(HuggingFace, LlamaTiedFromTwoRanks) {
  export_and_check("llama", "tied", 2);
}

// checkpoint.export_dtype = bf16 and checkpoint.export_shard_mb: the weights stored rounded to
// bf16 in several files with their index, as save_pretrained(max_shard_size) writes them;
// Python finds each tensor in the file the index names, equal bitwise to ours rounded, and
// transformers loads the directory; we load it back on 3 ranks to the rounded values.
TEST(HuggingFace, Bf16ShardedExportsLoadInTransformersAndBack) {
  const auto root = fsdp::test::fresh_dir("hf-bf16");
  const std::vector<std::string> families{"gpt", "llama"};
  std::string commands;  // one Python process checks both families' exports
  for (const auto& family : families) {
    SCOPED_TRACE(family);
    const auto dir = (root / family).string(), ours = (root / (family + ".safetensors")).string();
    write_reference(family, "tied", ours);
    EXPECT_WORKERS_OK(fsdp::test::run_workers("hf_export", 2,
                                              env({{"FAMILY", family},
                                                   {"VARIANT", "tied"},
                                                   {"DIR", dir},
                                                   {"DTYPE", "bf16"},
                                                   {"SHARD_BYTES", "8000"}})));
    const auto index = nlohmann::json::parse(
        fsdp::test::file_bytes(fs::path(dir) / "model.safetensors.index.json"));
    std::set<std::string> files;
    for (const auto& [tensor, file] : index["weight_map"].items())
      files.insert(file.get<std::string>());
    EXPECT_GE(files.size(), 3u);
    for (const auto& f : files) {  // at most 8,000 bytes, unless one tensor is larger
      fsdp::safetensors::Reader r((fs::path(dir) / f).string());
      uint64_t bytes = 0;
      for (const auto& t : r.header().tensors) {
        bytes += t.end - t.begin;
        EXPECT_EQ(t.dtype, torch::kBFloat16) << f << " " << t.name;
      }
      EXPECT_TRUE(bytes <= 8000 || r.header().tensors.size() == 1) << f << ": " << bytes;
    }
    EXPECT_FALSE(fs::exists(fs::path(dir) / "model.safetensors"));
    commands += (commands.empty() ? "export " : " + export ") + dir + " " + ours;
  }
  const auto py = fsdp::test::run_command(python(commands));
  EXPECT_EQ(py.code, 0) << py.output;
  std::printf("%s", py.output.c_str());
  for (const auto& family : families) {
    SCOPED_TRACE(family);
    EXPECT_WORKERS_OK(
        fsdp::test::run_workers("hf_load", 3,
                                env({{"FAMILY", family},
                                     {"VARIANT", "tied"},
                                     {"DIR", (root / family).string()},
                                     {"REFERENCE", (root / (family + ".safetensors")).string()},
                                     {"SAME_PARAMS", "1"},
                                     {"DTYPE", "bf16"},
                                     {"TOLERANCE", "0.03"}})));
  }
  fs::remove_all(root);
}

TEST(HuggingFace, ConfigsOurModelsCannotRepresentAreRefusedNamingTheField) {
  const std::string llama = fsdp_models::hf_config_json(llama_config("untied"));
  auto with = [](std::string json, const std::string& from, const std::string& to) {
    const auto at = json.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return json.replace(at, from.size(), to);
  };
  auto llama_error = [](const std::string& json) {
    return fsdp::test::error_of(
        [&] { fsdp_models::llama_config_from_hf(json, "dir/config.json"); });
  };
  // It parses back to the config it was written from.
  const auto back = fsdp_models::llama_config_from_hf(llama, "config.json");
  EXPECT_EQ(back.dim, 44);
  EXPECT_EQ(back.n_kv_heads, 1);
  EXPECT_EQ(back.rope_theta, 500.0);
  EXPECT_EQ(llama_error(with(llama, "\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"")),
            "dir/config.json: 'hidden_act' must be 'silu'");
  EXPECT_EQ(llama_error(with(llama, "\"attention_bias\": false", "\"attention_bias\": true")),
            "dir/config.json: biases on the projections ('attention_bias', 'mlp_bias') are not "
            "supported");
  EXPECT_EQ(llama_error(with(llama, "\"rope_type\": \"default\"", "\"rope_type\": \"yarn\"")),
            "dir/config.json: RoPE type 'yarn' is not supported (only 'default')");
  EXPECT_EQ(llama_error(with(llama, "\"hidden_size\": 44", "\"hidden_size\": -44")),
            "dir/config.json: 'hidden_size' is not a positive integer");
  EXPECT_EQ(llama_error(with(llama, "\"vocab_size\": 67", "\"vocab_size\": \"67\"")),
            "dir/config.json: 'vocab_size' is not a positive integer");
  EXPECT_EQ(llama_error("[1, 2]"), "dir/config.json: not a JSON object");
  EXPECT_NE(llama_error("{\"model_type\": \"llama\",").find("not valid JSON"), std::string::npos);

  const std::string gpt = fsdp_models::hf_config_json(gpt_config("tied"));
  auto gpt_error = [](const std::string& json) {
    return fsdp::test::error_of([&] { fsdp_models::gpt_config_from_hf(json, "c.json"); });
  };
  EXPECT_EQ(gpt_error(with(gpt, "\"gelu_pytorch_tanh\"", "\"relu\"")),
            "c.json: 'activation_function' is 'relu' (supported: gelu_new, gelu_pytorch_tanh)");
  EXPECT_EQ(gpt_error(with(gpt, "\"n_inner\": null", "\"n_inner\": 50")),
            "c.json: 'n_inner' must be 4 * n_embd (our MLP's width)");
  EXPECT_EQ(gpt_error(with(gpt, "\"model_type\": \"gpt2\"", "\"model_type\": \"bert\"")),
            "c.json: 'model_type' is not 'gpt2'");
  // 'architectures' and 'model_type' must describe one model.
  EXPECT_EQ(gpt_error(with(gpt, "\"GPT2LMHeadModel\"", "\"LlamaForCausalLM\"")),
            "c.json: 'architectures' names 'LlamaForCausalLM' but 'model_type' is 'gpt2' (whose "
            "class is GPT2LMHeadModel)");
  EXPECT_EQ(llama_error(with(llama, "\"LlamaForCausalLM\"", "\"MistralForCausalLM\"")),
            "dir/config.json: 'architectures' names 'MistralForCausalLM' but 'model_type' is "
            "'llama' (whose class is LlamaForCausalLM)");
  EXPECT_EQ(llama_error(with(llama, "[\n    \"LlamaForCausalLM\"\n  ]", "7")),
            "dir/config.json: 'architectures' is not a list");

  // A directory whose config.json differs from the model it is loaded into: the field named.
  const auto root = fsdp::test::fresh_dir("hf-mismatch");
  EXPECT_WORKERS_OK(fsdp::test::run_workers(
      "hf_export", 2,
      env({{"FAMILY", "gpt"}, {"VARIANT", "tied"}, {"DIR", (root / "hf").string()}})));
  auto cfg = gpt_config("tied");
  cfg.n_embd = 24;
  GPT other(cfg, ModelInit().seed(1));
  const auto mismatch =
      fsdp::test::error_of([&] { fsdp_models::load_hf((root / "hf").string(), other); });
  EXPECT_EQ(mismatch,
            (root / "hf" / "config.json").string() + ": 'n_embd' is 22, the model's is 24");
  // A config.json that is no regular file is refused by name, unread: a link to /dev/zero
  // (which used to be read until memory ran out), a FIFO (which blocked), a directory.
  const auto config = root / "hf" / "config.json";
  for (const std::string kind : {"devzero", "fifo", "directory"}) {
    fs::remove_all(config);
    if (kind == "devzero")
      fs::create_symlink("/dev/zero", config);
    else if (kind == "fifo")
      ASSERT_EQ(::mkfifo(config.c_str(), 0600), 0);
    else
      fs::create_directory(config);
    const auto msg =
        fsdp::test::error_of([&] { fsdp_models::load_hf((root / "hf").string(), other); });
    EXPECT_EQ(msg.rfind(config.string() + ": not a regular file (", 0), 0u) << kind << ": " << msg;
  }
  // Nor one larger than any config.json (a sparse 20 GB file).
  fs::remove_all(config);
  { std::ofstream(config) << ""; }
  fs::resize_file(config, uint64_t{20} << 30);
  const auto huge =
      fsdp::test::error_of([&] { fsdp_models::load_hf((root / "hf").string(), other); });
  EXPECT_NE(huge.find(config.string() + ": 21474836480 bytes, more than the"), std::string::npos)
      << huge;
  fs::remove_all(root);
}

}  // namespace
