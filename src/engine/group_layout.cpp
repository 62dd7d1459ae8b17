// See include/fsdp/detail/group_layout.h.
#include <fsdp/detail/group_layout.h>

#include <c10/util/Exception.h>

namespace fsdp::detail {

bool frees_after_forward(ShardingStrategy strategy, std::optional<bool> reshard_after_forward) {
  return strategy != ShardingStrategy::kShardGradOp && reshard_after_forward.value_or(true);
}

bool reshards_after_forward(ShardingStrategy strategy, std::optional<bool> reshard_after_forward) {
  return strategy != ShardingStrategy::kNoShard &&
         frees_after_forward(strategy, reshard_after_forward);
}

GroupLayout group_layout(ShardingStrategy strategy, int hybrid_shard_size,
                         std::optional<bool> reshard_after_forward, int reshard_after_forward_size,
                         int world_size, int rank) {
  TORCH_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "fsdp: rank ", rank,
              " of a group of ", world_size);
  GroupLayout g;
  g.frees_after_forward = frees_after_forward(strategy, reshard_after_forward);
  switch (strategy) {
    case ShardingStrategy::kFullShard:
    case ShardingStrategy::kShardGradOp:
      g.shard_size = world_size;
      break;
    case ShardingStrategy::kNoShard:
      g.replicate_size = world_size;
      break;
    case ShardingStrategy::kHybridShard:
      // Blocks of consecutive ranks (a host's, usually), replicated across blocks.
      TORCH_CHECK(hybrid_shard_size >= 1 && world_size % hybrid_shard_size == 0,
                  "fully_shard: hybrid_shard_size ", hybrid_shard_size,
                  " must be at least 1 and divide the group's ", world_size, " ranks");
      g.shard_size = hybrid_shard_size;
      g.replicate_size = world_size / hybrid_shard_size;
      break;
  }
  g.shard_rank = rank % g.shard_size;
  // A shard group exists (a process group of its own, or the whole group) for every strategy
  // but kNoShard and a hybrid of blocks of one (plain replication); one rank is a group too.
  const bool shard_group = strategy != ShardingStrategy::kNoShard &&
                           !(strategy == ShardingStrategy::kHybridShard && g.shard_size == 1);
  const int k = reshard_after_forward_size;
  if (k > 1 && reshards_after_forward(strategy, reshard_after_forward) && shard_group) {
    TORCH_CHECK(g.shard_size % k == 0, "fully_shard: reshard_after_forward_size ", k,
                " must divide the shard group's ", g.shard_size, " ranks");
    if (k < g.shard_size)
      g.post_forward_size = k;
  }
  return g;
}

}  // namespace fsdp::detail
