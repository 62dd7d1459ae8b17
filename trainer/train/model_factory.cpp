// See model_factory.h.
#include "model_factory.h"

#include <fmt/core.h>

#include <unistd.h>

#include <filesystem>
#include <optional>
#include <type_traits>

#include <fsdp/distributed/process_group.h>

#include "compute_dtype.h"
#include "data/pretrained_model.h"
#include "gpt.h"
#include "hf_format.h"
#include "llama.h"
#include "lora.h"
#include "peft.h"
#include "tensor_parallel.h"

namespace fsdp_trainer {

torch::Tensor TrainModel::loss(const torch::Tensor& inputs, const torch::Tensor& targets,
                               const torch::Tensor& weights, double denominator,
                               int64_t loss_chunk) const {
  if (loss_chunk >= 0)
    return forward_loss(inputs, fsdp_models::LossSpec{targets, weights, denominator, loss_chunk});
  const auto logits = forward(inputs);
  auto ce = torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
  if (weights.defined())
    ce = ce * weights.reshape({-1});
  return ce.sum() / denominator;
}
namespace {

std::string first_line(const std::string& s) {
  return s.substr(0, s.find('\n'));
}

template <typename C>
C preset_or_config_error(const std::string& arch, const std::string& name) {
  try {
    return C::preset(name);
  } catch (const std::exception& e) {
    // The name cut short: a 100 KB override must not become a 100 KB message.
    const std::string shown = name.size() > 120 ? name.substr(0, 120) + "..." : name;
    // The library's reason quotes the name too: cut there as well, keep its list of presets.
    std::string why = first_line(e.what());
    if (const size_t at = why.find(name); !name.empty() && at != std::string::npos)
      why.replace(at, name.size(), shown);
    throw ConfigError("'model.preset' = '" + shown + "' is not a " + arch + " preset: " + why);
  }
}

// Deferred initialisation, for either family: the model is built on the meta device, its
// parameters become one-element placeholders, and each rank fills only its own shard (by
// parameter name, so the values are those of an eager build on any number of ranks). A preset
// far larger than one process's memory can therefore be sharded as long as its shards fit. The
// placeholders are on `device`, so the shards are created there and never cross the bus. With
// a tensor-parallel group the meta model is split first (`split`), and each rank fills its
// shards of its parts with the whole tensors' values there.
template <typename Model, typename Cfg, typename Split, typename Parallelize>
void build_sharded(TrainModel& out, const Cfg& cfg, fsdp_models::InitScheme scheme, uint64_t seed,
                   const UnitOptions& options, int64_t checkpoint_every, torch::Device device,
                   const std::shared_ptr<fsdp::ProcessGroup>& tp, Split split,
                   Parallelize parallelize) {
  Model model(cfg, fsdp_models::ModelInit().device(torch::kMeta).seed(seed));
  if (tp) {
    out.tp_layout = split(model, tp);
    out.tp = tp;
  }
  fsdp_models::to_hollow(*model, torch::TensorOptions().dtype(torch::kFloat32).device(device));
  auto init =
      tp ? fsdp_models::tensor_parallel_initializer(*model, std::move(scheme), seed, out.tp_layout)
         : fsdp_models::shard_initializer(*model, std::move(scheme), seed);
  auto blocks = options.blocks, root = options.root;
  blocks.param_init(init);
  root.param_init(init);
  parallelize(model, blocks, root, checkpoint_every);
  if (tp)
    out.tp_params = fsdp_models::tensor_parallel_params(*model, tp->size());
  out.module = model.ptr();
  out.forward = [model](const torch::Tensor& idx) mutable { return fsdp::forward(model, idx); };
  out.next_logits = [model](const torch::Tensor& idx) mutable {
    return fsdp::forward(model, idx, fsdp_models::LastLogits{1}).select(1, 0);
  };
  out.forward_loss = [model](const torch::Tensor& idx, const fsdp_models::LossSpec& spec) mutable {
    return fsdp::forward(model, idx, spec);
  };
  out.save_hf = [model](const std::string& dir, fsdp::ProcessGroup& group,
                        const fsdp_models::ExportOptions& options) mutable {
    if constexpr (std::is_same_v<Model, fsdp_models::Llama>)
      fsdp_models::save_hf(dir, model, group, /*skip_adapters=*/false, options);
    else
      fsdp_models::save_hf(dir, model, group, options);
  };
  out.load_hf = [model](const std::string& dir) mutable { fsdp_models::load_hf(dir, model); };
  out.num_params = cfg.num_params();
}

// The shapes that decide a model's size, in floating point: a hostile width squared
// overflows int64 (GPTConfig::num_params) long before it is refused.
struct ModelSize {
  double params = 0;  // all of them
  double block = 0;   // one block's
  double vocab = 0;   // logits per token
};

double physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) : 0;
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (b >= 1024 && u < 6)
    b /= 1024, ++u;
  return b >= 1024 ? fmt::format("{:.3g} {}", b, units[u]) : fmt::format("{:.1f} {}", b, units[u]);
}

