#include "chunked_loss.h"

#include <torch/autograd.h>
#include <torch/torch.h>

#include <fsdp/tensor_parallel/tp_ops.h>

#include <algorithm>
#include <optional>
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

// The gradients are computed in forward, chunk by chunk, right after each chunk's loss: the
// loss is a scalar, so its gradients are those of a unit upstream gradient, and backward only
// scales them by the one it receives. This is why the chunked loss costs no extra matmul (a
// backward that recomputed each chunk's logits would do the head's matmul twice: +10% of a
// SmolLM2 LoRA step) and holds, besides one chunk's logits, only the gradients themselves:
// hidden's (N x C, what backward would allocate anyway) and the weight's (V x C float32, when
// it requires one). Without grad mode, or when neither input requires a gradient, forward
// computes the loss alone.
class ChunkedLinearCrossEntropy : public torch::autograd::Function<ChunkedLinearCrossEntropy> {
 public:
  // `kept`: the rows of `hidden` that count, in order (with `every_row`, all of them: `kept` is
  // then empty and unused; autograd's inputs must be defined tensors); `w` is their weight
  // already divided by the denominator, zero where ignored, and `y` their targets with ignored
  // ones replaced by 0 (any valid row: their weight is 0). `split`: the vocabulary split over a
  // tensor-parallel group (`weight` holds this rank's words), or none.
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& hidden,
                               const torch::Tensor& weight, const torch::Tensor& kept,
                               bool every_row, const torch::Tensor& y, const torch::Tensor& w,
                               int64_t chunk, bool want_h, bool want_w,
                               std::optional<fsdp::tp::VocabSplit> split) {
    // The kept rows, gathered once (a K x C copy that lives through forward only); the other
    // rows' gradient is zero, so hidden's gradient is the N x C it always was.
    const bool select = !every_row;
    const auto rows = select ? hidden.index_select(0, kept) : hidden;
    const int64_t n = rows.size(0);
    auto total = torch::zeros({}, hidden.options().dtype(torch::kFloat));
    torch::Tensor grad_h, grad_w;
    if (want_h)
      grad_h = select ? torch::zeros_like(hidden, at::MemoryFormat::Contiguous)
                      : torch::empty_like(hidden, at::MemoryFormat::Contiguous);
    if (want_w)
      grad_w = torch::zeros(weight.sizes(), weight.options().dtype(torch::kFloat));
    for (int64_t s = 0; s < n; s += chunk) {
      const int64_t len = std::min(chunk, n - s);
      const auto h = rows.narrow(0, s, len);
      const auto yc = y.narrow(0, s, len).unsqueeze(1);
      const auto wc = w.narrow(0, s, len);
      auto logits = chunk_logits(h, weight);
      torch::Tensor lse, picked, column = yc, one = torch::full({len, 1}, -1.0, logits.options());
      if (split) {  // the logsumexp and the target's logit over every rank's words
        auto r = fsdp::tp::vocab_parallel_lse(logits, yc.squeeze(1), split->shard, split->group);
        lse = r.lse, picked = r.target;
        const auto here =
            yc.ge(split->shard.first).logical_and(yc.lt(split->shard.first + split->shard.size));
        column = (yc - split->shard.first).masked_fill(here.logical_not(), 0);
        one = one.masked_fill(here.logical_not(), 0.0);
      } else {
        lse = at::logsumexp(logits, 1);
        picked = logits.gather(1, yc).squeeze(1);
      }
      total += ((lse - picked) * wc).sum();
      if (!want_h && !want_w)
        continue;
      // d loss / d logits = (softmax - one_hot(y)) * w, in place of this chunk's logits (this
      // rank's words of them when split: its hidden's gradient is a part that
      // tp::copy_to_group sums in backward).
      auto& d = logits.sub_(lse.unsqueeze(1)).exp_();
      d.scatter_add_(1, column, one);
      d.mul_(wc.unsqueeze(1));
      if (want_h) {
        const auto g = at::matmul(d.to(hidden.scalar_type()), weight);
        if (select)
          grad_h.index_copy_(0, kept.narrow(0, s, len), g);
        else
          grad_h.narrow(0, s, len).copy_(g);
      }
      if (want_w)
        grad_w.addmm_(d.t(), h.to(torch::kFloat));
    }
    ctx->save_for_backward({grad_h, grad_w});
    ctx->saved_data["weight_dtype"] = weight.scalar_type();
    return total;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const auto &grad_h = saved[0], &grad_w = saved[1];
    const auto g = grad_out[0].to(torch::kFloat);
    torch::Tensor gh, gw;
    if (grad_h.defined() && ctx->needs_input_grad(0))
      gh = (grad_h.to(torch::kFloat) * g).to(grad_h.scalar_type());
    if (grad_w.defined() && ctx->needs_input_grad(1))
      gw = (grad_w * g).to(ctx->saved_data["weight_dtype"].toScalarType());
    return {gh,
            gw,
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor()};
  }
};

}  // namespace

