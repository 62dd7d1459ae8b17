#include "chunked_loss.h"

#include <torch/autograd.h>
#include <torch/torch.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace fsdp_models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One chunk's logits, in float32: the head's matmul in hidden's dtype, as a Linear computes it.
torch::Tensor chunk_logits(const torch::Tensor& h, const torch::Tensor& weight) {
  return at::matmul(h, weight.t()).to(torch::kFloat);
}

class ChunkedLinearCrossEntropy : public torch::autograd::Function<ChunkedLinearCrossEntropy> {
 public:
  // `w` is the per-position weight already divided by the denominator, zero where ignored, and
  // `y` the targets with ignored ones replaced by 0 (any valid row: their weight is 0).
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& hidden,
                               const torch::Tensor& weight, const torch::Tensor& y,
                               const torch::Tensor& w, int64_t chunk) {
    const int64_t n = hidden.size(0);
    auto lse = torch::empty({n}, hidden.options().dtype(torch::kFloat));
    auto total = torch::zeros({}, hidden.options().dtype(torch::kFloat));
    for (int64_t s = 0; s < n; s += chunk) {
      const int64_t len = std::min(chunk, n - s);
      const auto logits = chunk_logits(hidden.narrow(0, s, len), weight);
      const auto l = at::logsumexp(logits, 1);
      lse.narrow(0, s, len).copy_(l);
      const auto picked = logits.gather(1, y.narrow(0, s, len).unsqueeze(1)).squeeze(1);
      total += ((l - picked) * w.narrow(0, s, len)).sum();
    }
    ctx->save_for_backward({hidden, weight, y, w, lse});
    ctx->saved_data["chunk"] = chunk;
    return total;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const auto &hidden = saved[0], &weight = saved[1], &y = saved[2], &w = saved[3],
               &lse = saved[4];
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const bool want_h = ctx->needs_input_grad(0), want_w = ctx->needs_input_grad(1);
    const int64_t n = hidden.size(0);
    const auto g = grad_out[0].to(torch::kFloat);
    torch::Tensor grad_h, grad_w;
    if (want_h)
      grad_h = torch::empty_like(hidden);
    if (want_w)
      grad_w = torch::zeros(weight.sizes(), weight.options().dtype(torch::kFloat));
    for (int64_t s = 0; s < n; s += chunk) {
      const int64_t len = std::min(chunk, n - s);
      const auto h = hidden.narrow(0, s, len);
      // d loss / d logits = (softmax - one_hot(y)) * w, for this chunk only.
      auto d = (chunk_logits(h, weight) - lse.narrow(0, s, len).unsqueeze(1)).exp_();
      d.scatter_add_(1, y.narrow(0, s, len).unsqueeze(1), torch::full({len, 1}, -1.0, d.options()));
      d.mul_((w.narrow(0, s, len) * g).unsqueeze(1));
      if (want_h)
        grad_h.narrow(0, s, len).copy_(at::matmul(d.to(hidden.scalar_type()), weight));
      if (want_w)
        grad_w.addmm_(d.t(), h.to(torch::kFloat));
    }
    return {grad_h, want_w ? grad_w.to(weight.scalar_type()) : torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor chunked_linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                           const torch::Tensor& targets,
                                           const torch::Tensor& weights, double denominator,
                                           int64_t chunk, int64_t ignore_index) {
  if (hidden.dim() != 2 || weight.dim() != 2 || hidden.size(1) != weight.size(1))
    throw std::invalid_argument(
        "chunked_linear_cross_entropy: hidden (N, C) and weight (V, C) "
        "expected, got " +
        std::to_string(hidden.dim()) + "-d and " + std::to_string(weight.dim()) + "-d");
  if (targets.dim() != 1 || targets.size(0) != hidden.size(0) ||
      targets.scalar_type() != torch::kLong)
    throw std::invalid_argument("chunked_linear_cross_entropy: targets must be int64 (N)");
  if (weights.defined() && (weights.dim() != 1 || weights.size(0) != hidden.size(0)))
    throw std::invalid_argument("chunked_linear_cross_entropy: weights must be (N)");
  if (chunk < 1 || !(denominator > 0))
    throw std::invalid_argument(
        "chunked_linear_cross_entropy: chunk >= 1 and a positive "
        "denominator expected");
  const auto ignored = targets.eq(ignore_index);
  const auto valid = targets.ge(0).logical_and(targets.lt(weight.size(0)));
  if (!valid.logical_or(ignored).all().item<bool>())
    throw std::invalid_argument("chunked_linear_cross_entropy: a target is outside [0, " +
                                std::to_string(weight.size(0)) + ")");
  auto w = weights.defined() ? weights.to(torch::kFloat)
                             : torch::ones({hidden.size(0)}, hidden.options().dtype(torch::kFloat));
  w = w.masked_fill(ignored, 0.0) / denominator;
  const auto y = targets.masked_fill(ignored, 0);
  return ChunkedLinearCrossEntropy::apply(hidden, weight, y, w, chunk);
}

torch::Tensor head_loss(const torch::Tensor& normed, const torch::Tensor& tied, Linear& head,
                        const LossSpec& spec) {
  const auto h = normed.reshape({-1, normed.size(-1)});
  const auto targets = spec.targets.reshape({-1});
  const auto weights = spec.weights.defined() ? spec.weights.reshape({-1}) : torch::Tensor();
  const bool plain =
      tied.defined() || (!head->has_lora() && !head->bias.defined() && !head->is_nf4());
  if (plain)
    return chunked_linear_cross_entropy(h, tied.defined() ? tied : head->weight, targets, weights,
                                        spec.denominator, spec.chunk);
  const auto all = head(normed);
  auto ce = torch::nn::functional::cross_entropy(
      all.reshape({-1, all.size(-1)}).to(torch::kFloat), targets,
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
  if (weights.defined())
    ce = ce * weights;
  return ce.sum() / spec.denominator;
}

}  // namespace fsdp_models
