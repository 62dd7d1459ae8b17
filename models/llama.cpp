// Llama-style model; see llama.h.
#include "llama.h"

#include <fsdp/fully_shard.h>
#include <fsdp/tensor_parallel/tp_ops.h>

#include "lean_ops.h"
#include "parallelize.h"

#include <cmath>
#include <stdexcept>

namespace fsdp_models {

// ---- Config -------------------------------------------------------------------------------

void LlamaConfig::validate() const {
  auto positive = [](int64_t v, const char* field) {
    TORCH_CHECK(v > 0, "LlamaConfig::", field, " must be positive, got ", v);
  };
  positive(vocab_size, "vocab_size");
  positive(max_seq_len, "max_seq_len");
  positive(dim, "dim");
  positive(n_layers, "n_layers");
  positive(n_heads, "n_heads");
  positive(n_kv_heads, "n_kv_heads");
  positive(ffn_hidden_dim, "ffn_hidden_dim");
  TORCH_CHECK(dim % n_heads == 0, "LlamaConfig::dim (", dim, ") must be a multiple of n_heads (",
              n_heads, ")");
  TORCH_CHECK(n_heads % n_kv_heads == 0, "LlamaConfig::n_heads (", n_heads,
              ") must be a multiple of n_kv_heads (", n_kv_heads, ")");
  TORCH_CHECK(head_dim() % 2 == 0, "LlamaConfig: head_dim = dim / n_heads = ", head_dim(),
              " must be even (RoPE rotates pairs)");
  TORCH_CHECK(rope_theta > 0, "LlamaConfig::rope_theta must be positive, got ", rope_theta);
}

int64_t LlamaConfig::num_params() const {
  const int64_t kv_dim = n_kv_heads * head_dim();
  const int64_t attention = dim * dim + 2 * dim * kv_dim + dim * dim;  // wq, wk, wv, wo
  const int64_t feed_forward = 3 * dim * ffn_hidden_dim;               // w1, w2, w3
  const int64_t norms = 2 * dim;                                       // attention, ffn
  int64_t n = vocab_size * dim + n_layers * (attention + feed_forward + norms) + dim;
  if (!tie_embeddings)
    n += vocab_size * dim;
  return n;
}

LlamaConfig LlamaConfig::preset(const std::string& name) {
  LlamaConfig c;
  if (name == "llama-test") {
    // Rows 67 (vocab), 119 (ffn), 44 (dim) and 22 (kv) cover not divisible by 2, by 3 and by 4;
    // one k/v head for both query heads exercises grouped-query attention.
    c.vocab_size = 67, c.max_seq_len = 16, c.dim = 44, c.n_layers = 2, c.n_heads = 2;
    c.n_kv_heads = 1, c.ffn_hidden_dim = 119;
  } else if (name == "llama-tiny") {  // 2.6M parameters
    c.vocab_size = 512, c.max_seq_len = 256, c.dim = 192, c.n_layers = 6, c.n_heads = 6;
    c.n_kv_heads = 2, c.ffn_hidden_dim = 512;
  } else if (name == "llama-1b") {  // Llama 3.2 1B (its RoPE scaling is not modelled)
    c.vocab_size = 128256, c.max_seq_len = 131072, c.dim = 2048, c.n_layers = 16;
    c.n_heads = 32, c.n_kv_heads = 8, c.ffn_hidden_dim = 8192, c.rope_theta = 500000.0;
    c.tie_embeddings = true;
  } else if (name == "llama-7b") {  // Llama 2 7B
    c.vocab_size = 32000, c.max_seq_len = 4096, c.dim = 4096, c.n_layers = 32, c.n_heads = 32;
    c.n_kv_heads = 32, c.ffn_hidden_dim = 11008;
  } else if (name == "llama-13b") {  // Llama 2 13B
    c.vocab_size = 32000, c.max_seq_len = 4096, c.dim = 5120, c.n_layers = 40, c.n_heads = 40;
    c.n_kv_heads = 40, c.ffn_hidden_dim = 13824;
  } else if (name == "llama-70b") {  // Llama 2 70B
    c.vocab_size = 32000, c.max_seq_len = 4096, c.dim = 8192, c.n_layers = 80, c.n_heads = 64;
    c.n_kv_heads = 8, c.ffn_hidden_dim = 28672;
  } else {
    throw std::invalid_argument("unknown Llama preset '" + name +
                                "' (known: llama-test, llama-tiny, llama-1b, llama-7b, "
                                "llama-13b, llama-70b)");
  }
  c.validate();
  return c;
}

InitScheme llama_init_scheme(const LlamaConfig& cfg) {
  const double std = cfg.init_std;
  const double out_std = 1.0 / std::sqrt(static_cast<double>(cfg.dim));
  const bool tied = cfg.tie_embeddings;
  // The head's logits should start O(1): N(0, dim^-1/2) on a unit-RMS input.
  const InitRule head = InitRule::truncated_normal(out_std, 3 * out_std);
  return [=](const std::string& fqn) -> InitRule {
    if (fqn == "tok_embeddings.weight")
      return tied ? head : InitRule::normal(1.0);
    if (fqn == "output.weight")
      return head;
    if (fqn == "norm.weight" || fqn.ends_with("_norm.weight"))
      return InitRule::constant(1.0);
    // layers.<i>.<module>.<linear>.weight
    const std::string prefix = "layers.";
    if (fqn.starts_with(prefix) && fqn.ends_with(".weight")) {
      const auto dot = fqn.find('.', prefix.size());
      const int64_t layer = std::stoll(fqn.substr(prefix.size(), dot - prefix.size()));
      const std::string rest = fqn.substr(dot + 1);
      if (rest == "attention.wq.weight" || rest == "attention.wk.weight" ||
          rest == "attention.wv.weight" || rest == "feed_forward.w1.weight")
        return InitRule::truncated_normal(std, 2.0);
      // Outputs into the residual stream (and w3, which scales w1's gate): smaller with depth.
      if (rest == "attention.wo.weight" || rest == "feed_forward.w2.weight" ||
          rest == "feed_forward.w3.weight")
        return InitRule::truncated_normal(std / std::sqrt(2.0 * (layer + 1)), 2.0);
    }
    TORCH_CHECK(false, "llama_init_scheme: no rule for parameter '", fqn, "'");
  };
}

// ---- Rotary position embeddings -----------------------------------------------------------

RopeTables rope_tables(int64_t seq_len, int64_t head_dim, double theta, torch::Device device) {
  TORCH_CHECK(head_dim % 2 == 0, "rope_tables: head_dim ", head_dim, " must be even");
  auto f64 = torch::TensorOptions().dtype(torch::kDouble);
  auto freqs = torch::pow(theta, -torch::arange(0, head_dim, 2, f64) / head_dim);  // (D/2)
  auto angles = torch::outer(torch::arange(seq_len, f64), freqs);                  // (T, D/2)
  return {angles.cos().to(device, torch::kFloat), angles.sin().to(device, torch::kFloat)};
}

torch::Tensor apply_rotary_emb(const torch::Tensor& x, const RopeTables& rope) {
  TORCH_CHECK(x.dim() == 4, "apply_rotary_emb: x must be (B, T, H, D), got ", x.sizes());
  const int64_t t = x.size(1), half = x.size(3) / 2;
  TORCH_CHECK(rope.seq_len() == t && rope.cos.size(1) == half, "apply_rotary_emb: tables ",
              rope.cos.sizes(), " do not fit x ", x.sizes());
  auto pairs = x.to(torch::kFloat).unflatten(-1, {half, 2});  // (B, T, H, D/2, 2)
  auto x0 = pairs.select(-1, 0), x1 = pairs.select(-1, 1);    // (B, T, H, D/2)
  auto cos = rope.cos.view({1, t, 1, half}), sin = rope.sin.view({1, t, 1, half});
  auto rotated = torch::stack({x0 * cos - x1 * sin, x0 * sin + x1 * cos}, -1);  // (.., D/2, 2)
  return rotated.flatten(-2).to(x.scalar_type());                               // (B, T, H, D)
}

// ---- Model --------------------------------------------------------------------------------

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaConfig& cfg, const ModelInit& init)
    : head_dim_(cfg.head_dim()) {
  const int64_t kv_dim = cfg.n_kv_heads * head_dim_;
  wq = register_module("wq", Linear(cfg.dim, cfg.dim, /*bias=*/false, init));
  wk = register_module("wk", Linear(cfg.dim, kv_dim, /*bias=*/false, init));
  wv = register_module("wv", Linear(cfg.dim, kv_dim, /*bias=*/false, init));
  wo = register_module("wo", Linear(cfg.dim, cfg.dim, /*bias=*/false, init));
}

