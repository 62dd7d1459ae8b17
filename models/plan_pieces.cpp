// See plan_pieces.h.
#include "plan_pieces.h"

#include <algorithm>
#include <cmath>

namespace fsdp_models {
namespace {

template <typename Model, typename Block>
fsdp::plan::CalibrationPieces pieces(Model& model, torch::ScalarType block_dtype, PlanLoss loss,
                                     std::optional<torch::ScalarType> block_output,
                                     std::optional<PlanFusedLoss> fused, int64_t vocab,
                                     Block block) {
  TORCH_CHECK(!model->blocks.empty(), "calibration_pieces: the model has no block");
  fsdp::plan::CalibrationPieces p;
  auto tokens = [vocab](int64_t b, int64_t t) {
    return torch::randint(vocab, {b, t}, torch::TensorOptions().dtype(torch::kLong));
  };
  p.pre = [model, tokens](int64_t b, int64_t t) mutable { return model->embed(tokens(b, t)); };
  p.block = [block, block_dtype, block_output](const torch::Tensor& x, int64_t t) mutable {
    auto y = block(x.to(block_dtype), t);
    return block_output ? y.to(*block_output) : y;
  };
  if (fused) {
    const int64_t run_chunk =
        std::min(fused->chunk > 0 ? fused->chunk : auto_loss_chunk(vocab), fused->positions);
    // The run's chunk as it is: what one chunk holds does not grow with the positions, so
    // the fit sees it as a constant, right at any length the run's batches have (fine-tuning
    // pads each batch to its own longest conversation, below the planned length).
    p.head = [model, fused, run_chunk](const torch::Tensor& x, int64_t t) mutable {
      auto spec = fused->spec(x.size(0), t);
      spec.chunk = run_chunk;
      return model->loss(x, spec);
    };
    p.loss = [](const torch::Tensor& loss, int64_t) { return loss; };
  } else {
    p.head = [model](const torch::Tensor& x, int64_t) mutable {
      return model->head(x).to(torch::kFloat);
    };
    p.loss = [loss](const torch::Tensor& logits, int64_t t) {
      return loss(logits, logits.size(0), t);
    };
  }
  for (const auto& item : model->named_parameters())
    p.parameters.emplace_back(item.key(), item.value());
  return p;
}

}  // namespace

fsdp::plan::CalibrationPieces calibration_pieces(GPT& model, torch::ScalarType block_dtype,
                                                 PlanLoss loss,
                                                 std::optional<torch::ScalarType> block_output,
                                                 std::optional<PlanFusedLoss> fused) {
  auto first = model->blocks.empty() ? Block(nullptr) : model->blocks.front();
  return pieces(model, block_dtype, std::move(loss), block_output, std::move(fused),
                model->config().vocab_size,
                [first](const torch::Tensor& x, int64_t) mutable { return first(x); });
}

fsdp::plan::CalibrationPieces calibration_pieces(Llama& model, torch::ScalarType block_dtype,
                                                 PlanLoss loss,
                                                 std::optional<torch::ScalarType> block_output,
                                                 std::optional<PlanFusedLoss> fused) {
  auto first = model->blocks.empty() ? LlamaBlock(nullptr) : model->blocks.front();
  return pieces(model, block_dtype, std::move(loss), block_output, std::move(fused),
                model->config().vocab_size,
                [first, model](const torch::Tensor& x, int64_t t) mutable {
                  return first(x, model->rope(t));
                });
}

int64_t max_narrowing(const GPTConfig& cfg) {
  int64_t k = 1;
  while (cfg.n_embd % (cfg.n_head * 2 * k) == 0 && cfg.n_embd / (cfg.n_head * 2 * k) >= 2)
    k *= 2;
  return k;
}

int64_t max_narrowing(const LlamaConfig& cfg) {
  int64_t k = 1;
  auto fits = [&](int64_t n) {
    return cfg.dim % (cfg.n_heads * n) == 0 && cfg.ffn_hidden_dim % n == 0 &&
           cfg.head_dim() / n >= 2 && (cfg.head_dim() / n) % 2 == 0;
  };
  while (fits(2 * k))
    k *= 2;
  return k;
}

GPTConfig narrowed(GPTConfig cfg, int64_t k, bool vocab) {
  TORCH_CHECK(k >= 1 && k <= max_narrowing(cfg), "narrowed: GPT width ", cfg.n_embd, " with ",
              cfg.n_head, " heads cannot be narrowed by ", k);
  cfg.n_embd /= k;  // the MLP's 4 x n_embd follows
  if (vocab)
    cfg.vocab_size /= k;
  return cfg;
}

LlamaConfig narrowed(LlamaConfig cfg, int64_t k, bool vocab) {
  TORCH_CHECK(k >= 1 && k <= max_narrowing(cfg), "narrowed: Llama width ", cfg.dim, " with ",
              cfg.n_heads, " heads and feed-forward ", cfg.ffn_hidden_dim,
              " cannot be narrowed by ", k);
  cfg.dim /= k;
  cfg.ffn_hidden_dim /= k;
  if (vocab)
    cfg.vocab_size /= k;
  return cfg;
}

fsdp::plan::PieceFlops piece_flops(const GPTConfig& cfg, int64_t b, int64_t t, int64_t tp) {
  const double tokens = static_cast<double>(b * t), d = static_cast<double>(cfg.n_embd);
  const double ways = static_cast<double>(tp);
  fsdp::plan::PieceFlops f;
  // q, k, v and the output projection (4 d^2), the MLP (8 d^2); scores and their use of v: all
  // split by heads or by the MLP's width.
  f.block = (2 * tokens * 12 * d * d + 4 * tokens * static_cast<double>(t) * d) / ways;
  // The head: this rank's words (the first ranks of an uneven split hold ceil(V / tp)).
  const double words = static_cast<double>((cfg.vocab_size + tp - 1) / tp);
  f.post = 2 * tokens * d * words;
  return f;
}

fsdp::plan::PieceFlops piece_flops(const LlamaConfig& cfg, int64_t b, int64_t t, int64_t tp) {
  const double tokens = static_cast<double>(b * t), d = static_cast<double>(cfg.dim);
  const double ways = static_cast<double>(tp);
  // Key/value heads split with the query heads when they divide by tp; else every rank
  // computes all of them (tensor_parallel.h).
  const double kv_ways = cfg.n_kv_heads % tp == 0 ? ways : 1;
  const double kv = static_cast<double>(cfg.n_kv_heads * cfg.head_dim());
  const double ffn = static_cast<double>(cfg.ffn_hidden_dim);
  fsdp::plan::PieceFlops f;
  // wq and wo (d x d each), wk and wv (d x kv each), w1, w2, w3 (d x ffn each); attention.
  f.block = 2 * tokens * ((2 * d * d + 3 * d * ffn) / ways + 2 * d * kv / kv_ways) +
            4 * tokens * static_cast<double>(t) * d / ways;
  const double words = static_cast<double>((cfg.vocab_size + tp - 1) / tp);
  f.post = 2 * tokens * d * words;
  return f;
}

}  // namespace fsdp_models
