// Deferred-init layers and initialisation by name; see layers.h.
#include "layers.h"

#include "lean_ops.h"

#include <fsdp/quant/nf4.h>
#include <fsdp/tensor_parallel/tp_ops.h>

#include <unordered_map>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <numbers>

namespace fsdp_models {

// ---- Counter-based random numbers ---------------------------------------------------------
//
// Element i of a parameter is a function of (key, i) only, where key mixes the seed with a hash
// of the parameter's name. A stateful generator (mt19937) would make element i depend on every
// draw before it, so a shard could only be produced by generating the whole parameter.

namespace {

// A placeholder of to_hollow(): one element behind a shape of many (all strides 0).
bool is_hollow(const torch::Tensor& t) {
  return t.dim() > 0 && t.numel() > 1 && t.stride(0) == 0;
}

// FNV-1a: a fixed, platform-independent hash (std::hash<std::string> is neither).
uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

// splitmix64's finaliser: a bijection on 64 bits whose output bits all depend on all inputs.
uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// A standard normal for element `index`, attempt `attempt` (truncation resamples), by
// Box-Muller on the two 32-bit halves of one hash.
double standard_normal(uint64_t key, uint64_t index, uint64_t attempt) {
  const uint64_t h = mix64(mix64(key ^ mix64(index)) + attempt);
  const double u1 = (static_cast<double>(h >> 32) + 0.5) * 0x1p-32;  // (0, 1): log is finite
  const double u2 = static_cast<double>(h & 0xffffffffULL) * 0x1p-32;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

// out[j] = value of element first + j (normal or uniform), for a contiguous float32 CPU buffer.
void fill_random(float* out, int64_t n, uint64_t key, uint64_t first, const InitRule& rule) {
  // Resampling stops after this many draws and clamps: reached only for bounds below ~0.1 std.
  constexpr uint64_t kMaxAttempts = 64;
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const uint64_t index = first + static_cast<uint64_t>(j);
      if (rule.kind == InitRule::Kind::kUniform) {  // U(-bound, bound)
        const double u = static_cast<double>(mix64(key ^ mix64(index)) >> 11) * 0x1p-53;
        out[j] = static_cast<float>(rule.bound * (2.0 * u - 1.0));
        continue;
      }
      double x = rule.std * standard_normal(key, index, 0);
      for (uint64_t a = 1; rule.bound > 0 && std::abs(x) > rule.bound && a < kMaxAttempts; ++a)
        x = rule.std * standard_normal(key, index, a);
      if (rule.bound > 0)
        x = std::clamp(x, -rule.bound, rule.bound);
      out[j] = static_cast<float>(x);
    }
  });
}

}  // namespace

uint64_t ModelInit::resolve_seed() const {
  if (seed_)
    return *seed_;
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get<at::CPUGeneratorImpl>()->random64();
}

void init_parameter(const std::string& fqn, const torch::Tensor& t, const InitScheme& scheme,
                    uint64_t seed, int64_t first_row) {
  TORCH_CHECK(first_row >= 0, "init_parameter('", fqn, "'): first_row ", first_row, " is negative");
  TORCH_CHECK(first_row == 0 || t.dim() > 0, "init_parameter('", fqn,
              "'): a 0-dim tensor has no rows, first_row must be 0");
  const InitRule rule = scheme(fqn);
  torch::NoGradGuard no_grad;
  if (t.is_meta())
    return;
  if (rule.kind == InitRule::Kind::kConstant) {
    t.fill_(rule.value);
    return;
  }
  TORCH_CHECK(rule.std >= 0 && rule.bound >= 0, "init scheme for '", fqn,
              "': std and bound must be >= 0, got ", rule.std, " and ", rule.bound);
  const int64_t row_numel = t.dim() == 0 ? 1 : (t.size(0) == 0 ? 0 : t.numel() / t.size(0));
  const uint64_t key = mix64(seed ^ mix64(fnv1a(fqn)));
  // Fill in place when t already is a contiguous float32 CPU tensor, else through a buffer.
  const bool in_place =
      t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.is_contiguous();
  torch::Tensor buffer = in_place ? t : torch::empty(t.sizes(), torch::kFloat);
  fill_random(buffer.data_ptr<float>(), t.numel(), key,
              static_cast<uint64_t>(first_row * row_numel), rule);
  if (!in_place)
    t.copy_(buffer);
}

void init_weights(torch::nn::Module& model, const InitScheme& scheme, uint64_t seed) {
  for (auto& item : model.named_parameters(/*recurse=*/true))
    init_parameter(item.key(), item.value(), scheme, seed);
}

// ---- Re-creating parameters ---------------------------------------------------------------