torch::Tensor LlamaAttentionImpl::forward(const torch::Tensor& x, const RopeTables& rope) {
  const int64_t b = x.size(0), t = x.size(1);
  // The heads this rank computes: all of them, or its part under tensor parallelism (the
  // projections then keep only those heads' rows; wo sums the heads' parts over the group).
  // With kv heads kept whole (tensor parallelism with fewer kv heads than ranks): the kv_count_
  // that this rank's query heads read. (Each projection right before its use, as without
  // tensor parallelism: the order of the buffers is what the planner's calibration measured.)
  auto kv_heads = [&](torch::Tensor y) {
    if (!kv_group_)
      return y;
    return fsdp::tp::copy_to_group(y, kv_group_)
        .narrow(-1, kv_first_ * head_dim_, kv_count_ * head_dim_);
  };
  // One copy of the input over the group for the split projections (share_input_copy); kv heads
  // kept whole are plain projections of x.
  const auto shared = input_group_ ? fsdp::tp::copy_to_group(x, input_group_) : x;
  const auto& kv_in = kv_group_ ? x : shared;
  auto q = apply_rotary_emb(wq(shared).view({b, t, -1, head_dim_}), rope);  // (B, T, H, D)
  auto k =
      apply_rotary_emb(kv_heads(wk(kv_in)).view({b, t, -1, head_dim_}), rope);  // (B, T, KV, D)
  auto v = kv_heads(wv(kv_in)).view({b, t, -1, head_dim_});                     // (B, T, KV, D)
  const int64_t n_heads = q.size(2), n_kv_heads = k.size(2);
  // enable_gqa: query head h reads k/v head h / (H / KV), as Meta's repeat_kv, without
  // materialising the repeated keys and values.
  auto y = at::scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                            /*attn_mask=*/{},
                                            /*dropout_p=*/0.0, /*is_causal=*/true,
                                            /*scale=*/std::nullopt,
                                            /*enable_gqa=*/n_kv_heads != n_heads);  // (B, H, T, D)
  return wo(y.transpose(1, 2).reshape({b, t, n_heads * head_dim_}));
}

