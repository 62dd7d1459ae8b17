// See model_factory.h.
#include "model_factory.h"

#include <fmt/core.h>

#include <filesystem>
#include <optional>

#include "gguf_llama.h"
#include "gpt.h"
#include "hf_format.h"
#include "llama.h"
#include "lora.h"
#include "peft.h"

namespace fsdp_trainer {
namespace {

template <typename C>
C preset_or_config_error(const std::string& arch, const std::string& name) {
  try {
    return C::preset(name);
  } catch (const std::exception& e) {
    throw ConfigError("'model.preset' = '" + name + "' is not a " + arch + " preset: " + e.what());
  }
}

// Deferred initialisation, for either family: the model is built on the meta device, its
// parameters become one-element placeholders, and each rank fills only its own shard (by
// parameter name, so the values are those of an eager build on any number of ranks). A preset
// far larger than one process's memory can therefore be sharded as long as its shards fit. The
// placeholders are on `device`, so the shards are created there and never cross the bus.
template <typename Model, typename Cfg, typename Parallelize>
void build_sharded(TrainModel& out, const Cfg& cfg, fsdp_models::InitScheme scheme, uint64_t seed,
                   const UnitOptions& options, int64_t checkpoint_every, torch::Device device,
                   Parallelize parallelize) {
  Model model(cfg, fsdp_models::ModelInit().device(torch::kMeta).seed(seed));
  fsdp_models::to_hollow(*model, torch::TensorOptions().dtype(torch::kFloat32).device(device));
  auto init = fsdp_models::shard_initializer(*model, std::move(scheme), seed);
  auto blocks = options.blocks, root = options.root;
  blocks.param_init(init);
  root.param_init(init);
  parallelize(model, blocks, root, checkpoint_every);
  out.module = model.ptr();
  out.forward = [model](const torch::Tensor& idx) mutable { return fsdp::forward(model, idx); };
  out.save_hf = [model](const std::string& dir, fsdp::ProcessGroup& group) mutable {
    fsdp_models::save_hf(dir, model, group);
  };
  out.load_hf = [model](const std::string& dir) mutable { fsdp_models::load_hf(dir, model); };
  out.num_params = cfg.num_params();
}

}  // namespace

fsdp_models::GPTConfig gpt_config(const Config& config, int64_t vocab_size) {
  const auto& m = config.model;
  auto cfg = preset_or_config_error<fsdp_models::GPTConfig>("gpt", m.preset);
  if (m.n_layer > 0)
    cfg.n_layer = m.n_layer;
  if (m.n_embd > 0)
    cfg.n_embd = m.n_embd;
  if (m.n_head > 0)
    cfg.n_head = m.n_head;
  cfg.vocab_size = vocab_size;
  cfg.block_size = config.training.seq_len;
  if (cfg.n_embd % cfg.n_head != 0) {
    throw ConfigError(
        fmt::format("model width {} is not a multiple of the head count {} "
                    "('model.n_embd', 'model.n_head')",
                    cfg.n_embd, cfg.n_head));
  }
  return cfg;
}

fsdp_models::LlamaConfig llama_config(const Config& config, int64_t vocab_size) {
  const auto& m = config.model;
  auto cfg = preset_or_config_error<fsdp_models::LlamaConfig>("llama", m.preset);
  if (m.n_layer > 0)
    cfg.n_layers = m.n_layer;
  if (m.n_embd > 0)
    cfg.dim = m.n_embd;
  if (m.n_head > 0)
    cfg.n_heads = m.n_head, cfg.n_kv_heads = std::min(cfg.n_kv_heads, m.n_head);
  cfg.vocab_size = vocab_size;
  cfg.max_seq_len = config.training.seq_len;
  try {
    cfg.validate();
  } catch (const std::exception& e) {
    throw ConfigError(std::string("llama shapes do not fit: ") + e.what());
  }
  return cfg;
}

TrainModel build_model(const Config& config, int64_t vocab_size, const UnitOptions& options,
                       torch::Device device) {
  const auto& m = config.model;
  TrainModel out;
  const auto seed = static_cast<uint64_t>(config.training.seed);
  if (m.arch == "gpt") {
    const auto cfg = gpt_config(config, vocab_size);
    build_sharded<fsdp_models::GPT>(
        out, cfg, fsdp_models::gpt_init_scheme(cfg), seed, options, config.fsdp.ac_every, device,
        [](auto& model, const auto& blocks, const auto& root, int64_t every) {
          fsdp_models::parallelize_gpt(model, blocks, root, every);
        });
    out.n_layer = cfg.n_layer;
    out.n_embd = cfg.n_embd;
    out.n_hidden = 4 * cfg.n_embd;
  } else {
    const auto cfg = llama_config(config, vocab_size);
    build_sharded<fsdp_models::Llama>(
        out, cfg, fsdp_models::llama_init_scheme(cfg), seed, options, config.fsdp.ac_every, device,
        [](auto& model, const auto& blocks, const auto& root, int64_t every) {
          fsdp_models::parallelize_llama(model, blocks, root, every);
        });
    out.n_layer = cfg.n_layers;
    out.n_embd = cfg.dim;
    out.n_hidden = cfg.ffn_hidden_dim;
  }
  out.description = fmt::format("{} {}: {} layers, width {}, {:.2f}M parameters", m.arch, m.preset,
                                out.n_layer, out.n_embd, out.num_params / 1e6);
  return out;
}

TrainModel build_finetune_model(const Config& config, const std::string& gguf_path,
                                const UnitOptions& options, torch::Device device,
                                int64_t only_blocks) {
  const auto& f = config.finetune;
  namespace fm = fsdp_models;
  std::optional<fm::gguf::File> file;
  fm::LlamaConfig cfg;
  try {
    file.emplace(gguf_path);
    cfg = fm::llama_config_from_gguf(*file);
  } catch (const fm::gguf::FormatError& e) {
    throw ConfigError(std::string("'finetune.model': ") + e.what());
  }
  cfg.max_seq_len = f.max_tokens;
  if (only_blocks > 0)  // the planner's timing: that many blocks, weights left at zero
    cfg.n_layers = only_blocks;
  fm::Llama model(cfg, fm::ModelInit().device(torch::kMeta));
  const bool adapters = f.method != "full";
  if (f.method == "qlora")
    fm::use_nf4(*model, /*quantize=*/false);
  if (adapters) {
    try {
      fm::add_lora(*model, f.targets,
                   fm::LoraOptions().rank(f.lora_rank).alpha(f.lora_alpha).dropout(f.lora_dropout),
                   fm::ModelInit().device(torch::kMeta));
    } catch (const c10::Error& e) {
      throw ConfigError("'finetune.targets': " + e.msg());
    }
  }
  int64_t trainable = 0;
  for (const auto& p : model->parameters())
    trainable += p.requires_grad() ? p.numel() : 0;
  fm::to_hollow(*model, torch::TensorOptions().dtype(torch::kFloat32).device(device));
  // Everything but the adapters is read from the file after sharding: zeros until then.
  auto scheme =
      fm::lora_init_scheme([](const std::string&) { return fm::InitRule::constant(0); }, *model);
  auto init = fm::shard_initializer(*model, scheme, static_cast<uint64_t>(config.training.seed));
  auto blocks = options.blocks, root = options.root;
  blocks.param_init(init);
  root.param_init(init);
  fm::parallelize_llama(model, blocks, root, config.fsdp.ac_every);
  try {
    if (only_blocks == 0)
      fm::load_gguf(*file, model);
  } catch (const fm::gguf::FormatError& e) {
    throw ConfigError(std::string("'finetune.model': ") + e.what());
  }
  TrainModel out;
  out.module = model.ptr();
  out.forward = [model](const torch::Tensor& idx) mutable { return fsdp::forward(model, idx); };
  out.save_hf = [model, adapters](const std::string& dir, fsdp::ProcessGroup& group) mutable {
    if (adapters)
      fm::save_merged_hf(dir, model, group);
    else
      fm::save_hf(dir, model, group);
  };
  out.load_hf = [model](const std::string& dir) mutable { fm::load_hf(dir, model); };
  if (adapters) {
    out.save_adapter = [model](const std::string& dir, fsdp::ProcessGroup& group) mutable {
      fm::save_peft_adapter(dir, model, group);
    };
  }
  out.num_params = cfg.num_params();
  out.n_layer = cfg.n_layers;
  out.n_embd = cfg.dim;
  out.n_hidden = cfg.ffn_hidden_dim;
  out.description =
      fmt::format("{}: llama, {} layers, width {}, {:.1f}M parameters; {} trains {:.2f}M{}",
                  std::filesystem::path(gguf_path).filename().string(), cfg.n_layers, cfg.dim,
                  cfg.num_params() / 1e6, f.method, trainable / 1e6,
                  f.method == "qlora" ? ", block weights in NF4" : "");
  return out;
}

}  // namespace fsdp_trainer
