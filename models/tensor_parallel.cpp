// See tensor_parallel.h.
#include "tensor_parallel.h"

#include <c10/util/Exception.h>

#include <string>
#include <utility>
#include <vector>

namespace fsdp_models {
namespace {

using Rows = std::vector<std::pair<int64_t, int64_t>>;

// Rank `rank` of `n`'s part of each of `parts` equal blocks of `total` rows: a fused
// projection's heads of q, k and v, or (parts 1) an even split.
Rows rows_of(int64_t total, int64_t parts, int rank, int n) {
  const int64_t block = total / parts, each = block / n;
  Rows rows;
  for (int64_t p = 0; p < parts; ++p)
    rows.emplace_back(p * block + rank * each, each);
  return rows;
}

void column(Linear& layer, int64_t parts, const std::shared_ptr<fsdp::ProcessGroup>& tp) {
  layer->split_output_features(rows_of(layer->out_features(), parts, tp->rank(), tp->size()), tp);
}

void row(Linear& layer, const std::shared_ptr<fsdp::ProcessGroup>& tp) {
  const int64_t each = layer->in_features() / tp->size();
  layer->split_input_features(tp->rank() * each, each, tp);
}

}  // namespace

void tensor_parallelize_gpt(GPT& model, const std::shared_ptr<fsdp::ProcessGroup>& tp) {
  TORCH_CHECK(tp, "tensor_parallelize_gpt: no group");
  const auto& cfg = model->config();
  const int n = tp->size();
  TORCH_CHECK(cfg.n_head % n == 0, "tensor_parallelize_gpt: n_head " + std::to_string(cfg.n_head) +
                                       " does not divide over " + std::to_string(n) + " ranks");
  for (auto& block : model->blocks) {
    for (const auto& item : block->named_modules()) {
      auto impl = std::dynamic_pointer_cast<LinearImpl>(item.value());
      if (!impl || is_lora_adapter(item.key()))  // adapters are split with their layer
        continue;
      const std::string& name = item.key();
      Linear layer(impl);
      if (name == "attn.c_attn")
        column(layer, /*parts=*/3, tp);  // this rank's heads of q, k and v
      else if (name == "mlp.c_fc")
        column(layer, 1, tp);
      else if (name == "attn.c_proj" || name == "mlp.c_proj")
        row(layer, tp);
      else
        TORCH_CHECK(false, "tensor_parallelize_gpt: no rule for Linear '", name, "'");
    }
  }
  model->wte->split_vocabulary(tp);
  if (!cfg.tie_embeddings)
    model->lm_head->split_vocabulary(fsdp::tp::VocabSplit::over(cfg.vocab_size, tp));
}

void tensor_parallelize_llama(Llama& model, const std::shared_ptr<fsdp::ProcessGroup>& tp) {
  TORCH_CHECK(tp, "tensor_parallelize_llama: no group");
  const auto& cfg = model->config();
  const int n = tp->size();
  const std::string over = " does not divide over " + std::to_string(n) + " ranks";
  TORCH_CHECK(cfg.n_heads % n == 0,
              "tensor_parallelize_llama: n_heads " + std::to_string(cfg.n_heads) + over);
  TORCH_CHECK(cfg.ffn_hidden_dim % n == 0, "tensor_parallelize_llama: ffn_hidden_dim " +
                                               std::to_string(cfg.ffn_hidden_dim) + over);
  const bool split_kv = cfg.n_kv_heads % n == 0;
  TORCH_CHECK(split_kv || n % cfg.n_kv_heads == 0,
              "tensor_parallelize_llama: " + std::to_string(cfg.n_kv_heads) + " kv heads on " +
                  std::to_string(n) + " ranks: either must divide the other");
  for (auto& block : model->blocks) {
    auto& attention = block->attention;
    column(attention->wq, 1, tp);
    if (split_kv) {
      column(attention->wk, 1, tp);
      column(attention->wv, 1, tp);
    } else {  // each rank's query heads read one kv head, which the ranks n / kv share
      attention->read_kv_heads(tp->rank() * cfg.n_kv_heads / n, 1, tp);
    }
    row(attention->wo, tp);
    column(block->feed_forward->w1, 1, tp);
    column(block->feed_forward->w3, 1, tp);
    row(block->feed_forward->w2, tp);
  }
  model->tok_embeddings->split_vocabulary(tp);
  if (!cfg.tie_embeddings)
    model->output->split_vocabulary(fsdp::tp::VocabSplit::over(cfg.vocab_size, tp));
}

fsdp::TensorParallelParams tensor_parallel_params(torch::nn::Module& model, int ways) {
  fsdp::TensorParallelParams out;
  out.ways = ways;
  for (const auto& m : model.modules()) {
    if (auto* linear = dynamic_cast<LinearImpl*>(m.get())) {
      for (auto& p : linear->split_parameters())
        out.split.push_back(p);
    } else if (auto* table = dynamic_cast<EmbeddingImpl*>(m.get()); table && table->vocab_split()) {
      out.split.push_back(table->weight);
    }
  }
  return out;
}

}  // namespace fsdp_models