void LlamaAttentionImpl::read_kv_heads(int64_t first, int64_t count,
                                       std::shared_ptr<fsdp::ProcessGroup> group) {
  TORCH_CHECK(
      group && count >= 1 && first >= 0 && (first + count) * head_dim_ <= wk->out_features(),
      "read_kv_heads: kv heads [", first, ", ", first + count, ") of ",
      wk->out_features() / head_dim_);
  kv_first_ = first, kv_count_ = count, kv_group_ = std::move(group);
}

void LlamaAttentionImpl::share_input_copy(std::shared_ptr<fsdp::ProcessGroup> group) {
  if (group) {
    wq->take_copied_input();
    if (!kv_group_) {
      wk->take_copied_input();
      wv->take_copied_input();
    }
  }
  input_group_ = std::move(group);
}

LlamaFeedForwardImpl::LlamaFeedForwardImpl(const LlamaConfig& cfg, const ModelInit& init) {
  w1 = register_module("w1", Linear(cfg.dim, cfg.ffn_hidden_dim, /*bias=*/false, init));
  w2 = register_module("w2", Linear(cfg.ffn_hidden_dim, cfg.dim, /*bias=*/false, init));
  w3 = register_module("w3", Linear(cfg.dim, cfg.ffn_hidden_dim, /*bias=*/false, init));
}