void DeferredModule::add_parameter(const std::string& name, torch::IntArrayRef sizes,
                                   const ModelInit& init, torch::Tensor& slot) {
  slot = register_parameter(name, torch::empty(sizes, init.options()));
  slots_.push_back({name, &slot, false});
}

void DeferredModule::add_fixed_parameter(const std::string& name, torch::Tensor value,
                                         torch::Tensor& slot) {
  slot = register_parameter(name, std::move(value), /*requires_grad=*/false);
  slots_.push_back({name, &slot, true});
}

void DeferredModule::remove_parameter(const std::string& name) {
  parameters_.erase(name);
  for (auto it = slots_.begin(); it != slots_.end(); ++it) {
    if (it->name == name) {
      *it->tensor = torch::Tensor();
      slots_.erase(it);
      return;
    }
  }
}

void DeferredModule::replace_parameter(const std::string& name, const torch::Tensor& value) {
  for (auto& slot : slots_) {
    if (slot.name == name) {
      auto fresh = value.detach().clone();
      fresh.set_requires_grad(slot.tensor->requires_grad());
      parameters_[name] = fresh;
      *slot.tensor = fresh;
      return;
    }
  }
  TORCH_CHECK(false, "replace_parameter: no parameter '", name, "'");
}

void DeferredModule::reset_to_empty(const torch::TensorOptions& options, bool hollow) {
  // set_data() cannot move a parameter off the meta device (incompatible tensor types), so the
  // parameter objects are replaced, here and in the module's registry.
  for (auto& [name, slot, fixed_dtype] : slots_) {
    const auto sizes = slot->sizes().vec();
    auto o = options.requires_grad(false);
    if (fixed_dtype)
      o = o.dtype(slot->dtype());
    auto fresh = hollow ? torch::empty_strided(sizes, std::vector<int64_t>(sizes.size(), 0), o)
                        : torch::empty(sizes, o);
    fresh.set_requires_grad(slot->requires_grad());
    parameters_[name] = fresh;
    *slot = fresh;
  }
}

namespace {
void replace_parameters(torch::nn::Module& model, const torch::TensorOptions& options,
                        bool hollow) {
  model.apply([&](torch::nn::Module& m) {
    if (auto* layer = dynamic_cast<DeferredModule*>(&m)) {
      layer->reset_to_empty(options, hollow);
    } else {
      for (const auto& item : m.named_parameters(/*recurse=*/false)) {
        TORCH_CHECK(false, "to_empty: parameter '", item.key(), "' of ", m.name(),
                    " is not owned by a fsdp_models layer (Linear, Embedding, LayerNorm, "
                    "RMSNorm), so it cannot be re-created; build it from those layers");
      }
    }
  });
}
}  // namespace

void to_empty(torch::nn::Module& model, const torch::TensorOptions& options) {
  replace_parameters(model, options, /*hollow=*/false);
}

void to_hollow(torch::nn::Module& model, const torch::TensorOptions& options) {
  replace_parameters(model, options, /*hollow=*/true);
}