// Per rank: the model states of its shard, one block gathered, one micro-batch's logits (fp32).
void check_fits(const Config& config, const ModelSize& m, const std::string& what, int world_size,
                int local_world_size) {
  const auto& f = config.fsdp;
  // Tensor parallelism splits what the dp axis shards: a rank holds 1/tp of its dp shard.
  const double tp = static_cast<double>(config.parallel.tp);
  double shard_ranks = f.strategy == "no_shard" ? tp : world_size;
  if (f.strategy == "hybrid_shard")
    shard_ranks = tp * static_cast<double>(resolved_hybrid_shard_size(config, local_world_size));
  shard_ranks = std::max(1.0, shard_ranks);
  double optimizer_states = 0;  // fp32-sized copies of the parameters the optimizer keeps
  if (config.optimizer.offload == "none") {
    const double each = config.optimizer.moments_dtype == "bf16" ? 0.5 : 1.0;
    if (config.optimizer.name == "sgd")
      optimizer_states = config.optimizer.momentum > 0 ? each : 0;
    else
      optimizer_states = 2 * each;
  }
  double states = 4 * m.params * (2 + optimizer_states) / shard_ranks;
  if (config.finetuning && config.finetune.method != "full") {
    // LoRA and QLoRA freeze the model: no gradients and no optimizer state for it (the
    // adapters are a few MB), and QLoRA keeps the block weights in NF4. Counted at the least
    // bytes a frozen weight can take (bf16; NF4's 4 bits), so that this stays a lower bound.
    states = (config.finetune.method == "qlora" ? 0.5 : 2.0) * m.params / shard_ranks;
  }
  const double micro_batch = static_cast<double>(config.training.batch_size) /
                             static_cast<double>(config.training.micro_batches);
  const double seq = config.finetuning ? static_cast<double>(config.finetune.max_tokens)
                                       : static_cast<double>(config.training.seq_len);
  const double logits = 4 * micro_batch * seq * m.vocab;
  const double per_rank = states + 4 * m.block + logits;
  const double host = per_rank * std::max(1, local_world_size);
  const double memory = physical_memory_bytes();
  if (memory > 0 && host > memory) {
    throw ConfigError(fmt::format(
        "{}: {:.4g} parameters ({} in fp32); each rank needs at least {} (model states sharded "
        "over {} rank(s) {}, one block gathered {}, one micro-batch's logits {}), {} for the {} "
        "rank(s) on this host, more than its {} of memory",
        what, m.params, human_bytes(4 * m.params), human_bytes(per_rank),
        static_cast<int64_t>(shard_ranks), human_bytes(states), human_bytes(4 * m.block),
        human_bytes(logits), human_bytes(host), std::max(1, local_world_size),
        human_bytes(memory)));
  }
}

