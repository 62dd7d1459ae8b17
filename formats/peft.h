// PEFT's files for LoRA fine-tuning: the adapters alone (adapter_model.safetensors +
// adapter_config.json, which PeftModel.from_pretrained loads on a Hugging Face model), or the
// model with the adapters merged (a Hugging Face directory, see hf_format.h).
//
//   add_lora(*model, "wq|wv", LoraOptions().rank(8).alpha(16));   // models/lora.h
//   ...train...
//   save_peft_adapter(dir, model, group);   // Python: PeftModel.from_pretrained(hf_model, dir)
#pragma once

#include <string>

#include "hf_format.h"
#include "llama.h"

namespace fsdp {
class ProcessGroup;
}

namespace fsdp_models {

/// Writes the adapters of a Llama in PEFT's layout into directory `dir` (created):
/// adapter_model.safetensors with Hugging Face names ("base_model.model.model.layers.0.
/// self_attn.q_proj.lora_A.weight"; lora_B of q/k rows permuted as hf_format permutes the
/// weights) and adapter_config.json (rank, alpha, dropout, target modules in Hugging Face's
/// names). Every rank calls it; rank 0 writes. `base_model` names the base in the config.
void save_peft_adapter(const std::string& dir, Llama& model, fsdp::ProcessGroup& group,
                       const std::string& base_model = "", const ExportFiles& files = {});

/// Writes the model with every adapter merged into its weight (W + (alpha / rank) B A) as a
/// Hugging Face directory (config.json + model.safetensors), without the adapters. The model
/// is left as it was, bit for bit. Refused for NF4 weights.
void save_merged_hf(const std::string& dir, Llama& model, fsdp::ProcessGroup& group,
                    const ExportOptions& options = {});

}  // namespace fsdp_models
