// See model_factory.h.
#include "model_factory.h"

#include <fmt/core.h>

#include "gpt.h"
#include "llama.h"

namespace fsdp_trainer {
namespace {

template <typename C>
C preset_or_config_error(const std::string& arch, const std::string& name) {
  try {
    return C::preset(name);
  } catch (const std::exception& e) {
    throw ConfigError("'model.preset' = '" + name + "' is not a " + arch + " preset: " + e.what());
  }
}

}  // namespace

TrainModel build_model(const Config& config, int64_t vocab_size,
                       const fsdp::FullyShardOptions& options) {
  const auto& m = config.model;
  TrainModel out;
  auto init = fsdp_models::ModelInit().seed(static_cast<uint64_t>(config.training.seed));
  if (m.arch == "gpt") {
    auto cfg = preset_or_config_error<fsdp_models::GPTConfig>("gpt", m.preset);
    if (m.n_layer > 0)
      cfg.n_layer = m.n_layer;
    if (m.n_embd > 0)
      cfg.n_embd = m.n_embd;
    if (m.n_head > 0)
      cfg.n_head = m.n_head;
    cfg.vocab_size = vocab_size;
    cfg.block_size = config.training.seq_len;
    if (cfg.n_embd % cfg.n_head != 0) {
      throw ConfigError(
          fmt::format("model width {} is not a multiple of the head count {} "
                      "('model.n_embd', 'model.n_head')",
                      cfg.n_embd, cfg.n_head));
    }
    fsdp_models::GPT model(cfg, init);
    fsdp_models::parallelize_gpt(model, options);
    out.module = model.ptr();
    out.forward = [model](const torch::Tensor& idx) mutable { return fsdp::forward(model, idx); };
    out.num_params = cfg.num_params();
    out.n_layer = cfg.n_layer;
    out.n_embd = cfg.n_embd;
  } else {
    auto cfg = preset_or_config_error<fsdp_models::LlamaConfig>("llama", m.preset);
    if (m.n_layer > 0)
      cfg.n_layers = m.n_layer;
    if (m.n_embd > 0)
      cfg.dim = m.n_embd;
    if (m.n_head > 0)
      cfg.n_heads = m.n_head, cfg.n_kv_heads = std::min(cfg.n_kv_heads, m.n_head);
    cfg.vocab_size = vocab_size;
    cfg.max_seq_len = config.training.seq_len;
    try {
      cfg.validate();
    } catch (const std::exception& e) {
      throw ConfigError(std::string("llama shapes do not fit: ") + e.what());
    }
    fsdp_models::Llama model(cfg, init);
    fsdp_models::parallelize_llama(model, options);
    out.module = model.ptr();
    out.forward = [model](const torch::Tensor& idx) mutable { return fsdp::forward(model, idx); };
    out.num_params = cfg.num_params();
    out.n_layer = cfg.n_layers;
    out.n_embd = cfg.dim;
  }
  out.description = fmt::format("{} {}: {} layers, width {}, {:.2f}M parameters", m.arch, m.preset,
                                out.n_layer, out.n_embd, out.num_params / 1e6);
  return out;
}

}  // namespace fsdp_trainer
