// Layers for the model zoo that can be built without memory, and initialisation by name.
//
// torch::nn::Linear, Embedding and LayerNorm allocate and initialise on the CPU in their
// constructors, so a 7B model cannot even be constructed on a small machine. The layers here
// create their parameters with the options of a ModelInit (device may be torch::kMeta: then
// nothing is allocated), keep torch::nn's parameter names ("weight", "bias"), and do not
// initialise anything: that is init_parameter()'s job.
//
// Initialisation is a pure function of (seed, parameter name, element index): every element is
// drawn from a counter-based generator keyed by the seed and a hash of the fully-qualified name.
// So the values do not depend on construction order, device, dtype (values are drawn in float32
// and cast) or on how the parameter is split: a deferred-init path can materialise any row range
// of any parameter, one at a time, on any number of ranks, and get the same numbers.
#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fsdp/tensor_parallel/vocab_parallel.h>

namespace fsdp_models {

// ---- Construction options -----------------------------------------------------------------

/// Where and in what dtype a model's parameters are created, and how the constructor
/// initialises them.
///
///   GPT cpu(cfg);                                               // float32 on CPU, initialised
///   Llama big(cfg, ModelInit().device(torch::kMeta));           // shapes only, no memory
///   Llama bf(cfg, ModelInit().dtype(torch::kBFloat16).seed(7)); // same values whatever the order
struct ModelInit {
  /// torch::kMeta builds shapes only: nothing is allocated and nothing is initialised.
  TORCH_ARG(torch::Device, device) = torch::kCPU;
  TORCH_ARG(torch::Dtype, dtype) = torch::kFloat32;
  /// Seed of the constructor's init_weights(). Unset: one number is drawn from LibTorch's
  /// global generator, so torch::manual_seed() decides the values as it does for torch::nn.
  TORCH_ARG(std::optional<uint64_t>, seed) = std::nullopt;

 public:  // TORCH_ARG leaves the section private
  torch::TensorOptions options() const {
    return torch::TensorOptions().device(device_).dtype(dtype_);
  }
  /// seed() if set, else a draw from the global generator.
  uint64_t resolve_seed() const;
};

// ---- Initialisation by name ---------------------------------------------------------------

/// How one parameter is filled.
struct InitRule {
  enum class Kind { kConstant, kNormal, kUniform };
  Kind kind = Kind::kNormal;
  double value = 0;  // kConstant
  double std = 0;    // kNormal: N(0, std^2)
  double bound = 0;  // kNormal: resample until |x| <= bound (truncated normal); 0 = no bound;
                     // kUniform: U(-bound, bound)