torch::Tensor chunked_linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                           const torch::Tensor& targets,
                                           const torch::Tensor& weights, double denominator,
                                           int64_t chunk, int64_t ignore_index,
                                           const fsdp::tp::VocabSplit* split) {
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
  if (split && split->shard.size != weight.size(0))
    throw std::invalid_argument("chunked_linear_cross_entropy: a split of " +
                                std::to_string(split->shard.size) + " words for a weight of " +
                                std::to_string(weight.size(0)));
  const int64_t vocab = split ? split->shard.total : weight.size(0);
  const auto ignored = targets.eq(ignore_index);
  const auto valid = targets.ge(0).logical_and(targets.lt(vocab));
  if (!valid.logical_or(ignored).all().item<bool>())
    throw std::invalid_argument("chunked_linear_cross_entropy: a target is outside [0, " +
                                std::to_string(vocab) + ")");
  auto w = weights.defined() ? weights.to(torch::kFloat)
                             : torch::ones({hidden.size(0)}, hidden.options().dtype(torch::kFloat));
  w = w.masked_fill(ignored, 0.0) / denominator;
  auto y = targets.masked_fill(ignored, 0);
  // A position of weight 0 (an ignored target, a prompt token when only answers count) adds
  // nothing to the loss and gets a zero gradient, so its logits are not computed: fine-tuning
  // on answers only pays the head for the answer tokens (SmolLM2's 49,152-word head was most
  // of a 2-block LoRA step over whole conversations). Every rank of a tensor-parallel group
  // holds the same targets and weights, so all keep the same positions and run the same
  // chunks' all-reduces.
  const torch::Tensor kept = w.ne(0).nonzero().squeeze(1);
  const bool every_row = kept.size(0) == hidden.size(0);  // then no copy
  if (!every_row) {
    y = y.index_select(0, kept);
    w = w.index_select(0, kept);
  }
  const bool grad = torch::GradMode::is_enabled();
  return ChunkedLinearCrossEntropy::apply(
      hidden, weight, kept, every_row, y, w, chunk, grad && hidden.requires_grad(),
      grad && weight.requires_grad(),
      split ? std::optional<fsdp::tp::VocabSplit>(*split) : std::nullopt);
}

int64_t auto_loss_chunk(int64_t vocab) {
  constexpr int64_t kChunkBytes = int64_t{16} << 20, kMinPositions = 64;
  return std::max(kMinPositions, kChunkBytes / (4 * std::max<int64_t>(1, vocab)));
}

torch::Tensor head_loss(const torch::Tensor& normed, const torch::Tensor& tied, Linear& head,
                        const LossSpec& spec, const fsdp::tp::VocabSplit* split,
                        bool sequence_gathered) {
  auto h = normed.reshape({-1, normed.size(-1)});
  const auto targets = spec.targets.reshape({-1});
  const auto weights = spec.weights.defined() ? spec.weights.reshape({-1}) : torch::Tensor();
  const bool plain =
      tied.defined() || (!head->has_lora() && !head->bias.defined() && !head->is_nf4());
  if (plain) {
    const auto& matrix = tied.defined() ? tied : head->weight;
    if (split && !sequence_gathered)  // whole hidden states: their gradients' parts add up
      h = fsdp::tp::copy_to_group(h, split->group);
    return chunked_linear_cross_entropy(
        h, matrix, targets, weights, spec.denominator,
        spec.chunk > 0 ? spec.chunk : auto_loss_chunk(matrix.size(0)), /*ignore_index=*/-100,
        split);
  }
  const auto all = head(normed);
  auto ce = torch::nn::functional::cross_entropy(
      all.reshape({-1, all.size(-1)}).to(torch::kFloat), targets,
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
  if (weights.defined())
    ce = ce * weights;
  return ce.sum() / spec.denominator;
}

}  // namespace fsdp_models
