// GPT-2 style model; see gpt.h.
#include "gpt.h"

#include <fsdp/tensor_parallel/tp_ops.h>

#include <fsdp/fully_shard.h>

#include "parallelize.h"

#include <cmath>
#include <stdexcept>

namespace fsdp_models {

int64_t GPTConfig::num_params() const {
  const int64_t c = n_embd;
  const int64_t per_block = 2 * 2 * c + (c * 3 * c + (attn_bias ? 3 * c : 0)) + (c * c + c) +
                            (c * 4 * c + 4 * c) + (4 * c * c + c);
  int64_t n = vocab_size * c + block_size * c + n_layer * per_block + 2 * c;
  if (!tie_embeddings)
    n += vocab_size * c;
  return n;
}

GPTConfig GPTConfig::preset(const std::string& name) {
  GPTConfig c;
  if (name == "gpt2-test") {  // sizes that 2, 3 and 4 ranks do not divide
    c.vocab_size = 67, c.block_size = 16, c.n_layer = 2, c.n_head = 2, c.n_embd = 22;
  } else if (name == "gpt2-tiny") {
    c.vocab_size = 512, c.block_size = 128, c.n_layer = 4, c.n_head = 4, c.n_embd = 128;
  } else if (name == "gpt2-small") {
    c.vocab_size = 2048, c.block_size = 256, c.n_layer = 6, c.n_head = 6, c.n_embd = 384;
  } else if (name == "gpt2-124m") {
    c.vocab_size = 50257, c.block_size = 1024, c.n_layer = 12, c.n_head = 12, c.n_embd = 768;
  } else if (name == "gpt2-350m") {
    c.vocab_size = 50257, c.block_size = 1024, c.n_layer = 24, c.n_head = 16, c.n_embd = 1024;
  } else if (name == "gpt2-1.5b") {
    c.vocab_size = 50257, c.block_size = 1024, c.n_layer = 48, c.n_head = 25, c.n_embd = 1600;
  } else {
    throw std::invalid_argument("unknown GPT preset '" + name +
                                "' (known: gpt2-test, gpt2-tiny, gpt2-small, gpt2-124m, "
                                "gpt2-350m, gpt2-1.5b)");
  }
  return c;
}

InitScheme gpt_init_scheme(const GPTConfig& cfg) {
  const double std = cfg.init_std;
  // Each residual branch adds to the stream, 2 per layer: scale them so the sum stays O(1).
  const double residual_std = cfg.init_std / std::sqrt(2.0 * cfg.n_layer);
  return [=](const std::string& fqn) -> InitRule {
    const auto dot = fqn.rfind('.');
    const std::string owner = dot == std::string::npos ? "" : fqn.substr(0, dot);
    const std::string leaf = dot == std::string::npos ? fqn : fqn.substr(dot + 1);
    const std::string layer = owner.substr(owner.rfind('.') + 1);  // npos + 1 == 0: all of it
    if (leaf == "bias")
      return InitRule::constant(0.0);
    if (leaf == "weight" && layer.starts_with("ln_"))
      return InitRule::constant(1.0);
    if (leaf == "weight" && layer == "c_proj")
      return InitRule::normal(residual_std);
    if (leaf == "weight" && (layer == "wte" || layer == "wpe" || layer == "c_attn" ||
                             layer == "c_fc" || layer == "lm_head"))
      return InitRule::normal(std);
    TORCH_CHECK(false, "gpt_init_scheme: no rule for parameter '", fqn, "'");
  };
}

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GPTConfig& cfg, const ModelInit& init)
    : head_dim_(cfg.n_embd / cfg.n_head) {
  TORCH_CHECK(cfg.n_embd % cfg.n_head == 0, "n_embd (", cfg.n_embd,
              ") must be a multiple of n_head (", cfg.n_head, ")");
  c_attn_ = register_module("c_attn", Linear(cfg.n_embd, 3 * cfg.n_embd, cfg.attn_bias, init));
  c_proj_ = register_module("c_proj", Linear(cfg.n_embd, cfg.n_embd, /*bias=*/true, init));
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x) {
  const auto b = x.size(0), t = x.size(1);
  auto fused = c_attn_(x);
  // This rank's heads' width: all of C, or C / tp when c_attn keeps only its heads of q, k, v
  // (tensor parallelism; c_proj then sums the heads' parts over the group).
  const auto c = fused.size(2) / 3;
  auto qkv = fused.split(c, /*dim=*/2);  // 3 x (B, T, c)
  auto heads = [&](const torch::Tensor& y) {
    return y.view({b, t, c / head_dim_, head_dim_}).transpose(1, 2);  // (B, H, T, D)
  };
  auto y = at::scaled_dot_product_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]),
                                            /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                            /*is_causal=*/true);
  return c_proj_(y.transpose(1, 2).contiguous().view({b, t, c}));
}

MLPImpl::MLPImpl(const GPTConfig& cfg, const ModelInit& init) {
  c_fc_ = register_module("c_fc", Linear(cfg.n_embd, 4 * cfg.n_embd, /*bias=*/true, init));
  c_proj_ = register_module("c_proj", Linear(4 * cfg.n_embd, cfg.n_embd, /*bias=*/true, init));
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) {
  return c_proj_(torch::gelu(c_fc_(x), "tanh"));  // (B, T, 4C) inside
}