  static InitRule constant(double v) { return {Kind::kConstant, v, 0, 0}; }
  static InitRule normal(double std) { return {Kind::kNormal, 0, std, 0}; }
  static InitRule truncated_normal(double std, double bound) {
    return {Kind::kNormal, 0, std, bound};
  }
  static InitRule uniform(double bound) { return {Kind::kUniform, 0, 0, bound}; }
};

/// A model family's rule for each parameter, by fully-qualified name relative to the model
/// ("h0.attn.c_proj.weight"). Throws for a name it does not know, so a new parameter cannot
/// silently go uninitialised.
using InitScheme = std::function<InitRule(const std::string& fqn)>;

/// Fills `t` with the values of parameter `fqn` under `scheme` and `seed`. `t` may be the whole
/// parameter, or rows [first_row, first_row + t.size(0)) of it (a dim-0 shard, unpadded): the
/// values are the same as those rows of the whole. Any device and dtype; a meta tensor is left
/// alone. Cost: ~45 ns per random element per intra-op thread (scalar float64 Box-Muller, about
/// 10x torch's normal_), i.e. ~1 min of one core for 1B parameters, divided by the ranks when
/// each fills only its shard.
void init_parameter(const std::string& fqn, const torch::Tensor& t, const InitScheme& scheme,
                    uint64_t seed, int64_t first_row = 0);

/// init_parameter() for every parameter of `model`, named relative to it.
void init_weights(torch::nn::Module& model, const InitScheme& scheme, uint64_t seed);

/// Replaces every parameter of the layers below under `model` (typically on torch::kMeta)
/// with an uninitialised tensor of the same shape and `options`, keeping requires_grad. The
/// parameters are new tensor objects: call it before fully_shard() and before building an
/// optimizer. Throws, naming it, if a parameter is not owned by one of these layers.
void to_empty(torch::nn::Module& model, const torch::TensorOptions& options);

/// Like to_empty(), but each parameter becomes a placeholder of its full shape backed by one
/// element (all strides 0), so nothing of the model's size is allocated. Meant for fully_shard
/// with FullyShardOptions::param_init (see shard_initializer()): each rank then allocates and
/// fills only its own shard, and the full model never exists in any process.
void to_hollow(torch::nn::Module& model, const torch::TensorOptions& options);

/// A FullyShardOptions::param_init that fills each shard with init_parameter() under `scheme`
/// and `seed`, naming parameters relative to `model` (as init_weights() does). Build it after
/// to_hollow() and before fully_shard(): it recognises parameters by object.
std::function<void(const torch::Tensor&, const torch::Tensor&, int64_t)> shard_initializer(
    torch::nn::Module& model, InitScheme scheme, uint64_t seed);

// ---- Layers -------------------------------------------------------------------------------

/// Base of the layers below: parameters created from a ModelInit, re-creatable by to_empty().
class DeferredModule : public torch::nn::Module {
 public:
  /// Re-creates this module's own parameters with `options` (see to_empty()); `hollow`: as
  /// one-element placeholders of the full shape (see to_hollow()).
  void reset_to_empty(const torch::TensorOptions& options, bool hollow = false);

 protected:
  /// Registers an uninitialised parameter `name` of shape `sizes` and binds `slot` to it.
  void add_parameter(const std::string& name, torch::IntArrayRef sizes, const ModelInit& init,
                     torch::Tensor& slot);
  /// The same with a dtype of its own that reset_to_empty() keeps (packed storage, scales),
  /// and frozen.
  void add_fixed_parameter(const std::string& name, torch::Tensor value, torch::Tensor& slot);
  /// Unregisters parameter `name` and resets its slot.
  void remove_parameter(const std::string& name);
  /// Parameter `name` becomes `value` (a new tensor object, keeping requires_grad), in the
  /// registry and its slot: how tensor parallelism keeps a rank's part of a layer.
  void replace_parameter(const std::string& name, const torch::Tensor& value);

 private:
  // The member that mirrors each registered parameter, to re-point after reset_to_empty().
  // Modules live behind shared_ptrs and are never moved, so the addresses stay valid.
  struct Slot {
    std::string name;
    torch::Tensor* tensor;
    bool fixed_dtype;
  };
  std::vector<Slot> slots_;
};

/// LoRA adapters of a Linear (Hu et al. 2021): y = W x + (alpha / rank) B A dropout(x), with A
/// (rank, in) and B (out, rank) trainable and W frozen.
struct LoraOptions {
  TORCH_ARG(int64_t, rank) = 8;
  TORCH_ARG(double, alpha) = 16;
  /// Dropout on the adapters' input, in training mode only.
  TORCH_ARG(double, dropout) = 0;
};

/// Whether a parameter or module name lies in a LoRA adapter (its path has lora_A or lora_B, the
/// submodules LinearImpl::add_lora registers).
inline bool is_lora_adapter(const std::string& name) {
  return name.find("lora_A") != std::string::npos || name.find("lora_B") != std::string::npos;
}

/// y = x W^T + b, as torch::nn::Linear; optionally with LoRA adapters (add_lora) and the weight
/// stored in NF4 (use_nf4).
class LinearImpl : public DeferredModule {
 public:
  LinearImpl(int64_t in_features, int64_t out_features, bool bias, const ModelInit& init);
  torch::Tensor forward(const torch::Tensor& x);  // (..., in) -> (..., out)

  /// Registers the adapters as submodules lora_A and lora_B (Linears without bias, so their
  /// parameters are "lora_A.weight" and "lora_B.weight", PEFT's names), created with `init`'s
  /// device and dtype and not initialised (see lora_init_scheme()). Freezes weight and bias.
  void add_lora(const LoraOptions& options, const ModelInit& init);
  bool has_lora() const { return lora_A != nullptr; }
  double lora_scaling() const { return lora_alpha_ / static_cast<double>(lora_rank_); }