std::function<void(const torch::Tensor&, const torch::Tensor&, int64_t)> shard_initializer(
    torch::nn::Module& model, InitScheme scheme, uint64_t seed) {
  auto names = std::make_shared<std::unordered_map<const c10::TensorImpl*, std::string>>();
  for (const auto& item : model.named_parameters()) {
    names->emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  return [names, scheme = std::move(scheme), seed](const torch::Tensor& param,
                                                   const torch::Tensor& shard, int64_t first_row) {
    auto it = names->find(param.unsafeGetTensorImpl());
    TORCH_CHECK(it != names->end(), "shard_initializer: a parameter of shape ", param.sizes(),
                " is not one of the model's (build the initializer after to_hollow())");
    init_parameter(it->second, shard, scheme, seed, first_row);
  };
}

// ---- Layers -------------------------------------------------------------------------------

LinearImpl::LinearImpl(int64_t in_features, int64_t out_features, bool with_bias,
                       const ModelInit& init)
    : in_features_(in_features), out_features_(out_features) {
  add_parameter("weight", {out_features, in_features}, init, weight);
  if (with_bias)
    add_parameter("bias", {out_features}, init, bias);
}

torch::Tensor LinearImpl::forward(const torch::Tensor& x) {
  if (tp_ != TpSplit::kNone)
    return split_forward(x);
  torch::Tensor y;
  if (is_nf4()) {
    y = fsdp::nf4::linear(x, weight_nf4, weight_absmax, weight_absmax_scale.view(torch::kFloat32),
                          weight_absmax_offset.view(torch::kFloat32), out_features_, in_features_);
    if (bias.defined())
      y = y + bias.to(y.scalar_type());
  } else if (weight.scalar_type() != x.scalar_type() && !weight.requires_grad()) {
    // A frozen base kept in another dtype than the computation (bf16 under fp32 adapters).
    y = torch::nn::functional::linear(x, weight.to(x.scalar_type()),
                                      bias.defined() ? bias.to(x.scalar_type()) : torch::Tensor());
  } else {
    y = torch::nn::functional::linear(x, weight, bias);
  }
  if (lora_A) {
    auto h = lora_dropout_ > 0 ? torch::dropout(x, lora_dropout_, is_training()) : x;
    y = y + lora_B->forward(lora_A->forward(h)) * lora_scaling();
  }
  return y;
}

// The adapters follow the weight, as PEFT's LoRA on Megatron's parallel layers: on a
// column-parallel layer lora_A is whole and lora_B keeps the layer's output rows; on a
// row-parallel one lora_A keeps its input columns and lora_B is whole. Each path's split
// product is made whole as the weight's is, so the whole adapters get the whole gradient.
torch::Tensor LinearImpl::split_forward(const torch::Tensor& x) {
  // A frozen base kept in another dtype than the computation (bf16 under fp32 adapters).
  const auto w = weight.scalar_type() != x.scalar_type() && !weight.requires_grad()
                     ? weight.to(x.scalar_type())
                     : weight;
  const auto b = bias.defined() && bias.scalar_type() != x.scalar_type() && !bias.requires_grad()
                     ? bias.to(x.scalar_type())
                     : bias;
  const auto lora_in = [&] {
    return lora_dropout_ > 0 ? torch::dropout(x, lora_dropout_, is_training()) : x;
  };
  if (tp_ == TpSplit::kColumn) {
    auto y = torch::nn::functional::linear(
        sequence_parallel_ || input_copied_ ? x : fsdp::tp::copy_to_group(x, tp_group_), w, b);
    if (lora_A) {
      auto h = fsdp::tp::copy_to_group(lora_A->forward(lora_in()), tp_group_);
      y = y + lora_B->forward(h) * lora_scaling();
    }
    return vocab_ ? fsdp::tp::gather_last_dim(y, vocab_->shard.sizes, tp_group_) : y;
  }
  if (sequence_parallel_) {  // this rank's positions of the sum, and of the bias's gradient
    auto y = fsdp::tp::reduce_scatter_to_group(torch::nn::functional::linear(x, w), 1, tp_group_);
    return b.defined() ? y + fsdp::tp::copy_to_group(b, tp_group_) : y;
  }
  auto y = fsdp::tp::reduce_from_group(torch::nn::functional::linear(x, w), tp_group_);
  if (lora_A)
    y = y + lora_B->forward(fsdp::tp::reduce_from_group(lora_A->forward(lora_in()), tp_group_)) *
                lora_scaling();
  return b.defined() ? y + b : y;
}

void LinearImpl::take_copied_input() {
  TORCH_CHECK(tp_ == TpSplit::kColumn && !vocab_,
              "take_copied_input: this Linear is not split column-parallel");
  // An adapter's path reads the input too, and needs the uncopied one (its lora_A gradient is
  // summed over the group on its own output).
  TORCH_CHECK(!lora_A, "take_copied_input: not on a layer with LoRA adapters");
  input_copied_ = true;
}

void LinearImpl::use_sequence_parallel() {
  TORCH_CHECK(tp_ != TpSplit::kNone,
              "use_sequence_parallel: this Linear is not split for tensor parallelism");
  TORCH_CHECK(!lora_A, "use_sequence_parallel: not with LoRA adapters yet");
  sequence_parallel_ = true;
}

void LinearImpl::require_plain(const char* what) const {
  TORCH_CHECK(tp_ == TpSplit::kNone, what, ": this Linear is already split for tensor parallelism");
  TORCH_CHECK(!is_nf4(), what, ": tensor parallelism does not take a Linear in NF4 yet");
  // On the meta device the split is shapes only (a deferred build, filled after by
  // tensor_parallel_initializer); a hollow placeholder (to_hollow) would become a dense garbage
  // tensor of the split size instead.
  TORCH_CHECK(!is_hollow(weight), what,
              ": the weight is a hollow placeholder (split before to_hollow, on the meta "
              "device or with values)");
}

void LinearImpl::split_output_features(const std::vector<std::pair<int64_t, int64_t>>& rows,
                                       std::shared_ptr<fsdp::ProcessGroup> group) {
  require_plain("split_output_features");
  TORCH_CHECK(group, "split_output_features: no group");
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> w, b;
  int64_t kept = 0;
  for (const auto& [first, size] : rows) {
    TORCH_CHECK(first >= 0 && size >= 0 && first + size <= out_features_,
                "split_output_features: rows [", first, ", ", first + size, ") outside the ",
                out_features_, " output features");
    w.push_back(weight.narrow(0, first, size));
    if (bias.defined())
      b.push_back(bias.narrow(0, first, size));
    kept += size;
  }
  replace_parameter("weight", torch::cat(w));
  if (bias.defined())
    replace_parameter("bias", torch::cat(b));
  if (lora_B) {
    std::vector<torch::Tensor> lb;
    for (const auto& [first, size] : rows)
      lb.push_back(lora_B->weight.narrow(0, first, size));
    lora_B->replace_parameter("weight", torch::cat(lb));
    lora_B->out_features_ = kept;
  }
  out_features_ = kept;
  tp_ = TpSplit::kColumn;
  tp_group_ = std::move(group);
}

std::vector<torch::Tensor> LinearImpl::split_parameters() const {
  if (tp_ == TpSplit::kNone)
    return {};
  std::vector<torch::Tensor> split{weight};
  if (tp_ == TpSplit::kColumn && bias.defined())
    split.push_back(bias);
  if (lora_A)  // the adapter that follows the weight's split (see split_forward)
    split.push_back(tp_ == TpSplit::kColumn ? lora_B->weight : lora_A->weight);
  return split;
}

void LinearImpl::split_vocabulary(fsdp::tp::VocabSplit split) {
  TORCH_CHECK(split.shard.total == out_features_, "split_vocabulary: a split of ",
              split.shard.total, " words for a head of ", out_features_);
  split_output_features({{split.shard.first, split.shard.size}}, split.group);
  vocab_ = std::move(split);
}

void LinearImpl::split_input_features(int64_t first, int64_t size,
                                      std::shared_ptr<fsdp::ProcessGroup> group) {
  require_plain("split_input_features");
  TORCH_CHECK(group, "split_input_features: no group");
  TORCH_CHECK(first >= 0 && size > 0 && first + size <= in_features_,
              "split_input_features: features [", first, ", ", first + size, ") outside the ",
              in_features_, " input features");
  torch::NoGradGuard no_grad;
  replace_parameter("weight", weight.narrow(1, first, size));
  if (lora_A) {
    lora_A->replace_parameter("weight", lora_A->weight.narrow(1, first, size));
    lora_A->in_features_ = size;
  }
  in_features_ = size;
  tp_ = TpSplit::kRow;
  tp_group_ = std::move(group);
}

void LinearImpl::add_lora(const LoraOptions& options, const ModelInit& init) {
  TORCH_CHECK(!lora_A, "add_lora: this Linear already has adapters");
  TORCH_CHECK(tp_ == TpSplit::kNone,
              "add_lora: this Linear is already split for tensor parallelism: add the adapters "
              "first (tensor_parallelize_* splits them with the weight)");
  TORCH_CHECK(options.rank() >= 1, "LoRA rank must be at least 1, got ", options.rank());
  TORCH_CHECK(options.dropout() >= 0 && options.dropout() < 1,
              "LoRA dropout must be in [0, 1), got ", options.dropout());
  lora_rank_ = options.rank();
  lora_alpha_ = options.alpha();
  lora_dropout_ = options.dropout();
  lora_A = register_module("lora_A", std::make_shared<LinearImpl>(in_features_, lora_rank_,
                                                                  /*bias=*/false, init));
  lora_B = register_module("lora_B", std::make_shared<LinearImpl>(lora_rank_, out_features_,
                                                                  /*bias=*/false, init));
  for (auto& p : parameters(/*recurse=*/false))
    p.set_requires_grad(false);
}

void LinearImpl::use_nf4(bool quantize, torch::Device device) {
  TORCH_CHECK(!is_nf4(), "use_nf4: this Linear is already in NF4");
  TORCH_CHECK(in_features_ % fsdp::nf4::kBlock == 0, "NF4 storage needs in_features (",
              in_features_, ") to be a multiple of ", fsdp::nf4::kBlock);
  const int64_t n = in_features_ * out_features_, blocks = n / fsdp::nf4::kBlock;
  fsdp::nf4::Quantized q;
  if (quantize) {
    TORCH_CHECK(weight.device() != torch::kMeta, "use_nf4: the weight has no values to quantize");
    torch::NoGradGuard no_grad;
    q = fsdp::nf4::quantize(weight);
    q.codes = q.codes.view({out_features_, in_features_ / 2});
    device = weight.device();
  } else {
    auto u8 = torch::TensorOptions().dtype(torch::kUInt8).device(device);
    auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(device);
    q.codes = torch::empty({out_features_, in_features_ / 2}, u8);
    q.absmax_codes = torch::empty({blocks}, u8);
    q.scales = torch::empty({(blocks + fsdp::nf4::kScaleBlock - 1) / fsdp::nf4::kScaleBlock}, f32);
    q.offset = torch::empty({1}, f32);
  }
  remove_parameter("weight");
  add_fixed_parameter("weight_nf4", q.codes.to(device), weight_nf4);
  add_fixed_parameter("weight_absmax", q.absmax_codes.to(device), weight_absmax);
  // The float32 scales are kept as their bit patterns (int32): mixed precision casts floating
  // parameters to param_dtype for the all-gather, and these must arrive exact.
  add_fixed_parameter("weight_absmax_scale", q.scales.to(device).view(torch::kInt32),
                      weight_absmax_scale);
  add_fixed_parameter("weight_absmax_offset", q.offset.to(device).view(torch::kInt32),
                      weight_absmax_offset);
}

torch::Tensor LinearImpl::dense_weight(torch::ScalarType dtype) const {
  if (!is_nf4())
    return weight.to(dtype);
  return fsdp::nf4::dequantize(weight_nf4, weight_absmax, weight_absmax_scale.view(torch::kFloat32),
                               weight_absmax_offset.view(torch::kFloat32),
                               {out_features_, in_features_}, dtype);
}

EmbeddingImpl::EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim, const ModelInit& init) {
  add_parameter("weight", {num_embeddings, embedding_dim}, init, weight);
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& idx) {
  if (vocab_)
    return fsdp::tp::vocab_parallel_embedding(weight, idx, vocab_->shard, vocab_->group,
                                              sequence_parallel_ ? 1 : -1);
  return torch::embedding(weight, idx);
}

