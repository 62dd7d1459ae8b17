// Hugging Face transformers' layout for our models: a directory with config.json and
// model.safetensors that GPT2LMHeadModel / LlamaForCausalLM.from_pretrained(dir) loads, and
// that fsdp-train loads back (on any number of ranks, each reading its own rows).
//
// The mapping, name by name:
//   GPT   wte, wpe, h<i>.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}, ln_f,
//         lm_head  ->  transformer.{wte, wpe, h.<i>.(same), ln_f}, lm_head. GPT-2's linear
//         layers are Conv1D modules whose weights are stored [in, out]: ours ([out, in]) are
//         written transposed. A model without the q/k/v bias (GPTConfig::attn_bias false) gets
//         zero biases in the file, which computes the same.
//   Llama tok_embeddings, layers.<i>.attention.{wq, wk, wv, wo}, .feed_forward.{w1, w3, w2},
//         .attention_norm, .ffn_norm, norm, output  ->  model.embed_tokens,
//         model.layers.<i>.self_attn.{q,k,v,o}_proj, .mlp.{gate,up,down}_proj,
//         .input_layernorm, .post_attention_layernorm, model.norm, lm_head. Our RoPE rotates
//         pairs (x[2i], x[2i+1]) as Meta's checkpoints do; transformers' rotates halves
//         (x[i], x[i + d/2]). Within every head of wq and wk, our row 2i + p is therefore the
//         file's row p * d/2 + i (the permutation of transformers' own conversion script), which
//         makes q.k, and so the model, identical.
// Tied embeddings are one parameter in our models and one tensor in the file
// (tie_word_embeddings: true, no lm_head.weight), as transformers saves them.
#pragma once

#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <fsdp/checkpoint/consolidated.h>

#include "gpt.h"
#include "llama.h"

namespace fsdp {
class ProcessGroup;
}

namespace fsdp_models {

/// The names and layouts of the file (fsdp::save_consolidated / load_consolidated).
fsdp::ConsolidatedOptions hf_options(const GPTConfig& cfg);
fsdp::ConsolidatedOptions hf_options(const LlamaConfig& cfg);

/// config.json for the model (its torch_dtype: `dtype`'s name).
std::string hf_config_json(const GPTConfig& cfg, torch::ScalarType dtype = torch::kFloat32);
std::string hf_config_json(const LlamaConfig& cfg, torch::ScalarType dtype = torch::kFloat32);

/// The model a config.json describes; throws fsdp::safetensors::FormatError, prefixed with
/// `where`, naming the field for what our models cannot represent (another activation, RoPE
/// scaling, biases on Llama's projections, ...).
GPTConfig gpt_config_from_hf(const std::string& config_json, const std::string& where);
LlamaConfig llama_config_from_hf(const std::string& config_json, const std::string& where);

/// Writes the directory `dir` (config.json, model.safetensors) from a sharded model; every rank
/// of `group` calls it, rank 0 writes (fsdp::save_consolidated: rank 0 holds its shards plus two
/// I/O buffers, and GPT-2's transposed weights one matrix at a time). Written as "<dir>.tmp" and
/// renamed once complete. Throws if `dir` exists.
/// Files an export carries beside the weights (the tokenizer's: tokenizer.json,
/// tokenizer_config.json, ...): plain file name -> content, written by rank 0 into the directory
/// before it gets its final name.
using ExportFiles = std::map<std::string, std::string>;

/// How save_hf writes a directory.
struct ExportOptions {
  /// The weights' stored dtype: float32, bfloat16 or float16 (rounded to nearest even from the
  /// model's float32); config.json's torch_dtype names it.
  torch::ScalarType dtype = torch::kFloat32;
  /// 0: one model.safetensors. Otherwise, when the weights take more, files
  /// model-0000k-of-0000n.safetensors of at most this many bytes each (a tensor larger than that
  /// gets a file to itself; the first file also holds a format's small constant tensors),
  /// tensors in the model's order, with model.safetensors.index.json, the layout of
  /// transformers' save_pretrained(max_shard_size=...).
  int64_t shard_bytes = 0;
  ExportFiles files;
};

void save_hf(const std::string& dir, GPT& model, fsdp::ProcessGroup& group,
             const ExportOptions& options = {});
/// A Llama with LoRA adapters is refused unless `skip_adapters` (its adapters merged into the
/// weights first: see save_merged_hf in peft.h).
void save_hf(const std::string& dir, Llama& model, fsdp::ProcessGroup& group,
             bool skip_adapters = false, const ExportOptions& options = {});

/// Writes an export directory `dir` as save_hf does: refused if it exists; `fill(tmp)` runs on
/// every rank with "<dir>.tmp" created (rank 0 writes there), then rank 0 renames it to `dir`
/// once complete, so a crash leaves no half-written directory under the final name. `what`
/// names the caller in the error.
void write_export_dir(const std::string& dir, fsdp::ProcessGroup& group, const char* what,
                      const std::function<void(const std::filesystem::path& tmp)>& fill,
                      const ExportFiles& files = {});

/// The safetensors files of a Hugging Face directory: model.safetensors, or the files
/// model.safetensors.index.json's weight_map names (validated: plain file names inside `dir`
/// that exist and hold the tensors the index places in them). FormatError naming the file.
std::vector<std::string> hf_weight_files(const std::string& dir);

/// The Llama config.json of `dir` describes (llama_config_from_hf).
LlamaConfig read_llama_config(const std::string& dir);

/// Loads a directory written by save_hf or by transformers (config.json + model.safetensors or
/// sharded model-0000k-of-0000n.safetensors with their index, float32/bf16/fp16) into `model`,
/// sharded or not: each rank reads the rows it holds, from whichever file holds them. Throws
/// fsdp::safetensors::FormatError naming the file (and tensor, or the config field whose
/// value differs from the model's).
void load_hf(const std::string& dir, GPT& model);
/// A Llama with LoRA adapters loads its base weights; the adapters keep their values.
void load_hf(const std::string& dir, Llama& model);

}  // namespace fsdp_models
