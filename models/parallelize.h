// The one way both model families are sharded (parallelize_gpt, parallelize_llama): a unit per
// block, then the root unit for what is left (embeddings, final norm, head).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

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

/// "<prefix>0" ... "<prefix>n-1", then "" (the root): the module paths of the units
/// parallelize_blocks makes of a model whose blocks are registered as <prefix><i>.
inline std::vector<std::string> block_unit_paths(const std::string& prefix, int64_t n_blocks) {
  std::vector<std::string> paths;
  for (int64_t i = 0; i < n_blocks; ++i) {
    std::string path(prefix);  // (appended: GCC 12 misreports prefix + string as an overflow)
    path += std::to_string(i);
    paths.push_back(path);
  }
  paths.push_back("");
  return paths;
}

}  // namespace fsdp_models::detail