torch::Tensor EmbeddingImpl::attend(const torch::Tensor& h) {
  if (!vocab_)
    return torch::nn::functional::linear(h, weight);
  auto mine = torch::nn::functional::linear(
      sequence_parallel_ ? h : fsdp::tp::copy_to_group(h, vocab_->group), weight);
  return fsdp::tp::gather_last_dim(mine, vocab_->shard.sizes, vocab_->group);
}

void EmbeddingImpl::use_sequence_parallel() {
  TORCH_CHECK(vocab_, "use_sequence_parallel: this table is not split by words");
  sequence_parallel_ = true;
}

void EmbeddingImpl::split_vocabulary(std::shared_ptr<fsdp::ProcessGroup> group) {
  TORCH_CHECK(group, "split_vocabulary: no group");
  TORCH_CHECK(!vocab_, "split_vocabulary: the table is already split");
  TORCH_CHECK(!is_hollow(weight),
              "split_vocabulary: the table is a hollow placeholder (split before to_hollow)");
  auto split = fsdp::tp::VocabSplit::over(weight.size(0), std::move(group));
  TORCH_CHECK(split.shard.size > 0, "split_vocabulary: ", weight.size(0), " words for ",
              split.group->size(), " ranks leave rank ", split.group->rank(), " none");
  torch::NoGradGuard no_grad;
  replace_parameter("weight", weight.narrow(0, split.shard.first, split.shard.size));
  vocab_ = std::move(split);
}