ModelSize gpt_size(const fsdp_models::GPTConfig& c) {
  const double d = static_cast<double>(c.n_embd), v = static_cast<double>(c.vocab_size);
  ModelSize m;
  m.block = 12 * d * d + 13 * d;
  m.params = v * d * (c.tie_embeddings ? 1 : 2) + static_cast<double>(c.block_size) * d +
             static_cast<double>(c.n_layer) * m.block + 2 * d;
  m.vocab = v;
  return m;
}

ModelSize llama_size(const fsdp_models::LlamaConfig& c) {
  const double d = static_cast<double>(c.dim), v = static_cast<double>(c.vocab_size);
  const double kv = static_cast<double>(c.n_kv_heads) * (d / static_cast<double>(c.n_heads));
  ModelSize m;
  m.block = 2 * d * d + 2 * d * kv + 3 * d * static_cast<double>(c.ffn_hidden_dim) + 2 * d;
  m.params = v * d * (c.tie_embeddings ? 1 : 2) + static_cast<double>(c.n_layers) * m.block + d;
  m.vocab = v;
  return m;
}

}  // namespace

void check_model_fits(const Config& config, int world_size, int local_world_size) {
  const auto& m = config.model;
  const std::string what = fmt::format(
      "model.preset = '{}' with model.n_layer = {}, model.n_embd = {}, "
      "data.vocab_size = {}, training.seq_len = {}",
      m.preset, m.n_layer, m.n_embd, config.data.vocab_size, config.training.seq_len);
  const auto size = m.arch == "gpt" ? gpt_size(gpt_config(config, config.data.vocab_size))
                                    : llama_size(llama_config(config, config.data.vocab_size));
  check_fits(config, size, what, world_size, local_world_size);
}

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

namespace {

template <typename Model, typename Split>
fsdp::TensorParallelLayout split_model(const Config& config, Model& model,
                                       const std::shared_ptr<fsdp::ProcessGroup>& tp, Split split) {
  try {
    auto layout = split(model, tp);
    if (config.parallel.sequence_parallel)
      model->use_sequence_parallel(tp);
    return layout;
  } catch (const c10::Error& e) {
    throw ConfigError("'parallel.tp' = " + std::to_string(tp->size()) + ": " + first_line(e.msg()));
  }
}

}  // namespace

fsdp::TensorParallelLayout split_for_tensor_parallel(
    const Config& config, fsdp_models::GPT& model, const std::shared_ptr<fsdp::ProcessGroup>& tp) {
  return split_model(config, model, tp, fsdp_models::tensor_parallelize_gpt);
}

fsdp::TensorParallelLayout split_for_tensor_parallel(
    const Config& config, fsdp_models::Llama& model,
    const std::shared_ptr<fsdp::ProcessGroup>& tp) {
  return split_model(config, model, tp, fsdp_models::tensor_parallelize_llama);
}

TrainModel build_model(const Config& config, int64_t vocab_size, const UnitOptions& options,
                       torch::Device device, std::shared_ptr<fsdp::ProcessGroup> tp) {
  const auto& m = config.model;
  TrainModel out;
  const auto seed = static_cast<uint64_t>(config.training.seed);
  if (m.arch == "gpt") {
    const auto cfg = gpt_config(config, vocab_size);
    build_sharded<fsdp_models::GPT>(
        out, cfg, fsdp_models::gpt_init_scheme(cfg), seed, options, config.fsdp.ac_every, device,
        tp,
        [&config](fsdp_models::GPT& model, const std::shared_ptr<fsdp::ProcessGroup>& group) {
          return split_for_tensor_parallel(config, model, group);
        },
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
        tp,
        [&config](fsdp_models::Llama& model, const std::shared_ptr<fsdp::ProcessGroup>& group) {
          return split_for_tensor_parallel(config, model, group);
        },
        [](auto& model, const auto& blocks, const auto& root, int64_t every) {
          fsdp_models::parallelize_llama(model, blocks, root, every);
        });
    out.n_layer = cfg.n_layers;
    out.n_embd = cfg.dim;
    out.n_hidden = cfg.ffn_hidden_dim;
  }
  out.description = fmt::format("{} {}: {} layers, width {}, {:.2f}M parameters", m.arch, m.preset,
                                out.n_layer, out.n_embd, out.num_params / 1e6);
  if (tp)
    out.description += fmt::format(", split over {} tensor-parallel ranks{}", tp->size(),
                                   config.parallel.sequence_parallel ? " (and its sequence)" : "");
  return out;
}

