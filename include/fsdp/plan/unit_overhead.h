// The engine's fixed cost per unit and micro-batch (fsdp::plan, issue 26): what a step pays for
// each unit beyond its compute and the bandwidth of its collectives: fsdp::forward's hooks, the
// calls of its gathers and reductions (their latency), the per-parameter copies into and out
// of the flat buffers, casts, the autograd nodes. On a CPU it is a large share of a small
// model's step (about 3 ms per unit per micro-batch with bf16 on 2 ranks of this project's
// 2-core machines), and it grows with the number of micro-batches, not with their size, so a
// planner without it prefers many small micro-batches too much.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>

#include <fsdp/fully_shard.h>

namespace fsdp {
class ProcessGroup;
}

namespace fsdp::plan {

struct UnitOverhead {
  double per_unit_s = 0;
  double per_param_s = 0;
  /// Seconds one unit of `params` parameter tensors adds to one micro-batch.
  double seconds(int64_t params) const;
};

/// Times training steps (forward, backward, gradients reduced) of models of tiny Linear units
/// sharded over `group` with `strategy` and `param_dtype`: 12 units and 2 units of 1 Linear
/// each, and of 6 Linear each. The difference per unit is its fixed cost; the difference
/// between the two widths, the cost per parameter tensor. The slowest rank's median of `steps`
/// steps. Every rank of the group calls it at once.
UnitOverhead measure_unit_overhead(const std::shared_ptr<ProcessGroup>& group,
                                   ShardingStrategy strategy, c10::ScalarType param_dtype,
                                   int steps = 21);

}  // namespace fsdp::plan
