// The model states one rank holds between steps (fsdp::plan, issue 26): its parameter shards,
// its gradient shards and its optimizer state, in bytes, by the categories fsdp::memory
// measures (kParams, kGrads, kOptimizer), computed from the units alone with the engine's own
// layout rules (dim-0 shards padded to ceil(rows / shard ranks) rows; a unit's gradients kept
// in its reduce-scatter output; the fused optimizers' state in 64-element slots). These are the
// persistent part of the per-rank memory; what lives only during a step (gathered parameters,
// activations, collective buffers) is not in it.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <vector>

#include <fsdp/fully_shard.h>
#include <fsdp/plan/units.h>

namespace fsdp::plan {

enum class Optimizer {
  kNone,
  kSgd,          // no state
  kSgdMomentum,  // one moment
  kAdamW,        // two moments
};

struct StateOptions {
  int world_size = 1;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  /// kHybridShard: ranks per shard block (must divide world_size).
  int hybrid_shard_size = 0;
  /// MixedPrecisionPolicy's dtypes: the gradients are reduced in reduce_dtype (else
  /// param_dtype, else the parameter's own).
  std::optional<torch::ScalarType> param_dtype;
  std::optional<torch::ScalarType> reduce_dtype;
  /// The root unit (path "") without mixed precision (fsdp-train's precision.root_fp32): it
  /// gathers, computes and reduces in its parameters' own dtype.
  bool root_full_precision = false;
  /// CPUOffloadPolicy: the reduced gradients are copied to host tensors of their own.
  bool cpu_offload = false;
  Optimizer optimizer = Optimizer::kAdamW;
  /// fsdp::FusedAdamW / FusedSGD (state in one flat buffer per moment, 64-element slots) or
  /// torch::optim (a moment tensor per parameter, in the parameter's dtype).
  bool fused = true;
  /// Fused optimizers: OptimizerStateOptions::moments_dtype.
  torch::ScalarType moments_dtype = torch::kFloat32;
  /// Fused optimizers: the state in a file (OptimizerStateOptions::offload_dir set), streamed
  /// through two chunk buffers of about chunk_bytes (OptimizerStateOptions::chunk_bytes).
  bool optimizer_in_file = false;
  int64_t chunk_bytes = int64_t{64} << 20;
};

struct RankStates {
  int64_t params = 0;
  int64_t grads = 0;
  int64_t optimizer = 0;
  int64_t total() const { return params + grads + optimizer; }
};

/// What `rank` holds after a backward and an optimizer step, before the gradients are zeroed
/// (every trainable parameter received a gradient). Throws for a hybrid_shard_size that does
/// not divide world_size.
RankStates model_states(const std::vector<UnitInfo>& units, const StateOptions& options, int rank);

}  // namespace fsdp::plan
