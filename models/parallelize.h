// The one way both model families are sharded (parallelize_gpt, parallelize_llama): a unit per
// block, then the root unit for what is left (embeddings, final norm, head).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>

#include <fsdp/fully_shard.h>

namespace fsdp_models::detail {

/// Block i keeps block_options' activation checkpointing when i % checkpoint_every == 0.
template <typename Model>
void parallelize_blocks(Model& model, const fsdp::FullyShardOptions& block_options,
                        const fsdp::FullyShardOptions& root_options, int64_t checkpoint_every,
                        const std::string& caller) {
  TORCH_CHECK(checkpoint_every >= 1, caller, ": checkpoint_every must be >= 1");
  for (size_t i = 0; i < model->blocks.size(); ++i) {
    auto options = block_options;
    if (static_cast<int64_t>(i) % checkpoint_every != 0)
      options.activation_checkpointing(fsdp::CheckpointMode::kNone);
    fsdp::fully_shard(model->blocks[i], options);
  }
  fsdp::fully_shard(model, root_options);
}

}  // namespace fsdp_models::detail
