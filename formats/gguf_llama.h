// A Llama-architecture GGUF file (llama.cpp's conversion of a Hugging Face Llama, e.g.
// SmolLM2-135M-Instruct) as our Llama: its config, and its weights loaded into a model that may
// be sharded, each rank reading only the rows of its shards.
//
// Names: token_embd -> tok_embeddings, blk.<i>.attn_{q,k,v,output} -> layers.<i>.attention.
// {wq,wk,wv,wo}, blk.<i>.ffn_{gate,down,up} -> layers.<i>.feed_forward.{w1,w2,w3},
// blk.<i>.{attn_norm,ffn_norm} -> layers.<i>.{attention_norm,ffn_norm}, output_norm -> norm,
// output -> output (absent: tied embeddings). Layout: llama.cpp's converter stores q and k rows
// in Meta's interleaved-pair RoPE order, which is our model's; they load as they are. That is a
// claim about the file, checked by comparing logits with transformers' own GGUF loader
// (tests/trainer/test_gguf.cpp), which reverses the converter's permutation itself.
#pragma once

#include <string>

#include "gguf.h"
#include "llama.h"

namespace fsdp_models {

/// The model the file holds. Refuses, naming the key, what our Llama does not model (another
/// architecture, RoPE scaling, a rotary dimension other than the head's).
LlamaConfig llama_config_from_gguf(const gguf::File& file);

/// Copies the file's weights into `model` (built with llama_config_from_gguf's shapes; sharded
/// or not): each parameter's rows as this rank holds them, dequantised to float32. Layers in
/// NF4 (use_nf4 in lora.h) are quantized from the file's values, each rank encoding its own
/// rows; LoRA adapters are left as they are.
void load_gguf(const gguf::File& file, Llama& model);

/// The GGUF name of one of our Llama's parameter names ("" if it has none).
std::string gguf_name(const std::string& param_name);

}  // namespace fsdp_models
