// LoRA and QLoRA on the model zoo's Linear layers, and PEFT's adapter files.
//
// LoRA (Hu et al. 2021) freezes a pretrained model and trains, beside chosen Linear layers, a
// low-rank update (alpha / rank) B A. QLoRA (Dettmers et al. 2023) also stores the frozen
// Linear weights in NF4 (fsdp/nf4.h). Both happen before fully_shard: the adapters are
// parameters of the same modules, so they are sharded in the same units as the weights they
// adapt; the frozen weights get neither gradients nor optimizer state (build the optimizer on
// trainable_parameters()), and under QLoRA the 4-bit storage is what is sharded and gathered.
//
//   add_lora(*model, "wq|wv", LoraOptions().rank(8).alpha(16));   // then fully_shard, load
//   auto opt = fsdp::FusedAdamW(trainable_parameters(*model), ...);
//   save_peft_adapter(dir, model, group);   // Python: PeftModel.from_pretrained(hf_model, dir)
#pragma once

#include <torch/nn/module.h>

#include <string>
#include <vector>

#include "layers.h"
#include "llama.h"

namespace fsdp {
class ProcessGroup;
}

namespace fsdp_models {

/// Adds adapters to every Linear under `model` whose name (relative to `model`, e.g.
/// "layers.3.attention.wq") or whose last component ("wq") matches the ECMAScript regex
/// `targets` in full, and freezes every other parameter. Returns the adapted layers' names.
/// Throws if none matches (a misspelt target would otherwise train nothing).
std::vector<std::string> add_lora(torch::nn::Module& model, const std::string& targets,
                                  const LoraOptions& options, const ModelInit& init = {});

/// Stores every Linear inside the blocks ("layers.*", not the output head, not adapters) in
/// NF4. `quantize`: from the current weights; otherwise as empty storage on the weights'
/// device (meta stays meta, for to_hollow) for a loader (GGUF) to fill after sharding. Returns
/// the quantized layers' names.
std::vector<std::string> use_nf4(torch::nn::Module& model, bool quantize);

/// The parameters that require grad (the adapters after add_lora).
std::vector<torch::Tensor> trainable_parameters(torch::nn::Module& model);

/// `base` plus PEFT's initialisation of the adapters of `model` (after add_lora): lora_A
/// uniform in +-1/sqrt(in) (kaiming uniform with a = sqrt(5), torch::nn::Linear's default),
/// lora_B zero, so the adapted model starts as the base model.
InitScheme lora_init_scheme(InitScheme base, torch::nn::Module& model);

/// Writes the adapters of a Llama in PEFT's layout into directory `dir` (created):
/// adapter_model.safetensors with Hugging Face names ("base_model.model.model.layers.0.
/// self_attn.q_proj.lora_A.weight"; lora_B of q/k rows permuted as hf_format permutes the
/// weights) and adapter_config.json (rank, alpha, dropout, target modules in Hugging Face's
/// names). Every rank calls it; rank 0 writes. `base_model` names the base in the config.
void save_peft_adapter(const std::string& dir, Llama& model, fsdp::ProcessGroup& group,
                       const std::string& base_model = "");

/// Writes the model with every adapter merged into its weight (W + (alpha / rank) B A) as a
/// Hugging Face directory (config.json + model.safetensors), without the adapters. The model
/// is left as it was, bit for bit. Refused for NF4 weights.
void save_merged_hf(const std::string& dir, Llama& model, fsdp::ProcessGroup& group);

}  // namespace fsdp_models
