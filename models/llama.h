// Llama-style language model: RMSNorm, rotary position embeddings, SwiGLU MLP, grouped-query
// attention, untied output head by default.
//
// Parameter names follow Meta's checkpoints and torchtitan (tok_embeddings,
// layers.<i>.attention.{wq,wk,wv,wo}, layers.<i>.feed_forward.{w1,w2,w3},
// layers.<i>.{attention_norm,ffn_norm}, norm, output), and RoPE rotates interleaved pairs
// (x[2i], x[2i+1]) as Meta's complex-number formulation does, so those checkpoints map over
// name for name. Single-device code as gpt.h: blocks are called through fsdp::forward and
// parallelize_llama() applies FSDP from outside. Not modelled: Llama 3.1+'s RoPE frequency
// scaling for long contexts, KV caches, dropout.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "chunked_loss.h"
#include "last_logits.h"
#include "layers.h"

namespace fsdp_models {

struct LlamaConfig {
  int64_t vocab_size = 256;
  int64_t max_seq_len = 64;  // longest sequence forward() accepts
  int64_t dim = 64;          // model width
  int64_t n_layers = 2;
  int64_t n_heads = 4;  // query heads; head_dim = dim / n_heads
  /// Key/value heads, dividing n_heads: n_heads is plain multi-head attention, fewer is
  /// grouped-query attention (each k/v head serves n_heads / n_kv_heads query heads).
  int64_t n_kv_heads = 2;
  int64_t ffn_hidden_dim = 172;  // SwiGLU width (w1, w3: dim -> ffn_hidden_dim)
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  /// Use tok_embeddings' matrix as the output head (Llama 3.2 1B/3B do), instead of `output`.
  bool tie_embeddings = false;
  double init_std = 0.02;

  int64_t head_dim() const { return dim / n_heads; }
  /// Throws, naming the field, if the shapes do not fit together.
  void validate() const;
  /// Exact parameter count, from the shapes alone.
  int64_t num_params() const;
  /// "llama-test" (tiny, sizes 2, 3 and 4 ranks do not divide), "llama-tiny" (demo, 2.6M),
  /// and real shapes: "llama-1b" (Llama 3.2 1B), "llama-7b" (Llama 2 7B), "llama-13b"
  /// (Llama 2 13B), "llama-70b" (Llama 2 70B).
  static LlamaConfig preset(const std::string& name);
};

/// torchtitan's initialisation: norms 1; tok_embeddings N(0, 1) (N(0, dim^-1/2) truncated at
/// 3 std when tied, since it is then the output head); wq, wk, wv, w1 N(0, init_std) truncated at
/// +-2; wo, w2, w3 of layer i N(0, init_std / sqrt(2 (i + 1))) truncated at +-2 (deeper layers
/// start smaller); output N(0, dim^-1/2) truncated at 3 std.
InitScheme llama_init_scheme(const LlamaConfig& cfg);

// ---- Rotary position embeddings -----------------------------------------------------------

/// The rotation of every (position, pair): angle pos * theta^(-2i / head_dim). Passed to the
/// blocks as one non-tensor argument, so fsdp::forward leaves it alone (tensor arguments are
/// routed through its autograd hook, which would make these constants require grad).
struct RopeTables {
  torch::Tensor cos, sin;  // (T, head_dim / 2), float32

  int64_t seq_len() const { return cos.size(0); }
  /// The first t positions.
  RopeTables prefix(int64_t t) const { return {cos.narrow(0, 0, t), sin.narrow(0, 0, t)}; }
  /// For fsdp::forward (fsdp/detail/tensor_visit.h): the tensors a block receives.
  template <typename F>
  void visit_tensors(F&& f) {
    f(cos);
    f(sin);
  }
};

/// The tables for positions [0, seq_len), computed in float64 (angles reach seq_len radians).
RopeTables rope_tables(int64_t seq_len, int64_t head_dim, double theta, torch::Device device);

/// Rotates each pair (x[2i], x[2i+1]) of the last dimension of x (B, T, H, D) by the angle of
/// its position t in `rope` (T positions). In float32; returns x's dtype.
torch::Tensor apply_rotary_emb(const torch::Tensor& x, const RopeTables& rope);

// ---- Model --------------------------------------------------------------------------------

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  LlamaAttentionImpl(const LlamaConfig& cfg, const ModelInit& init);
  /// x (B, T, dim), rope for T positions -> (B, T, dim), causal.
  torch::Tensor forward(const torch::Tensor& x, const RopeTables& rope);

  /// Tensor parallelism with fewer key/value heads than ranks (models/tensor_parallel.h): wk
  /// and wv stay whole, their outputs' gradients are summed over `group`, and this rank's
  /// query heads read kv heads [first, first + count).
  void read_kv_heads(int64_t first, int64_t count, std::shared_ptr<fsdp::ProcessGroup> group);
  /// Tensor parallelism, after the split (models/tensor_parallel.h): the input goes through one
  /// tp::copy_to_group over `group` for the column-parallel projections that read it (wq, and wk
  /// and wv when split; LinearImpl::take_copied_input), so backward all-reduces its gradient
  /// once instead of once per projection. Null: each projection copies it itself again (as
  /// sequence parallelism needs: its gather does the copy's work).
  void share_input_copy(std::shared_ptr<fsdp::ProcessGroup> group);

  Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr};

 private:
  int64_t head_dim_;
  int64_t kv_first_ = 0, kv_count_ = 0;  // read_kv_heads (count 0: every kv head computed)
  std::shared_ptr<fsdp::ProcessGroup> kv_group_;
  std::shared_ptr<fsdp::ProcessGroup> input_group_;  // share_input_copy
};
TORCH_MODULE(LlamaAttention);

