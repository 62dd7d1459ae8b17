// The world as a 2-D mesh: data parallel (dp) by tensor parallel (tp).
//
// Ranks are placed tp-major: ranks [k * tp, (k + 1) * tp) form tensor-parallel group k, so with
// the ranks of a node numbered together and tp at most the ranks per node, tensor parallelism
// (an all-reduce per layer, on the critical path) stays inside a node and only the
// data-parallel traffic (FSDP's gathers and reductions, which overlap compute) crosses nodes, as
// torchtitan's init_device_mesh(("dp", "tp")) does. Rank r's data-parallel group is the ranks at
// the same position r % tp of every block.
#pragma once

#include <memory>

#include <fsdp/distributed/process_group.h>

namespace fsdp {

struct DeviceMesh2D {
  std::shared_ptr<ProcessGroup> dp;  // size world / tp: shard (and replicate) across it
  std::shared_ptr<ProcessGroup> tp;  // size tp: the layers are split across it
  int dp_rank() const { return dp->rank(); }
  int tp_rank() const { return tp->rank(); }
};

/// The mesh of `world` with tensor-parallel degree `tp` (which must divide world.size()).
/// Collective: every rank of `world` calls it, with the same `tp`.
DeviceMesh2D make_device_mesh(ProcessGroup& world, int tp);

}  // namespace fsdp