LayerNormImpl::LayerNormImpl(int64_t dim, const ModelInit& init, double eps)
    : dim_(dim), eps_(eps) {
  add_parameter("weight", {dim}, init, weight);
  add_parameter("bias", {dim}, init, bias);
}

torch::Tensor LayerNormImpl::forward(const torch::Tensor& x) {
  if (grad_group_)
    return torch::layer_norm(x, {dim_}, fsdp::tp::copy_to_group(weight, grad_group_),
                             fsdp::tp::copy_to_group(bias, grad_group_), eps_);
  return torch::layer_norm(x, {dim_}, weight, bias, eps_);
}

RMSNormImpl::RMSNormImpl(int64_t dim, const ModelInit& init, double eps) : dim_(dim), eps_(eps) {
  add_parameter("weight", {dim}, init, weight);
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  TORCH_CHECK(x.size(-1) == dim_, "RMSNorm: last dimension of the input is ", x.size(-1),
              ", expected ", dim_);
  // As Meta's reference: normalise in float32 (bf16 squares lose too much), scale in x's dtype;
  // keeping only x and one scale per row for backward (lean_ops.h).
  return rms_norm(x, grad_group_ ? fsdp::tp::copy_to_group(weight, grad_group_) : weight, eps_);
}

}  // namespace fsdp_models
