#include "gguf_llama.h"

#include <fsdp/state_dict.h>

#include <map>
#include <regex>

#include "nf4_load.h"

namespace fsdp_models {

namespace {

// The metadata against the file's own tensor table, before a model of those shapes is built:
// every tensor the model needs is there with the shape it needs, and no block lies beyond
// llama.block_count. Otherwise a block count of a million would build (and allocate) a
// million blocks before the first missing tensor is noticed.
void check_tensor_table(const gguf::File& f, const LlamaConfig& c) {
  const int64_t d = c.dim, kv = c.n_kv_heads * c.head_dim(), ffn = c.ffn_hidden_dim;
  auto expect = [&](const std::string& name, std::vector<int64_t> shape, const char* from) {
    if (!f.has_tensor(name))
      throw gguf::FormatError(f.path() + ": no tensor '" + name + "', which " + from + " implies");
    if (f.tensor(name).shape != shape) {
      std::string have, want;
      for (auto v : f.tensor(name).shape)
        have += (have.empty() ? "" : ", ") + std::to_string(v);
      for (auto v : shape)
        want += (want.empty() ? "" : ", ") + std::to_string(v);
      throw gguf::FormatError(f.path() + ": tensor '" + name + "' is [" + have + "], its llama.* " +
                              "metadata make it [" + want + "]");
    }
  };
  expect("token_embd.weight", {c.vocab_size, d}, "every model");
  expect("output_norm.weight", {d}, "every model");
  if (!c.tie_embeddings)
    expect("output.weight", {c.vocab_size, d}, "an untied head");
  const std::pair<const char*, std::vector<int64_t>> block[] = {
      {"attn_q", {d, d}},      {"attn_k", {kv, d}},    {"attn_v", {kv, d}},
      {"attn_output", {d, d}}, {"ffn_gate", {ffn, d}}, {"ffn_down", {d, ffn}},
      {"ffn_up", {ffn, d}},    {"attn_norm", {d}},     {"ffn_norm", {d}},
  };
  // Each block needs tensors of its own, so a block count larger than the table is refused
  // by the first missing one, after at most as many look-ups as the file has tensors.
  for (int64_t b = 0; b < c.n_layers; ++b)
    for (const auto& [part, shape] : block)
      expect("blk." + std::to_string(b) + "." + part + ".weight", shape, "llama.block_count");
  for (const auto& t : f.tensors()) {
    if (!t.name.starts_with("blk."))
      continue;
    const auto end = t.name.find('.', 4);
    const std::string index = t.name.substr(4, end == std::string::npos ? 0 : end - 4);
    if (index.empty() || index.size() > 9 ||
        index.find_first_not_of("0123456789") != std::string::npos ||
        std::stoll(index) >= c.n_layers)
      throw gguf::FormatError(f.path() + ": tensor '" + t.name + "' belongs to no block of the " +
                              std::to_string(c.n_layers) + " that llama.block_count says");
  }
}

}  // namespace

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
  try {
    c.validate();
  } catch (const c10::Error& e) {
    throw gguf::FormatError(path + ": its llama.* metadata describe no model: " + e.msg());
  }
  if (f.metadata().count("llama.rope.dimension_count") &&
      i("llama.rope.dimension_count") != c.head_dim())
    throw gguf::FormatError(key("llama.rope.dimension_count") +
                            " differs from the head dimension: partial rotary is not modelled");
  check_tensor_table(f, c);
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
  const auto shards = fsdp::param_shards(*model);
  for (const auto& s : shards) {
    if (is_lora_adapter(s.name) || !nf4_layer(s.name).empty())
      continue;  // adapters are not in the base model's file; NF4 layers are quantized below
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
  for (const auto& [layer, parts] : nf4_layers(shards)) {
    const auto name = gguf_name(layer + ".weight");
    const auto& info = f.tensor(name);
    const auto& codes = parts[0]->global_shape;
    if (info.shape.size() != 2 || info.shape != std::vector<int64_t>{codes[0], codes[1] * 2})
      throw gguf::FormatError(f.path() + ": tensor '" + name + "' has another shape than '" +
                              parts[0]->name + "' holds in NF4");
    load_nf4_layer(
        info.shape[0], info.shape[1],
        [&](int64_t row, int64_t rows) { return f.read(name, row, rows); }, parts);
  }
}

}  // namespace fsdp_models
