// Llamas for a loader (GGUF, a Hugging Face directory) to fill, built as fine-tuning builds them
// (trainer/train/model_factory.cpp): shapes on the meta device, then memory without values.
// Building `Llama(cfg)` instead draws every parameter from a truncated normal that the loader
// then overwrites: 13 s of SmolLM2's 30 blocks on our 2-core machine, more than the load.
// The loaders fill every parameter or throw, naming the one they have no tensor for.
#pragma once

#include <fsdp/fsdp.h>

#include <memory>

#include "layers.h"
#include "llama.h"
#include "parallelize.h"

namespace fsdp::test {

// One process, the whole model.
inline fsdp_models::Llama unfilled_llama(const fsdp_models::LlamaConfig& cfg) {
  fsdp_models::Llama model(cfg, fsdp_models::ModelInit().device(torch::kMeta));
  fsdp_models::to_empty(*model, torch::TensorOptions().dtype(torch::kFloat32));
  return model;
}

// Sharded over `pg` by parallelize_llama, each rank allocating only its own rows (zeros: the
// shards are not broadcast from rank 0, so every rank must start from the same values).
inline fsdp_models::Llama unfilled_sharded_llama(const fsdp_models::LlamaConfig& cfg,
                                                 std::shared_ptr<fsdp::ProcessGroup> pg) {
  fsdp_models::Llama model(cfg, fsdp_models::ModelInit().device(torch::kMeta));
  fsdp_models::to_hollow(*model, torch::TensorOptions().dtype(torch::kFloat32));
  fsdp_models::parallelize_llama(
      model, fsdp::FullyShardOptions(std::move(pg))
                 .param_init([](const torch::Tensor&, const torch::Tensor& shard, int64_t) {
                   shard.zero_();
                 }));
  return model;
}

}  // namespace fsdp::test