/// SwiGLU: w2(silu(w1 x) * w3 x).
class LlamaFeedForwardImpl : public torch::nn::Module {
 public:
  LlamaFeedForwardImpl(const LlamaConfig& cfg, const ModelInit& init);
  torch::Tensor forward(const torch::Tensor& x);  // (B, T, dim) -> (B, T, dim)
  /// As LlamaAttentionImpl::share_input_copy, for w1 and w3.
  void share_input_copy(std::shared_ptr<fsdp::ProcessGroup> group);

  Linear w1{nullptr}, w2{nullptr}, w3{nullptr};

 private:
  std::shared_ptr<fsdp::ProcessGroup> input_group_;  // share_input_copy
};
TORCH_MODULE(LlamaFeedForward);

class LlamaBlockImpl : public torch::nn::Module {
 public:
  LlamaBlockImpl(const LlamaConfig& cfg, const ModelInit& init);
  /// x (B, T, dim), rope for T positions -> (B, T, dim).
  torch::Tensor forward(const torch::Tensor& x, const RopeTables& rope);

  LlamaAttention attention{nullptr};
  LlamaFeedForward feed_forward{nullptr};
  RMSNorm attention_norm{nullptr}, ffn_norm{nullptr};
  /// Sequence parallelism (LlamaImpl::use_sequence_parallel): x is this rank's positions; the
  /// norms' outputs are gathered over this group before attention and the feed-forward.
  std::shared_ptr<fsdp::ProcessGroup> sequence_group;
};
TORCH_MODULE(LlamaBlock);

class LlamaImpl : public torch::nn::Module {
 public:
  /// Builds the model with `init`'s device and dtype and, unless on the meta device,
  /// initialises it with init_weights(init.resolve_seed()).
  explicit LlamaImpl(const LlamaConfig& cfg, const ModelInit& init = {});
  /// tokens: (B, T) ids -> logits (B, T, vocab).
  torch::Tensor forward(const torch::Tensor& tokens);
  /// The loss instead of the logits, the head and its cross-entropy over chunks of positions
  /// (chunked_loss.h): the (B, T, V) logits are never alive at once.
  torch::Tensor forward(const torch::Tensor& tokens, const LossSpec& spec);
  /// The logits of the last `last.positions` positions only (B, k, vocab): sampling's forward.
  torch::Tensor forward(const torch::Tensor& tokens, const LastLogits& last);
  /// forward() in its three parts, for code that runs them apart (the planner's calibration):
  /// embed(tokens) -> each block with rope(T) -> head(h) is forward(tokens).
  torch::Tensor embed(const torch::Tensor& tokens);  // (B, T) -> (B, T, dim)
  RopeTables rope(int64_t t);                        // the tables of the first t positions
  torch::Tensor head(const torch::Tensor& h);        // (B, T, dim) -> (B, T, V)
  /// head(h) with its loss fused: forward(tokens, spec) is loss(trunk(tokens), spec).
  torch::Tensor loss(const torch::Tensor& h, const LossSpec& spec);  // (B, T, dim) -> scalar
  /// embed, then each block with rope(T): what both forwards share.
  torch::Tensor trunk(const torch::Tensor& tokens);  // (B, T) -> (B, T, dim)

  const LlamaConfig& config() const { return cfg_; }
  int64_t num_params() const { return cfg_.num_params(); }
  /// Re-initialises every parameter: the values depend only on `seed` and the names.
  void init_weights(uint64_t seed);
  /// Sequence parallelism on a model split by tensor_parallelize_llama over `group`, as
  /// GPTImpl::use_sequence_parallel; the kv heads must be split (not kept whole).
  void use_sequence_parallel(std::shared_ptr<fsdp::ProcessGroup> group);

  Embedding tok_embeddings{nullptr};
  torch::nn::ModuleList layers{nullptr};  // "layers.<i>", for the names
  std::vector<LlamaBlock> blocks;         // the same modules, typed
  RMSNorm norm{nullptr};
  Linear output{nullptr};  // only when embeddings are not tied

 private:
  // The logits of positions [from, from + count) of tokens', padded on the right for sequence
  // parallelism; the head's matmul only for them.
  torch::Tensor logits(const torch::Tensor& tokens, int64_t from, int64_t count);

  LlamaConfig cfg_;
  std::shared_ptr<fsdp::ProcessGroup> sequence_group_;  // use_sequence_parallel
  // RoPE tables for the longest sequence seen so far: derived from the config, so neither
  // parameters nor buffers (nothing to broadcast, shard, checkpoint or materialise).
  RopeTables rope_;
};
TORCH_MODULE(Llama);

}  // namespace fsdp_models

namespace fsdp {
struct FullyShardOptions;
}

namespace fsdp_models {
/// Applies FSDP to a Llama: one unit per block, then the root unit (embeddings, final norm and
/// output head, so a tied matrix lives in one unit).
void parallelize_llama(Llama& model, const fsdp::FullyShardOptions& options);
/// The same with the blocks' options apart from the root's (e.g. the root in fp32 over bf16
/// blocks, activation checkpointing on blocks only). Block i keeps block_options'
/// activation_checkpointing when i % checkpoint_every == 0 and gets none otherwise ("every k-th
/// block").
void parallelize_llama(Llama& model, const fsdp::FullyShardOptions& block_options,
                       const fsdp::FullyShardOptions& root_options, int64_t checkpoint_every = 1);
/// The module paths of the units parallelize_llama makes: "layers.0" ... "layers.<n_layers-1>",
/// then "" (the root); what fsdp::plan::describe_units takes.
std::vector<std::string> unit_paths(const LlamaConfig& cfg);
}  // namespace fsdp_models
