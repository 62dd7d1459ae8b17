// See tensor_parallel.h.
#include "tensor_parallel.h"

#include <c10/util/Exception.h>

#include <string>
#include <unordered_map>
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

// The split of a model being parallelized, recorded as each layer is split: where this rank's
// part of every split parameter sits in the whole (names relative to the model).
class Splitter {
 public:
  explicit Splitter(const std::shared_ptr<fsdp::ProcessGroup>& tp) : tp_(tp) {
    layout_.writes_whole = tp->rank() == 0;
  }

  // Column-parallel: this rank's part of each of `parts` equal blocks of the output features.
  void column(Linear& layer, const std::string& name, int64_t parts) {
    const int64_t whole = layer->out_features();
    const Rows rows = rows_of(whole, parts, tp_->rank(), tp_->size());
    layer->split_output_features(rows, tp_);
    record_column(layer, name, whole, rows);
  }
  // Row-parallel: this rank's even share of the input features.
  void row(Linear& layer, const std::string& name) {
    const int64_t whole = layer->in_features(), each = whole / tp_->size();
    layer->split_input_features(tp_->rank() * each, each, tp_);
    record(name + ".weight", 1, whole, {{tp_->rank() * each, each}});
    if (layer->has_lora())
      record(name + ".lora_A.weight", 1, whole, {{tp_->rank() * each, each}});
  }
  // A head split by words.
  void vocabulary(Linear& layer, const std::string& name, int64_t words) {
    const auto split = fsdp::tp::VocabSplit::over(words, tp_);
    const Rows rows{{split.shard.first, split.shard.size}};
    layer->split_vocabulary(split);
    record_column(layer, name, words, rows);
  }
  void vocabulary(Embedding& table, const std::string& name) {
    const int64_t words = table->weight.size(0);
    table->split_vocabulary(tp_);
    const auto& shard = table->vocab_split()->shard;
    record(name + ".weight", 0, words, {{shard.first, shard.size}});
  }
  fsdp::TensorParallelLayout take() { return std::move(layout_); }

 private:
  void record(const std::string& param, int64_t dim, int64_t whole, Rows ranges) {
    layout_.parts[param] = fsdp::TensorPart{dim, whole, std::move(ranges)};
  }
  void record_column(Linear& layer, const std::string& name, int64_t whole, const Rows& rows) {
    record(name + ".weight", 0, whole, rows);
    if (layer->bias.defined())
      record(name + ".bias", 0, whole, rows);
    if (layer->has_lora())
      record(name + ".lora_B.weight", 0, whole, rows);
  }

  std::shared_ptr<fsdp::ProcessGroup> tp_;
  fsdp::TensorParallelLayout layout_;
};

// The Linears of `model` that are not LoRA adapters, by name.
std::vector<std::pair<std::string, Linear>> linears(torch::nn::Module& model) {
  std::vector<std::pair<std::string, Linear>> out;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    auto impl = std::dynamic_pointer_cast<LinearImpl>(item.value());
    if (impl && !is_lora_adapter(item.key()))  // adapters are split with their layer
      out.emplace_back(item.key(), Linear(impl));
  }
  return out;
}

