// The groups a unit's sharding options make, by size, seen from one rank: fully_shard builds
// process groups of these sizes (resolve_groups, which asserts that they agree) and the planner
// predicts from the same function, so that the two cannot drift apart.
#pragma once

#include <optional>

#include <fsdp/fully_shard.h>

namespace fsdp::detail {

struct GroupLayout {
  int shard_size = 1;      // ranks a parameter is sharded over (1: not sharded)
  int shard_rank = 0;      // this rank's place among them
  int replicate_size = 1;  // shard groups whose gradients are averaged by an all-reduce
  /// reshard_after_forward_size: the ranks of the block whose gather a unit keeps between
  /// forward and backward (0: none; the parameters are freed, or kept whole).
  int post_forward_size = 0;
  /// The unit lets go of its unsharded parameters after forward (frees_after_forward).
  bool frees_after_forward = true;
};

/// Whether a unit lets go of its unsharded parameters after forward: every strategy but
/// kShardGradOp, unless reshard_after_forward(false). kNoShard "reshards" too: it points the
/// parameters back at their (whole) shards and frees a mixed-precision copy, which is what keeps
/// its memory equal to DDP's.
bool frees_after_forward(ShardingStrategy strategy, std::optional<bool> reshard_after_forward);

/// Whether a sharded unit frees its gathered parameters after forward (kFullShard and
/// kHybridShard, unless reshard_after_forward(false)): what reshard_after_forward_size applies
/// to, there being no gather to shrink under kNoShard.
bool reshards_after_forward(ShardingStrategy strategy, std::optional<bool> reshard_after_forward);

/// The groups of a unit on `rank` of a group of `world_size` ranks. Refuses (c10::Error) a
/// hybrid_shard_size or reshard_after_forward_size that does not divide what it splits.
GroupLayout group_layout(ShardingStrategy strategy, int hybrid_shard_size,
                         std::optional<bool> reshard_after_forward, int reshard_after_forward_size,
                         int world_size, int rank);

}  // namespace fsdp::detail