TrainModel build_finetune_model(const Config& config, const std::string& model_path,
                                const UnitOptions& options, torch::Device device,
                                int64_t only_blocks, std::shared_ptr<fsdp::ProcessGroup> tp,
                                bool read_weights) {
  const auto& f = config.finetune;
  namespace fm = fsdp_models;
  fm::LlamaConfig cfg = pretrained_config(model_path);
  cfg.max_seq_len = f.max_tokens;
  if (only_blocks == 0) {  // sizes a sparse file may claim without holding them
    const auto env = fsdp::launch_env_from_environment();
    check_fits(config, llama_size(cfg), "'finetune.model' " + model_path, env.world_size,
               env.local_world_size);
  }
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
  TrainModel out;
  if (tp) {
    out.tp_layout = split_for_tensor_parallel(config, model, tp);
    out.tp = tp;
  }
  fm::to_hollow(*model, torch::TensorOptions().dtype(torch::kFloat32).device(device));
  // Everything but the adapters is read from the file after sharding: zeros until then.
  auto scheme =
      fm::lora_init_scheme([](const std::string&) { return fm::InitRule::constant(0); }, *model);
  const auto seed = static_cast<uint64_t>(config.training.seed);
  auto init = tp ? fm::tensor_parallel_initializer(*model, scheme, seed, out.tp_layout)
                 : fm::shard_initializer(*model, scheme, seed);
  auto blocks = options.blocks, root = options.root;
  blocks.param_init(init);
  root.param_init(init);
  fm::parallelize_llama(model, blocks, root, config.fsdp.ac_every);
  if (tp)
    out.tp_params = fm::tensor_parallel_params(*model, tp->size());
  if (only_blocks == 0 && read_weights)
    load_pretrained(model_path, model);
  out.module = model.ptr();
  out.forward = [model](const torch::Tensor& idx) mutable { return fsdp::forward(model, idx); };
  out.next_logits = [model](const torch::Tensor& idx) mutable {
    return fsdp::forward(model, idx, fsdp_models::LastLogits{1}).select(1, 0);
  };
  out.forward_loss = [model](const torch::Tensor& idx, const fsdp_models::LossSpec& spec) mutable {
    return fsdp::forward(model, idx, std::cref(spec));  // targets and weights: not cast
  };
  // Exports carry the model's tokenizer files, so that transformers uses them as they are.
  // Made now, not at export time: a tokenizer that cannot be written fails before training.
  auto tokenizer_files =
      std::make_shared<const fm::ExportFiles>(pretrained_tokenizer_files(model_path));
  out.save_hf = [model, adapters, tokenizer_files](const std::string& dir,
                                                   fsdp::ProcessGroup& group,
                                                   fm::ExportOptions options) mutable {
    options.files.insert(tokenizer_files->begin(), tokenizer_files->end());
    if (adapters)
      fm::save_merged_hf(dir, model, group, options);
    else
      fm::save_hf(dir, model, group, /*skip_adapters=*/false, options);
  };
  out.load_hf = [model](const std::string& dir) mutable { fm::load_hf(dir, model); };
  if (adapters) {
    out.save_adapter = [model, tokenizer_files](const std::string& dir,
                                                fsdp::ProcessGroup& group) mutable {
      fm::save_peft_adapter(dir, model, group, "", *tokenizer_files);
    };
  }
  out.num_params = cfg.num_params();
  out.n_layer = cfg.n_layers;
  out.n_embd = cfg.dim;
  out.n_hidden = cfg.ffn_hidden_dim;
  out.description =
      fmt::format("{}: llama, {} layers, width {}, {:.1f}M parameters; {} trains {:.2f}M{}",
                  pretrained_name(model_path), cfg.n_layers, cfg.dim, cfg.num_params() / 1e6,
                  f.method, trainable / 1e6, f.method == "qlora" ? ", block weights in NF4" : "");
  if (tp)
    out.description += fmt::format(", split over {} tensor-parallel ranks", tp->size());
  return out;
}