  /// Replaces `weight` by its NF4 storage (fsdp/quant/nf4.h), four frozen parameters: weight_nf4
  /// (uint8, out x in/2), weight_absmax (uint8, out*in/64), weight_absmax_scale and
  /// weight_absmax_offset (1) (float32 values held as their int32 bit patterns, so that mixed
  /// precision, which casts floating parameters, leaves them exact). in_features must be a multiple
  /// of 64, so that every row holds whole blocks and each rank can quantize its own rows. With
  /// quantize, the current weight's values are quantized (it must hold values); otherwise the
  /// parameters are created empty on `device` for a loader to fill.
  void use_nf4(bool quantize, torch::Device device = torch::kCPU);
  bool is_nf4() const { return weight_nf4.defined(); }
  /// The weight as the forward uses it: dequantized if in NF4.
  torch::Tensor dense_weight(torch::ScalarType dtype) const;

  /// Tensor parallelism (Megatron's layout; models/tensor_parallel.h applies it to whole
  /// models). Column-parallel: keeps the output features `rows` (ranges of the whole layer's,
  /// concatenated in order: a fused q/k/v projection keeps its heads of each of the three) of
  /// weight and bias; forward takes tp::copy_to_group(x) and returns this rank's features.
  /// Row-parallel: keeps input features [first, first + size); forward takes x holding only
  /// those features (a column-parallel layer's output), sums the ranks' partial products
  /// (tp::reduce_from_group), then adds the bias, which every rank keeps whole. The layer's values
  /// must be those of the whole layer (call before fully_shard and before building an optimizer);
  /// not in NF4. LoRA adapters (added before) are split with the weight, as PEFT's LoRA on
  /// Megatron's layers: lora_B keeps the output rows of a column-parallel layer and lora_A is
  /// whole; lora_A keeps the input columns of a row-parallel one and lora_B is whole.
  void split_output_features(const std::vector<std::pair<int64_t, int64_t>>& rows,
                             std::shared_ptr<fsdp::ProcessGroup> group);
  /// Column-parallel over the words of `split` (a language-model head): forward gathers the
  /// whole logits; a fused loss reads vocab_split() and computes on this rank's words alone.
  void split_vocabulary(fsdp::tp::VocabSplit split);
  /// The head's split, or nullptr.
  const fsdp::tp::VocabSplit* vocab_split() const { return vocab_ ? &*vocab_ : nullptr; }
  void split_input_features(int64_t first, int64_t size, std::shared_ptr<fsdp::ProcessGroup> group);
  bool is_tensor_parallel() const { return tp_ != TpSplit::kNone; }
  /// Sequence parallelism, on a split layer without adapters: column-parallel, the input is the
  /// whole sequence gathered by the caller (tp::gather_from_group, whose backward sums this
  /// rank's part of the gradient with the others'), so no copy_to_group; row-parallel, the
  /// partial sums are reduce-scattered along dim 1 (the sequence) instead of all-reduced, and
  /// the bias, added to this rank's positions only, gets its gradient summed over the group.
  void use_sequence_parallel();
  /// Column-parallel, on a layer without adapters: the caller passes the input already through
  /// tp::copy_to_group, one copy for the several column-parallel layers that read the same input
  /// (Llama's q, k and v; w1 and w3), so that backward all-reduces the input's gradient once,
  /// summed over them, instead of once per layer (what Megatron's fused QKV layer does). The
  /// forward then takes x as it is.
  void take_copied_input();
  /// The parameters that hold a different part on each rank of the group: the weight, the
  /// bias of a column-parallel layer (a row-parallel one keeps it whole), and the adapter split
  /// with the weight (lora_B on a column-parallel layer, lora_A on a row-parallel one). Empty
  /// when not split.
  std::vector<torch::Tensor> split_parameters() const;

  /// This rank's features (the whole layer's when not tensor-parallel).
  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }

