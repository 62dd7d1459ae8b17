// What one unit allocates on one rank, in bytes: each parameter's buffers as the engine lays
// them out (fsdp/detail/param_layout.h, which ShardedParam allocates from), and the unit's
// reduction buffers by the engine's rules (param_group.cpp, int8_reduce.cpp). Shared by the
// memory replay (step_memory.cpp) and the time model (step_time.cpp), which needs the same
// bytes as traffic.
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <set>
#include <string>

#include <fsdp/detail/buffer_lifetimes.h>
#include <fsdp/detail/group_layout.h>
#include <fsdp/detail/param_layout.h>
#include <fsdp/mixed_precision.h>
#include <fsdp/plan/step_memory.h>

namespace fsdp::plan::detail {

inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

inline int64_t esize(torch::ScalarType t) {
  return static_cast<int64_t>(c10::elementSize(t));
}

// What one unit allocates on this rank, in bytes (sharded_param.cpp and param_group.cpp).
struct UnitBytes {
  int64_t gathered = 0;       // the padded unsharded parameters (alloc_unsharded)
  int64_t gather_inputs = 0;  // sent and received copies alive from issue to wait
  int64_t gather_wire = 0;    // bytes the gather outputs (the backend's view of it)
  int64_t staging = 0;        // Gloo's flat buffers for one call of the gather (kOther)
  int64_t block_staging = 0;  // the same for the gather from a kept block
  int64_t block_shard = 0;    // reshard_after_forward_size: kept between forward and backward
  int64_t unsharded_grads = 0;
  int64_t unsharded_grads_post = 0;  // root: of which the head's (made by the post piece)
  int64_t unsharded_grads_tied = 0;  // root: of those, the ones the embedding adds to
  int64_t reduce_input = 0;          // [N][chunks | flags] in the reduce dtype; int8: the wire
  int64_t reduce_staging = 0;        // int8: the reduce-dtype input, freed once encoded
  int64_t decode_scratch = 0;        // int8: the N decoded pieces, while summed at the wait
  int64_t residual = 0;              // int8 with error feedback: kept between steps
  int64_t reduce_received = 0;       // Gloo: the all-to-all's receive buffer, as large
  int64_t reduce_output = 0;         // [chunks | flags]: 0 when N == 1 (the input is the output)
  int64_t final_grads = 0;           // what the stash holds after install_grads
  int64_t kept_grads = 0;            // no-sync micro-batches: unsharded grads in the master dtype
  bool trainable = false;
  fsdp::detail::ReduceKind reduce_kind = fsdp::detail::ReduceKind::kLocal;
};

/// The bytes of one of the engine's step buffers (fsdp/detail/buffer_lifetimes.h) in a unit.
/// `holds_block`: the unit keeps a block of its parameters (reshard_after_forward_size), and its
/// next gather sends that block itself.
inline int64_t buffer_bytes(const UnitBytes& u, fsdp::detail::UnitBuffer buffer, bool holds_block) {
  using fsdp::detail::UnitBuffer;
  const bool int8 = u.reduce_kind == fsdp::detail::ReduceKind::kInt8;
  switch (buffer) {
    case UnitBuffer::kUnsharded:
      return u.gathered;
    case UnitBuffer::kGatherInFlight:
      return holds_block ? 0 : u.gather_inputs;
    case UnitBuffer::kBlockShards:
      return holds_block ? u.block_shard : 0;
    case UnitBuffer::kReduceRows:
      return int8 ? u.reduce_staging : u.reduce_input;
    case UnitBuffer::kReduceWire:
      return int8 ? u.reduce_input : 0;
    case UnitBuffer::kReduceReceived:
      return int8 ? u.reduce_received : 0;
    case UnitBuffer::kReduceOutput:
      return u.reduce_output;
  }
  return 0;
}

/// The backend's receive buffer of a reduce-scatter over Gloo (not the engine's: Gloo allocates
/// it from the issue until the collective completes).
inline int64_t backend_received_bytes(const UnitBytes& u) {
  return u.reduce_kind == fsdp::detail::ReduceKind::kInt8 ? 0 : u.reduce_received;
}

struct Geometry {
  int n = 1;  // shard group size
  int r = 0;  // rank in it
};

/// The shard group of `rank`, as fully_shard makes it (fsdp/detail/group_layout.h).
inline Geometry shard_group(const StateOptions& s, int rank) {
  const auto l = fsdp::detail::group_layout(s.strategy, s.hybrid_shard_size, std::nullopt, 0,
                                            s.world_size, rank);
  return Geometry{l.shard_size, l.shard_rank};
}

inline UnitBytes unit_bytes(const UnitInfo& unit, const StepOptions& o, const Geometry& g,
                            const std::optional<int>& block_k, const std::set<std::string>& post,
                            const std::set<std::string>& pre) {
  UnitBytes u;
  const auto& s = o.states;
  const int n = g.n;
  // precision.root_fp32: the root has no MixedPrecisionPolicy (no cast, no gather format).
  const bool mixed = !(s.root_full_precision && unit.path.empty());
  MixedPrecisionPolicy mp;
  if (mixed) {
    mp.param_dtype(s.param_dtype)
        .reduce_dtype(s.reduce_dtype)
        .gather_format(o.gather_format)
        .int8_block_size(o.int8_block_size);
  }
  int64_t flags = 0, chunk_elems = 0, local_grad_bytes = 0;
  torch::ScalarType master = torch::kFloat32;
  for (const auto& p : unit.params) {
    // What the engine allocates for it, as the engine lays it out (ShardedParam).
    const auto l = fsdp::detail::param_layout(p.shape, p.dtype, g.r, n, mp, s.cpu_offload);
    const int64_t unsharded_size = esize(l.unsharded_dtype);
    u.gathered += l.unsharded_bytes();
    if (n > 1) {
      // issue_unshard: gather_input() and gather_output(), both kept until wait_unshard.
      u.gather_inputs += l.gather_input_bytes() + l.gather_output_bytes();
      u.gather_wire += l.gather_wire_bytes();
      if (block_k)
        u.block_shard += l.block_shard_bytes(*block_k);
    }
    if (!p.trainable)
      continue;
    u.trainable = true;
    master = p.dtype;
    ++flags;
    chunk_elems += l.shard_numel();
    u.unsharded_grads += l.numel() * unsharded_size;
    if (post.count(p.name))
      u.unsharded_grads_post += l.numel() * unsharded_size;
    if (post.count(p.name) && pre.count(p.name))
      u.unsharded_grads_tied += l.numel() * unsharded_size;
    u.kept_grads += l.kept_grad_bytes();
    local_grad_bytes += l.grad_shard_bytes();
  }
  if (o.gloo_staging && n > 1) {
    auto staged = [&](int64_t wire, int group) {
      const int64_t call =
          o.all_gather_bucket_bytes > 0 ? std::min(wire, o.all_gather_bucket_bytes) : wire;
      return call + call / group;
    };
    u.staging = staged(u.gather_wire, n);
    if (block_k)
      u.block_staging = staged(u.gathered, *block_k);
  }
  if (!u.trainable)
    return u;
  if (mixed)
    mp.reduce_format(o.reduce_format).error_feedback(o.error_feedback);
  const torch::ScalarType reduce = fsdp::detail::reduce_dtype_of(mp, master);
  // The unit's reduction as the engine lays it out (ParamGroup::reduce_gradients).
  const auto r = fsdp::detail::reduce_layout(chunk_elems, flags, n, reduce, mp);
  u.reduce_kind = r.int8  ? fsdp::detail::ReduceKind::kInt8
                  : n > 1 ? fsdp::detail::ReduceKind::kScatter
                          : fsdp::detail::ReduceKind::kLocal;
  if (r.int8) {
    // int8_reduce.cpp: the reduce-dtype input until it is encoded, the wire and the
    // all-to-all's receive buffer (as large) until the next reduction waits, the N decoded
    // rows while they are summed at the wait.
    u.reduce_staging = r.input_bytes();
    u.reduce_input = u.reduce_received = r.wire_bytes();
    u.reduce_output = r.output_bytes();
    u.decode_scratch = r.input_bytes();
    u.residual = r.residual_bytes(o.error_feedback);
  } else {
    u.reduce_input = r.input_bytes();
    u.reduce_received = o.gloo_reduce_scatter && n > 1 ? u.reduce_input : 0;
    u.reduce_output = r.output_bytes();
  }
  // install_grads / add_to_stash: aliases of the output when it is in the master dtype, else a
  // tensor of the real rows (a host copy under offload).
  const bool alias = !s.cpu_offload && reduce == master;
  u.final_grads = alias ? (n > 1 ? u.reduce_output : u.reduce_input) : local_grad_bytes;
  return u;
}

/// The shard group of `rank` under the strategy, and the reshard-to-k block size if it applies.
struct Layout {
  Geometry geometry;
  std::optional<int> block_k;
  bool blocks_reshard = true;
};

inline Layout layout_of(const StepOptions& o, int rank) {
  const auto& s = o.states;
  const auto g =
      fsdp::detail::group_layout(s.strategy, s.hybrid_shard_size, o.reshard_after_forward,
                                 o.reshard_after_forward_size, s.world_size, rank);
  Layout l;
  l.geometry = Geometry{g.shard_size, g.shard_rank};
  l.blocks_reshard = g.frees_after_forward;
  if (g.post_forward_size > 0)
    l.block_k = g.post_forward_size;
  return l;
}

}  // namespace fsdp::plan::detail
