#include "gguf_llama.h"

#include <fsdp/state_dict.h>

#include <regex>

namespace fsdp_models {

LlamaConfig llama_config_from_gguf(const gguf::File& f) {
  const auto& path = f.path();
  auto key = [&](const std::string& k) { return path + ": " + k; };
  const auto arch = f.value("general.architecture").as_string(key("general.architecture"));
  if (arch != "llama")
    throw gguf::FormatError(path + ": general.architecture is '" + arch + "'; only llama is read");
  for (const char* k : {"llama.rope.scaling.type", "llama.rope.scaling.factor"})
    if (f.metadata().count(k))
      throw gguf::FormatError(key(k) + " is set: RoPE scaling is not modelled");
  auto i = [&](const std::string& k) { return f.value(k).as_int(key(k)); };
  LlamaConfig c;
  c.n_layers = i("llama.block_count");
  c.dim = i("llama.embedding_length");
  c.n_heads = i("llama.attention.head_count");
  c.n_kv_heads = f.metadata().count("llama.attention.head_count_kv")
                     ? i("llama.attention.head_count_kv")
                     : c.n_heads;
  c.ffn_hidden_dim = i("llama.feed_forward_length");
  c.max_seq_len = i("llama.context_length");
  c.norm_eps = f.value("llama.attention.layer_norm_rms_epsilon")
                   .as_double(key("llama.attention.layer_norm_rms_epsilon"));
  c.rope_theta = f.metadata().count("llama.rope.freq_base")
                     ? f.value("llama.rope.freq_base").as_double(key("llama.rope.freq_base"))
                     : 10000.0;
  c.vocab_size = f.tensor("token_embd.weight").shape.at(0);
  c.tie_embeddings = !f.has_tensor("output.weight");
  if (c.n_heads <= 0 || c.dim % c.n_heads != 0)
    throw gguf::FormatError(key("llama.attention.head_count") + " does not divide the width");
  if (f.metadata().count("llama.rope.dimension_count") &&
      i("llama.rope.dimension_count") != c.head_dim())
    throw gguf::FormatError(key("llama.rope.dimension_count") +
                            " differs from the head dimension: partial rotary is not modelled");
  c.validate();
  return c;
}

std::string gguf_name(const std::string& p) {
  static const std::vector<std::pair<std::regex, std::string>> rules = {
      {std::regex(R"(^tok_embeddings\.weight$)"), "token_embd.weight"},
      {std::regex(R"(^norm\.weight$)"), "output_norm.weight"},
      {std::regex(R"(^output\.weight$)"), "output.weight"},
      {std::regex(R"(^layers\.(\d+)\.attention\.wq\.weight$)"), "blk.$1.attn_q.weight"},
      {std::regex(R"(^layers\.(\d+)\.attention\.wk\.weight$)"), "blk.$1.attn_k.weight"},
      {std::regex(R"(^layers\.(\d+)\.attention\.wv\.weight$)"), "blk.$1.attn_v.weight"},
      {std::regex(R"(^layers\.(\d+)\.attention\.wo\.weight$)"), "blk.$1.attn_output.weight"},
      {std::regex(R"(^layers\.(\d+)\.feed_forward\.w1\.weight$)"), "blk.$1.ffn_gate.weight"},
      {std::regex(R"(^layers\.(\d+)\.feed_forward\.w2\.weight$)"), "blk.$1.ffn_down.weight"},
      {std::regex(R"(^layers\.(\d+)\.feed_forward\.w3\.weight$)"), "blk.$1.ffn_up.weight"},
      {std::regex(R"(^layers\.(\d+)\.attention_norm\.weight$)"), "blk.$1.attn_norm.weight"},
      {std::regex(R"(^layers\.(\d+)\.ffn_norm\.weight$)"), "blk.$1.ffn_norm.weight"},
  };
  for (const auto& [re, out] : rules)
    if (std::regex_match(p, re))
      return std::regex_replace(p, re, out);
  return "";
}

void load_gguf(const gguf::File& f, Llama& model) {
  torch::NoGradGuard no_grad;
  for (const auto& s : fsdp::param_shards(*model)) {
    const auto name = gguf_name(s.name);
    if (name.empty())
      throw gguf::FormatError(f.path() + ": no GGUF name for parameter '" + s.name + "'");
    const auto& t = f.tensor(name);
    if (t.shape != s.global_shape)
      throw gguf::FormatError(f.path() + ": tensor '" + name + "' has another shape than '" +
                              s.name + "'");
    if (s.rows > 0)
      s.shard.copy_(f.read(name, s.row_begin, s.rows).view(s.shard.sizes()));
  }
}

}  // namespace fsdp_models