torch::Tensor LlamaFeedForwardImpl::forward(const torch::Tensor& x) {
  const auto shared = input_group_ ? fsdp::tp::copy_to_group(x, input_group_) : x;
  return w2(swiglu(w1(shared), w3(shared)));  // (B, T, F) inside; swiglu keeps only its inputs
}

void LlamaFeedForwardImpl::share_input_copy(std::shared_ptr<fsdp::ProcessGroup> group) {
  if (group) {
    w1->take_copied_input();
    w3->take_copied_input();
  }
  input_group_ = std::move(group);
}

LlamaBlockImpl::LlamaBlockImpl(const LlamaConfig& cfg, const ModelInit& init) {
  attention = register_module("attention", LlamaAttention(cfg, init));
  feed_forward = register_module("feed_forward", LlamaFeedForward(cfg, init));
  attention_norm = register_module("attention_norm", RMSNorm(cfg.dim, init, cfg.norm_eps));
  ffn_norm = register_module("ffn_norm", RMSNorm(cfg.dim, init, cfg.norm_eps));
}

torch::Tensor LlamaBlockImpl::forward(const torch::Tensor& x, const RopeTables& rope) {
  if (sequence_group) {  // x: this rank's positions; attention and the feed-forward see them all
    const auto whole = [&](const torch::Tensor& y) {
      return fsdp::tp::gather_from_group(y, 1, sequence_group);
    };
    auto h = x + attention(whole(attention_norm(x)), rope);
    return h + feed_forward(whole(ffn_norm(h)));
  }
  auto h = x + attention(attention_norm(x), rope);
  return h + feed_forward(ffn_norm(h));
}

LlamaImpl::LlamaImpl(const LlamaConfig& cfg, const ModelInit& init) : cfg_(cfg) {
  cfg.validate();
  tok_embeddings = register_module("tok_embeddings", Embedding(cfg.vocab_size, cfg.dim, init));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg.n_layers; ++i) {
    blocks.push_back(LlamaBlock(cfg, init));
    layers->push_back(blocks.back());  // registered as "<i>"
  }
  norm = register_module("norm", RMSNorm(cfg.dim, init, cfg.norm_eps));
  if (!cfg.tie_embeddings)
    output = register_module("output", Linear(cfg.dim, cfg.vocab_size, /*bias=*/false, init));
  if (init.device() != torch::kMeta)
    init_weights(init.resolve_seed());
}

void LlamaImpl::init_weights(uint64_t seed) {
  fsdp_models::init_weights(*this, llama_init_scheme(cfg_), seed);
}

RopeTables LlamaImpl::rope(int64_t t) {
  TORCH_CHECK(t <= cfg_.max_seq_len, "sequence of ", t, " tokens exceeds max_seq_len ",
              cfg_.max_seq_len);
  const auto device = tok_embeddings->weight.device();
  if (!rope_.cos.defined() || rope_.seq_len() < t || rope_.cos.device() != device)
    rope_ = rope_tables(t, cfg_.head_dim(), cfg_.rope_theta, device);
  return rope_.prefix(t);
}

torch::Tensor LlamaImpl::embed(const torch::Tensor& tokens) {
  return tok_embeddings(tokens);  // (B, T, dim)
}

