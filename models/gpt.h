// GPT-2 style language model (learned positions, LayerNorm, GELU MLP, tied embeddings).
//
// Single-device model code: the only FSDP-specific line is that blocks are called through
// fsdp::forward, which is a plain forward call when the model is not sharded. Parallelism is
// applied from outside by parallelize_gpt(). Built from the deferred-init layers of layers.h:
// GPT(cfg, ModelInit().device(torch::kMeta)) allocates nothing, and the initial values are a
// function of (seed, parameter name) only (gpt_init_scheme()).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "chunked_loss.h"
#include "last_logits.h"
#include "layers.h"

namespace fsdp_models {

struct GPTConfig {
  int64_t vocab_size = 256;
  int64_t block_size = 64;  // longest sequence
  int64_t n_layer = 2;
  int64_t n_head = 2;
  int64_t n_embd = 64;
  bool tie_embeddings = true;
  /// Bias on the q/k/v projection (GPT-2 has one). Its key part has an identically zero
  /// gradient (softmax ignores a constant added to every key), so under Adam it drifts on
  /// rounding noise; exact-equivalence tests turn it off.
  bool attn_bias = true;
  double init_std = 0.02;

  int64_t num_params() const;
  /// Tiny models for tests and demos; real GPT-2 shapes for the planner.
  static GPTConfig preset(const std::string& name);
};

/// GPT-2's initialisation: N(0, init_std) weights, zero biases, LayerNorm weights 1, and the
/// residual projections (attn.c_proj, mlp.c_proj) N(0, init_std / sqrt(2 n_layer)).
InitScheme gpt_init_scheme(const GPTConfig& cfg);

class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  CausalSelfAttentionImpl(const GPTConfig& cfg, const ModelInit& init);
  torch::Tensor forward(const torch::Tensor& x);  // (B, T, C) -> (B, T, C)

 private:
  int64_t head_dim_;
  Linear c_attn_{nullptr}, c_proj_{nullptr};
};
TORCH_MODULE(CausalSelfAttention);

class MLPImpl : public torch::nn::Module {
 public:
  MLPImpl(const GPTConfig& cfg, const ModelInit& init);
  torch::Tensor forward(const torch::Tensor& x);  // (B, T, C) -> (B, T, C)

 private:
  Linear c_fc_{nullptr}, c_proj_{nullptr};
};
TORCH_MODULE(MLP);

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const GPTConfig& cfg, const ModelInit& init);
  torch::Tensor forward(const torch::Tensor& x);  // (B, T, C) -> (B, T, C)

  LayerNorm ln_1{nullptr}, ln_2{nullptr};
  CausalSelfAttention attn{nullptr};
  MLP mlp{nullptr};
  /// Sequence parallelism (GPTImpl::use_sequence_parallel): x is this rank's positions; the
  /// norms' outputs are gathered over this group before attention and the MLP.
  std::shared_ptr<fsdp::ProcessGroup> sequence_group;
};
TORCH_MODULE(Block);

class GPTImpl : public torch::nn::Module {
 public:
  /// Builds the model with `init`'s device and dtype and, unless on the meta device,
  /// initialises it with init_weights(init.resolve_seed()).
  explicit GPTImpl(const GPTConfig& cfg, const ModelInit& init = {});
  /// idx: (B, T) token ids -> logits (B, T, vocab).
  torch::Tensor forward(const torch::Tensor& idx);
  /// The loss instead of the logits, the head and its cross-entropy over chunks of positions
  /// (chunked_loss.h): the (B, T, V) logits are never alive at once.
  torch::Tensor forward(const torch::Tensor& idx, const LossSpec& spec);
  /// The logits of the last `last.positions` positions only (B, k, vocab): sampling's forward.
  torch::Tensor forward(const torch::Tensor& idx, const LastLogits& last);
  /// forward() in its three parts, for code that runs them apart (the planner's calibration):
  /// embed(idx) -> each block -> head(x) is forward(idx).
  torch::Tensor embed(const torch::Tensor& idx);  // (B, T) -> (B, T, C)
  torch::Tensor head(const torch::Tensor& x);     // (B, T, C) -> (B, T, V)
  /// head(x) with its loss fused: forward(idx, spec) is loss(trunk(idx), spec).
  torch::Tensor loss(const torch::Tensor& x, const LossSpec& spec);  // (B, T, C) -> scalar
  /// embed, then each block: what both forwards share.
  torch::Tensor trunk(const torch::Tensor& idx);  // (B, T) -> (B, T, C)

  const GPTConfig& config() const { return cfg_; }
  int64_t num_params() const { return cfg_.num_params(); }
  /// Sequence parallelism (Korthikanti et al. 2022) on a model split by tensor_parallelize_gpt
  /// over `group`: between the blocks' parallel regions the residual stream holds each rank's
  /// 1/tp of the positions (the norms, residual adds and embeddings compute on those alone),
  /// gathered before each column-parallel layer and reduce-scattered after each row-parallel
  /// one. T must divide by the group's size for training; forward(idx) pads a shorter
  /// sequence on the right (a causal model's earlier logits do not see it).
  void use_sequence_parallel(std::shared_ptr<fsdp::ProcessGroup> group);
  /// Re-initialises every parameter: the values depend only on `seed` and the names.
  void init_weights(uint64_t seed);

  Embedding wte{nullptr}, wpe{nullptr};
  std::vector<Block> blocks;
  LayerNorm ln_f{nullptr};
  Linear lm_head{nullptr};  // only when embeddings are not tied

 private:
  // The logits of positions [from, from + count) of idx's, padded on the right for sequence
  // parallelism; the head's matmul only for them.
  torch::Tensor logits(const torch::Tensor& idx, int64_t from, int64_t count);

  GPTConfig cfg_;
  std::shared_ptr<fsdp::ProcessGroup> sequence_group_;  // use_sequence_parallel
};
TORCH_MODULE(GPT);

/// Mean next-token cross-entropy of logits (B, T, V) against targets (B, T).
torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& targets);

}  // namespace fsdp_models

namespace fsdp {
struct FullyShardOptions;
}

namespace fsdp_models {
/// Applies FSDP to a GPT the recommended way: one unit per block, then the root unit
/// (embeddings, final norm and the tied head together, so the tied weight lives in one unit).
void parallelize_gpt(GPT& model, const fsdp::FullyShardOptions& options);
/// The same with the blocks' options apart from the root's (e.g. the root in fp32 over bf16
/// blocks, activation checkpointing on blocks only). Block i keeps block_options'
/// activation_checkpointing when i % checkpoint_every == 0 and gets none otherwise ("every k-th
/// block").
void parallelize_gpt(GPT& model, const fsdp::FullyShardOptions& block_options,
                     const fsdp::FullyShardOptions& root_options, int64_t checkpoint_every = 1);
/// The module paths of the units parallelize_gpt makes: "h0" ... "h<n_layer-1>", then "" (the
/// root); what fsdp::plan::describe_units takes.
std::vector<std::string> unit_paths(const GPTConfig& cfg);
}  // namespace fsdp_models