bool ends_with(const std::string& name, const std::string& suffix) {
  return name.size() >= suffix.size() &&
         name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

fsdp::TensorParallelLayout tensor_parallelize_gpt(GPT& model,
                                                  const std::shared_ptr<fsdp::ProcessGroup>& tp) {
  TORCH_CHECK(tp, "tensor_parallelize_gpt: no group");
  const auto& cfg = model->config();
  const int n = tp->size();
  TORCH_CHECK(cfg.n_head % n == 0, "tensor_parallelize_gpt: n_head " + std::to_string(cfg.n_head) +
                                       " does not divide over " + std::to_string(n) + " ranks");
  Splitter split(tp);
  for (auto& [name, layer] : linears(*model)) {
    if (name == "lm_head")
      split.vocabulary(layer, name, cfg.vocab_size);
    else if (ends_with(name, ".attn.c_attn"))
      split.column(layer, name, /*parts=*/3);  // this rank's heads of q, k and v
    else if (ends_with(name, ".mlp.c_fc"))
      split.column(layer, name, 1);
    else if (ends_with(name, ".attn.c_proj") || ends_with(name, ".mlp.c_proj"))
      split.row(layer, name);
    else
      TORCH_CHECK(false, "tensor_parallelize_gpt: no rule for Linear '", name, "'");
  }
  split.vocabulary(model->wte, "wte");
  return split.take();
}

fsdp::TensorParallelLayout tensor_parallelize_llama(Llama& model,
                                                    const std::shared_ptr<fsdp::ProcessGroup>& tp) {
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
  Splitter split(tp);
  for (size_t i = 0; i < model->blocks.size(); ++i) {
    auto& attention = model->blocks[i]->attention;
    auto& ffn = model->blocks[i]->feed_forward;
    const std::string at = "layers." + std::to_string(i) + ".attention.";
    const std::string ff = "layers." + std::to_string(i) + ".feed_forward.";
    split.column(attention->wq, at + "wq", 1);
    if (split_kv) {
      split.column(attention->wk, at + "wk", 1);
      split.column(attention->wv, at + "wv", 1);
    } else {  // each rank's query heads read one kv head, which the ranks n / kv share
      attention->read_kv_heads(tp->rank() * cfg.n_kv_heads / n, 1, tp);
    }
    split.row(attention->wo, at + "wo");
    split.column(ffn->w1, ff + "w1", 1);
    split.column(ffn->w3, ff + "w3", 1);
    split.row(ffn->w2, ff + "w2");
    // One all-reduce of the input's gradient for the projections that read it, as Megatron's
    // fused layers have, where no adapter needs the input uncopied.
    if (!attention->wq->has_lora() &&
        (!split_kv || (!attention->wk->has_lora() && !attention->wv->has_lora())))
      attention->share_input_copy(tp);
    if (!ffn->w1->has_lora() && !ffn->w3->has_lora())
      ffn->share_input_copy(tp);
  }
  split.vocabulary(model->tok_embeddings, "tok_embeddings");
  if (!cfg.tie_embeddings)
    split.vocabulary(model->output, "output", cfg.vocab_size);
  return split.take();
}

std::function<void(const torch::Tensor&, const torch::Tensor&, int64_t)>
tensor_parallel_initializer(torch::nn::Module& model, InitScheme scheme, uint64_t seed,
                            fsdp::TensorParallelLayout layout) {
  auto names = std::make_shared<std::unordered_map<const c10::TensorImpl*, std::string>>();
  for (const auto& item : model.named_parameters())
    names->emplace(item.value().unsafeGetTensorImpl(), item.key());
  return [names, scheme = std::move(scheme), seed, layout = std::move(layout)](
             const torch::Tensor& param, const torch::Tensor& shard, int64_t first_row) {
    const auto it = names->find(param.unsafeGetTensorImpl());
    TORCH_CHECK(it != names->end(), "tensor_parallel_initializer: a parameter of shape ",
                param.sizes(), " is not one of the model's (build it after to_hollow())");
    const std::string& name = it->second;
    const auto part = layout.parts.find(name);
    if (part == layout.parts.end()) {  // whole on every rank: its rows as in a whole model
      init_parameter(name, shard, scheme, seed, first_row);
      return;
    }
    // Each block of the whole tensor this shard holds, drawn as whole rows, then its columns.
    torch::NoGradGuard no_grad;
    const auto shape = param.sizes().vec();
    auto rows = fsdp::whole_shape(&part->second, shape, name);
    for (const auto& b : fsdp::whole_blocks(&part->second, shape, first_row, shard.size(0), name)) {
      rows[0] = b.rows;
      auto whole_rows = torch::empty(rows, torch::kFloat);
      init_parameter(name, whole_rows, scheme, seed, b.row);
      shard.narrow(0, b.at, b.rows)
          .copy_(rows.size() >= 2 ? whole_rows.narrow(1, b.col, b.cols) : whole_rows);
    }
  };
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