BlockImpl::BlockImpl(const GPTConfig& cfg, const ModelInit& init) {
  ln_1 = register_module("ln_1", LayerNorm(cfg.n_embd, init));
  attn = register_module("attn", CausalSelfAttention(cfg, init));
  ln_2 = register_module("ln_2", LayerNorm(cfg.n_embd, init));
  mlp = register_module("mlp", MLP(cfg, init));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x) {
  if (sequence_group) {  // x: this rank's positions; attention and the MLP see them all
    const auto whole = [&](const torch::Tensor& y) {
      return fsdp::tp::gather_from_group(y, 1, sequence_group);
    };
    auto h = x + attn(whole(ln_1(x)));
    return h + mlp(whole(ln_2(h)));
  }
  auto h = x + attn(ln_1(x));
  return h + mlp(ln_2(h));
}

GPTImpl::GPTImpl(const GPTConfig& cfg, const ModelInit& init) : cfg_(cfg) {
  wte = register_module("wte", Embedding(cfg.vocab_size, cfg.n_embd, init));
  wpe = register_module("wpe", Embedding(cfg.block_size, cfg.n_embd, init));
  for (int64_t i = 0; i < cfg.n_layer; ++i) {
    // Appending, not "h" + std::to_string(i): GCC 12 reports a false -Wrestrict on the latter.
    std::string name = "h";
    name.append(std::to_string(i));
    blocks.push_back(register_module(name, Block(cfg, init)));
  }
  ln_f = register_module("ln_f", LayerNorm(cfg.n_embd, init));
  if (!cfg.tie_embeddings) {
    lm_head = register_module("lm_head", Linear(cfg.n_embd, cfg.vocab_size, /*bias=*/false, init));
  }
  if (init.device() != torch::kMeta)
    init_weights(init.resolve_seed());
}

void GPTImpl::init_weights(uint64_t seed) {
  fsdp_models::init_weights(*this, gpt_init_scheme(cfg_), seed);
}

torch::Tensor GPTImpl::embed(const torch::Tensor& idx) {
  const auto t = idx.size(1);
  TORCH_CHECK(t <= cfg_.block_size, "sequence of ", t, " tokens exceeds block_size ",
              cfg_.block_size);
  auto pos = torch::arange(t, idx.options().dtype(torch::kLong));
  if (sequence_group_)  // this rank's positions: the words' rows reduce-scattered, its slice of wpe
    return wte(idx) + fsdp::tp::split_to_group(wpe(pos), 0, sequence_group_).unsqueeze(0);
  return wte(idx) + wpe(pos);  // (B, T, C)
}

torch::Tensor GPTImpl::head(const torch::Tensor& x) {
  auto h = ln_f(x);
  if (sequence_group_)
    h = fsdp::tp::gather_from_group(h, 1, sequence_group_);
  // Tied head: the embedding matrix, used inside the same (root) unit as the embedding.
  return cfg_.tie_embeddings ? wte->attend(h) : lm_head(h);
}

torch::Tensor GPTImpl::trunk(const torch::Tensor& idx) {
  auto x = embed(idx);
  for (auto& block : blocks)
    x = fsdp::forward(block, x);
  return x;
}

torch::Tensor GPTImpl::forward(const torch::Tensor& idx) {
  return logits(idx, 0, idx.size(1));
}

torch::Tensor GPTImpl::forward(const torch::Tensor& idx, const LastLogits& last) {
  return logits(idx, last.first_of(idx.size(1), "GPT"), last.positions);
}

torch::Tensor GPTImpl::logits(const torch::Tensor& idx, int64_t from, int64_t count) {
  const auto h =
      positions_of(ln_f(trunk(pad_to_group(idx, sequence_group_))), sequence_group_, from, count);
  return cfg_.tie_embeddings ? wte->attend(h) : lm_head(h);  // as head()
}

torch::Tensor GPTImpl::loss(const torch::Tensor& x, const LossSpec& spec) {
  auto h = ln_f(x);
  if (sequence_group_)
    h = fsdp::tp::gather_from_group(h, 1, sequence_group_);
  return head_loss(h, cfg_.tie_embeddings ? wte->weight : torch::Tensor(), lm_head, spec,
                   cfg_.tie_embeddings ? wte->vocab_split() : lm_head->vocab_split(),
                   /*sequence_gathered=*/sequence_group_ != nullptr);
}

void GPTImpl::use_sequence_parallel(std::shared_ptr<fsdp::ProcessGroup> group) {
  TORCH_CHECK(group && wte->vocab_split(),
              "use_sequence_parallel: split the model first (tensor_parallelize_gpt)");
  for (const auto& m : modules())
    if (auto* linear = dynamic_cast<LinearImpl*>(m.get()); linear && linear->is_tensor_parallel())
      linear->use_sequence_parallel();
  for (auto& block : blocks) {
    block->ln_1->sum_grads_over(group);
    block->ln_2->sum_grads_over(group);
    block->sequence_group = group;
  }
  wte->use_sequence_parallel();
  // ln_f computes on this rank's positions; the head on the gathered sequence.
  ln_f->sum_grads_over(group);
  sequence_group_ = std::move(group);
}

torch::Tensor GPTImpl::forward(const torch::Tensor& idx, const LossSpec& spec) {
  return loss(trunk(idx), spec);
}

torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                              targets.reshape({-1}));
}

}  // namespace fsdp_models

namespace fsdp_models {
std::vector<std::string> unit_paths(const GPTConfig& cfg) {
  return detail::block_unit_paths("h", cfg.n_layer);
}

void parallelize_gpt(GPT& model, const fsdp::FullyShardOptions& options) {
  parallelize_gpt(model, options, options);
}

void parallelize_gpt(GPT& model, const fsdp::FullyShardOptions& block_options,
                     const fsdp::FullyShardOptions& root_options, int64_t checkpoint_every) {
  detail::parallelize_blocks(model, block_options, root_options, checkpoint_every,
                             "parallelize_gpt");
}
}  // namespace fsdp_models
