// LoRA and QLoRA on the model zoo's Linear layers (PEFT's adapter files: formats/peft.h).
//
// LoRA (Hu et al. 2021) freezes a pretrained model and trains, beside chosen Linear layers, a
// low-rank update (alpha / rank) B A. QLoRA (Dettmers et al. 2023) also stores the frozen
// Linear weights in NF4 (fsdp/quant/nf4.h). Both happen before fully_shard: the adapters are
// parameters of the same modules, so they are sharded in the same units as the weights they
// adapt; the frozen weights get neither gradients nor optimizer state (build the optimizer on
// trainable_parameters()), and under QLoRA the 4-bit storage is what is sharded and gathered.
//
//   add_lora(*model, "wq|wv", LoraOptions().rank(8).alpha(16));   // then fully_shard, load
//   auto opt = fsdp::FusedAdamW(trainable_parameters(*model), ...);
#pragma once

#include <torch/nn/module.h>

#include <string>
#include <vector>

#include "layers.h"
#include "llama.h"

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

/// Every Linear under `model` that is not an adapter, by name (relative to `model`).
std::vector<std::pair<std::string, std::shared_ptr<LinearImpl>>> adapted_linears(
    torch::nn::Module& model);

/// The parameters that require grad (the adapters after add_lora).
std::vector<torch::Tensor> trainable_parameters(torch::nn::Module& model);

/// `base` plus PEFT's initialisation of the adapters of `model` (after add_lora): lora_A
/// uniform in +-1/sqrt(in) (kaiming uniform with a = sqrt(5), torch::nn::Linear's default),
/// lora_B zero, so the adapted model starts as the base model.
InitScheme lora_init_scheme(InitScheme base, torch::nn::Module& model);

}  // namespace fsdp_models