torch::Tensor LlamaImpl::head(const torch::Tensor& h) {
  auto x = norm(h);
  if (sequence_group_)
    x = fsdp::tp::gather_from_group(x, 1, sequence_group_);
  // Tied head: the embedding matrix, inside the same (root) unit as the embedding.
  return cfg_.tie_embeddings ? tok_embeddings->attend(x) : output(x);  // (B, T, V)
}

torch::Tensor LlamaImpl::trunk(const torch::Tensor& tokens) {
  const RopeTables tables = rope(tokens.size(1));  // the whole sequence's: attention sees it all
  auto h = embed(tokens);
  for (auto& block : blocks)
    h = fsdp::forward(block, h, tables);
  return h;
}

torch::Tensor LlamaImpl::forward(const torch::Tensor& tokens) {
  return logits(tokens, 0, tokens.size(1));
}

torch::Tensor LlamaImpl::forward(const torch::Tensor& tokens, const LastLogits& last) {
  return logits(tokens, last.first_of(tokens.size(1), "Llama"), last.positions);
}

torch::Tensor LlamaImpl::logits(const torch::Tensor& tokens, int64_t from, int64_t count) {
  const auto x = positions_of(norm(trunk(pad_to_group(tokens, sequence_group_))), sequence_group_,
                              from, count);
  return cfg_.tie_embeddings ? tok_embeddings->attend(x) : output(x);  // as head()
}

torch::Tensor LlamaImpl::loss(const torch::Tensor& h, const LossSpec& spec) {
  auto x = norm(h);
  if (sequence_group_)
    x = fsdp::tp::gather_from_group(x, 1, sequence_group_);
  return head_loss(x, cfg_.tie_embeddings ? tok_embeddings->weight : torch::Tensor(), output, spec,
                   cfg_.tie_embeddings ? tok_embeddings->vocab_split() : output->vocab_split(),
                   /*sequence_gathered=*/sequence_group_ != nullptr);
}

void LlamaImpl::use_sequence_parallel(std::shared_ptr<fsdp::ProcessGroup> group) {
  TORCH_CHECK(group && tok_embeddings->vocab_split(),
              "use_sequence_parallel: split the model first (tensor_parallelize_llama)");
  TORCH_CHECK(cfg_.n_kv_heads % group->size() == 0, "use_sequence_parallel: ", cfg_.n_kv_heads,
              " kv heads kept whole over ", group->size(),
              " ranks: not with sequence parallelism yet");
  for (const auto& m : modules())
    if (auto* linear = dynamic_cast<LinearImpl*>(m.get()); linear && linear->is_tensor_parallel())
      linear->use_sequence_parallel();
  for (auto& block : blocks) {
    // The gather before attention and the feed-forward does the copy's work (its backward sums
    // the gradient over the group): no copy of their own.
    block->attention->share_input_copy(nullptr);
    block->feed_forward->share_input_copy(nullptr);
    block->attention_norm->sum_grads_over(group);
    block->ffn_norm->sum_grads_over(group);
    block->sequence_group = group;
  }
  tok_embeddings->use_sequence_parallel();
  norm->sum_grads_over(group);  // on this rank's positions; the head on the gathered sequence
  sequence_group_ = std::move(group);
}

torch::Tensor LlamaImpl::forward(const torch::Tensor& tokens, const LossSpec& spec) {
  return loss(trunk(tokens), spec);
}

}  // namespace fsdp_models

namespace fsdp_models {
std::vector<std::string> unit_paths(const LlamaConfig& cfg) {
  return detail::block_unit_paths("layers.", cfg.n_layers);
}

void parallelize_llama(Llama& model, const fsdp::FullyShardOptions& options) {
  parallelize_llama(model, options, options);
}

void parallelize_llama(Llama& model, const fsdp::FullyShardOptions& block_options,
                       const fsdp::FullyShardOptions& root_options, int64_t checkpoint_every) {
  detail::parallelize_blocks(model, block_options, root_options, checkpoint_every,
                             "parallelize_llama");
}
}  // namespace fsdp_models
