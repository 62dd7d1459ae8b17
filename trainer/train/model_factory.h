// Builds the configured model (GPT or Llama), applies FSDP to it, and says how big it is.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>

#include <fsdp/checkpoint/tensor_parallel_layout.h>
#include <fsdp/clip_grad.h>
#include <fsdp/fully_shard.h>

#include "config/config.h"
#include "gpt.h"
#include "hf_format.h"
#include "llama.h"

namespace fsdp_trainer {

struct TrainModel {
  std::shared_ptr<torch::nn::Module> module;
  /// idx (B, T) -> logits (B, T, vocab), through fsdp::forward.
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  /// idx (B, T) -> the logits (B, vocab) of the last position only (fsdp_models::LastLogits):
  /// what sampling and greedy answers read, without the head's matmul over the whole prompt.
  std::function<torch::Tensor(const torch::Tensor&)> next_logits;
  /// idx (B, T) -> the loss of `spec` (fsdp_models::LossSpec: the head and cross-entropy over
  /// chunks of positions), through fsdp::forward.
  std::function<torch::Tensor(const torch::Tensor&, const fsdp_models::LossSpec&)> forward_loss;
  /// Writes the model as a Hugging Face directory / loads one into it (formats/hf_format.h).
  std::function<void(const std::string& dir, fsdp::ProcessGroup& group,
                     const fsdp_models::ExportOptions& options)>
      save_hf;
  std::function<void(const std::string& dir)> load_hf;
  /// Fine-tuning with adapters: writes them in PEFT's layout (models/lora.h); else empty.
  std::function<void(const std::string& dir, fsdp::ProcessGroup& group)> save_adapter;
  /// The loss of inputs (B, T) against targets (B, T): sum(weights * cross-entropy) /
  /// denominator (weights undefined: all 1). loss_chunk >= 0: forward_loss (the fused head,
  /// training.loss_chunk; 0 picks the chunk); < 0: forward, the whole logits, cross_entropy.
  torch::Tensor loss(const torch::Tensor& inputs, const torch::Tensor& targets,
                     const torch::Tensor& weights, double denominator, int64_t loss_chunk) const;

  /// parallel.tp > 1: the tensor-parallel group, where this rank's part of each split
  /// parameter sits in the whole model (for checkpoints), and the split parameters (for the
  /// gradient norm over both axes). Without it: null and empty.
  std::shared_ptr<fsdp::ProcessGroup> tp;
  fsdp::TensorParallelLayout tp_layout;
  fsdp::TensorParallelParams tp_params;

  int64_t num_params = 0;
  int64_t n_layer = 0;
  int64_t n_embd = 0;
  int64_t n_hidden = 0;     // the MLP's inner width (GPT 4 n_embd, Llama ffn_hidden_dim)
  std::string description;  // "gpt gpt2-tiny: 4 layers, width 128, 0.85M parameters"
};

/// How the units are sharded: the blocks (activation checkpointing applies to every
/// config.fsdp.ac_every-th of them) and the root (embeddings, final norm, head).
struct UnitOptions {
  fsdp::FullyShardOptions blocks;
  fsdp::FullyShardOptions root;
};

/// The units' options a config asks for: the one translation of [fsdp] and [precision] into
/// engine options, which the trainer shards with and the planner (step_plan.cpp) predicts from.
/// `group`: the job's (null where the options are only read). `compute_dtype`: the resolved
/// precision.param_dtype ("fp32", "bf16", "fp16"). `local_world_size`: ranks per node (for
/// hybrid_shard's default block).
UnitOptions unit_options(const Config& config, std::shared_ptr<fsdp::ProcessGroup> group,
                         const std::string& compute_dtype, int local_world_size);

/// `only_blocks` > 0 (the planner's timing): that many blocks, the weights not read (zeros).
/// The pretrained model of `model_path` (config.finetune: LoRA or QLoRA applied before
/// sharding; max_seq_len finetune.max_tokens), sharded with `options`, each rank reading its
/// rows of the file. Adapters start as PEFT's (lora_B zero, so the model starts as the
/// file's). save_hf writes the adapters merged (lora) or the model (full). ConfigError for a
/// model that is not a Llama GGUF file or Hugging Face directory, or targets that match no layer.
/// With `tp` (parallel.tp > 1) the model is split over that group first (LoRA adapters with
/// their layers); the file's loaders read whole layers, so the caller then loads the weights
/// itself (`read_weights` false: the base left at zero, the adapters initialised).
TrainModel build_finetune_model(const Config& config, const std::string& model_path,
                                const UnitOptions& options, torch::Device device,
                                int64_t only_blocks = 0,
                                std::shared_ptr<fsdp::ProcessGroup> tp = nullptr,
                                bool read_weights = true);

/// config.model's shapes (preset and overrides) with `vocab_size` tokens and
/// config.training.seq_len context. ConfigError for an unknown preset or shapes that do not fit.
fsdp_models::GPTConfig gpt_config(const Config& config, int64_t vocab_size);
fsdp_models::LlamaConfig llama_config(const Config& config, int64_t vocab_size);

/// Refuses (ConfigError naming the keys and the sizes) a model that cannot fit this machine
/// before anything is allocated for it: what each rank must hold at least (its shard of the
/// parameters, their gradients and the optimizer's in-memory state, one block's parameters
/// gathered, one micro-batch's logits), times the ranks on this host, against its physical
/// memory. A lower bound, so it never refuses a run that would fit; a huge model.n_embd,
/// n_layer or training.seq_len ends here in a second instead of in the allocator.
void check_model_fits(const Config& config, int world_size, int local_world_size);

/// The run's tensor-parallel split of `model` over `tp` (parallel.tp > 1): this rank's part of
/// each layer (models/tensor_parallel.h), and with parallel.sequence_parallel its share of the
/// sequence between them. ConfigError for shapes that do not divide over the group. The one
/// rule for the trainer's models and the planner's (which splits over a fsdp::local_group).
fsdp::TensorParallelLayout split_for_tensor_parallel(const Config& config, fsdp_models::GPT& model,
                                                     const std::shared_ptr<fsdp::ProcessGroup>& tp);
fsdp::TensorParallelLayout split_for_tensor_parallel(const Config& config,
                                                     fsdp_models::Llama& model,
                                                     const std::shared_ptr<fsdp::ProcessGroup>& tp);

/// The model of config.model with `vocab_size` tokens and config.training.seq_len context,
/// initialised from config.training.seed (the same values on any number of ranks), sharded with
/// `options`, its shards on `device`. With `tp` (parallel.tp > 1), first split over that group
/// (models/tensor_parallel.h; options' group is then the mesh's dp axis); the values are those of
/// the same model built whole. Throws ConfigError for an unknown preset or shapes that do not fit
/// (or do not divide over the tp group).
TrainModel build_model(const Config& config, int64_t vocab_size, const UnitOptions& options,
                       torch::Device device, std::shared_ptr<fsdp::ProcessGroup> tp = nullptr);

}  // namespace fsdp_trainer