UnitOptions unit_options(const Config& config, std::shared_ptr<fsdp::ProcessGroup> group,
                         const std::string& compute_dtype, int local_world_size) {
  const auto& f = config.fsdp;
  const auto& prec = config.precision;
  fsdp::FullyShardOptions o(std::move(group));
  // Each knob only where it means something: fully_shard refuses the others.
  const auto strategy = fsdp::from_string<fsdp::ShardingStrategy>(f.strategy);
  o.strategy(strategy);
  if (strategy == fsdp::ShardingStrategy::kHybridShard)
    o.hybrid_shard_size(static_cast<int>(resolved_hybrid_shard_size(config, local_world_size)));
  if (strategy == fsdp::ShardingStrategy::kFullShard ||
      strategy == fsdp::ShardingStrategy::kHybridShard) {
    o.reshard_after_forward(f.reshard_after_forward)
        .reshard_after_forward_size(static_cast<int>(f.reshard_after_forward_size));
  }
  o.forward_prefetch(f.forward_prefetch)
      .backward_prefetch(fsdp::from_string<fsdp::BackwardPrefetch>(f.backward_prefetch))
      .max_inflight_all_gathers(static_cast<int>(f.max_inflight_all_gathers))
      .all_reduce_bucket_bytes(
          std::max<int64_t>(1, std::llround(f.all_reduce_bucket_mb * (1 << 20))))
      .all_gather_bucket_bytes(std::llround(f.all_gather_bucket_mb * (1 << 20)))
      .sync_module_states(f.sync_module_states);
  if (f.cpu_offload)
    o.offload_policy(fsdp::CPUOffloadPolicy());
  // Blocks gather and compute in param_dtype; the root too unless root_fp32, and its logits
  // come out in fp32 either way (the loss and its softmax in fp32). gather_format applies to
  // the root unless root_fp32 (which keeps the root exact).
  UnitOptions units{o, o};
  auto policy = fsdp::MixedPrecisionPolicy()
                    .param_dtype(dtype_named(compute_dtype))
                    .reduce_dtype(dtype_named(prec.reduce_dtype))
                    .gather_format(fsdp::from_string<fsdp::GatherFormat>(prec.gather_format))
                    .int8_block_size(prec.int8_block)
                    .reduce_format(fsdp::from_string<fsdp::ReduceFormat>(prec.reduce_format))
                    .error_feedback(prec.error_feedback);
  // With an fp32 root the blocks hand it fp32 (the last block's output meets fp32 weights);
  // each block casts its input back to param_dtype on entry.
  units.blocks.mp_policy(
      prec.root_fp32 ? fsdp::MixedPrecisionPolicy(policy).output_dtype(torch::kFloat) : policy);
  units.root.mp_policy(prec.root_fp32
                           ? fsdp::MixedPrecisionPolicy()
                           : fsdp::MixedPrecisionPolicy(policy).output_dtype(torch::kFloat));
  units.blocks.activation_checkpointing(
      fsdp::from_string<fsdp::CheckpointMode>(f.activation_checkpointing));
  return units;
}

}  // namespace fsdp_trainer