  torch::Tensor weight;  // (out, in); undefined when in NF4
  torch::Tensor bias;    // (out), undefined without bias
  torch::Tensor weight_nf4, weight_absmax, weight_absmax_scale, weight_absmax_offset;
  std::shared_ptr<LinearImpl> lora_A, lora_B;

 private:
  enum class TpSplit { kNone, kColumn, kRow };
  void require_plain(const char* what) const;
  torch::Tensor split_forward(const torch::Tensor& x);

  int64_t in_features_, out_features_;
  TpSplit tp_ = TpSplit::kNone;
  bool sequence_parallel_ = false;
  bool input_copied_ = false;  // take_copied_input()
  std::shared_ptr<fsdp::ProcessGroup> tp_group_;
  std::optional<fsdp::tp::VocabSplit> vocab_;  // a vocabulary-parallel head: gathers its output
  int64_t lora_rank_ = 0;
  double lora_alpha_ = 0, lora_dropout_ = 0;
};
TORCH_MODULE(Linear);

/// A lookup table, as torch::nn::Embedding (no padding index, no max norm).
class EmbeddingImpl : public DeferredModule {
 public:
  EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim, const ModelInit& init);
  torch::Tensor forward(const torch::Tensor& idx);  // (...) int64 -> (..., dim)
  /// h (..., dim) times the table's transpose: the logits (..., num) of a head tied to it.
  torch::Tensor attend(const torch::Tensor& h);

  /// Vocabulary parallelism: keeps this rank's rows (fsdp::tp::VocabShard::of); forward looks
  /// up with tp::vocab_parallel_embedding, and attend() computes this rank's logits of
  /// tp::copy_to_group(h) and gathers the whole. The values must be the whole table's (call
  /// before fully_shard and before building an optimizer).
  void split_vocabulary(std::shared_ptr<fsdp::ProcessGroup> group);
  /// The split, or nullptr when the table is whole.
  const fsdp::tp::VocabSplit* vocab_split() const { return vocab_ ? &*vocab_ : nullptr; }
  /// Sequence parallelism on a split table: forward reduce-scatters the looked-up rows along dim
  /// 1 (each rank gets its positions), and attend() takes the whole sequence gathered by the
  /// caller (no copy_to_group: the gather's backward sums the gradient's parts).
  void use_sequence_parallel();

  torch::Tensor weight;  // (num, dim): this rank's rows when split

 private:
  std::optional<fsdp::tp::VocabSplit> vocab_;
  bool sequence_parallel_ = false;
};
TORCH_MODULE(Embedding);

/// LayerNorm over the last dimension with weight and bias, as torch::nn::LayerNorm({dim}).
class LayerNormImpl : public DeferredModule {
 public:
  LayerNormImpl(int64_t dim, const ModelInit& init, double eps = 1e-5);
  torch::Tensor forward(const torch::Tensor& x);  // (..., dim) -> (..., dim)
  /// Sequence parallelism: the input holds this rank's positions only, so the weights'
  /// gradients are summed over `group` (tp::copy_to_group on them in forward).
  void sum_grads_over(std::shared_ptr<fsdp::ProcessGroup> group) { grad_group_ = std::move(group); }

  torch::Tensor weight;  // (dim)
  torch::Tensor bias;    // (dim)

 private:
  int64_t dim_;
  double eps_;
  std::shared_ptr<fsdp::ProcessGroup> grad_group_;
};
TORCH_MODULE(LayerNorm);

/// x / sqrt(mean(x^2) + eps) * weight over the last dimension (Llama's norm), normalised in
/// float32 whatever the input dtype.
class RMSNormImpl : public DeferredModule {
 public:
  RMSNormImpl(int64_t dim, const ModelInit& init, double eps = 1e-5);
  torch::Tensor forward(const torch::Tensor& x);  // (..., dim) -> (..., dim)
  /// As LayerNormImpl::sum_grads_over.
  void sum_grads_over(std::shared_ptr<fsdp::ProcessGroup> group) { grad_group_ = std::move(group); }

  torch::Tensor weight;  // (dim)

 private:
  int64_t dim_;
  double eps_;
  std::shared_ptr<fsdp::ProcessGroup> grad_group_;
};
TORCH_MODULE(RMSNorm);

}  // namespace fsdp_models
