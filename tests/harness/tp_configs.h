// The small Llama the tensor-parallel tests split: shapes that 1, 2 and 4 ranks can split (the
// vocabulary of 67 words unevenly), with four query heads and two kv heads, so that its kv heads
// are split over 2 ranks and kept whole over 4.
#pragma once

#include "llama.h"

namespace fsdp::test {

inline fsdp_models::LlamaConfig tp_llama_config() {
  auto cfg = fsdp_models::LlamaConfig::preset("llama-test");
  cfg.dim = 48, cfg.n_heads = 4, cfg.n_kv_heads = 2, cfg.ffn_hidden_dim = 120;
  cfg.validate();
  return cfg;
}

}  // namespace fsdp::test
