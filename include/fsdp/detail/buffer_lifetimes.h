// When one unit's step buffers live: the engine frees each buffer at the transition this table
// names (ParamGroup::free_at, PendingReduce::free_at; at kInstalled, the last event of every
// reduction, by dropping the reduction's record) and the planner replays the same table at
// the same transitions (fsdp::plan's step memory). Their sizes come from param_layout.h, so both
// what the engine allocates and for how long are described once: moving a buffer's `freed` to a
// later event makes the engine keep it longer and the planner's prediction follow, with no edit
// in src/plan.
//
// The events, in the order one unit meets them in a step (a gather cycle, then a reduction):
//   kGatherIssued   issue_unshard: the unsharded buffers and the gather's copies are allocated
//   kGatherDone     wait_unshard: the gather landed (decoded, if encoded); params are unsharded
//   kBlockKept      post_forward (reshard_after_forward_size): a block of the gathered params kept
//   kResharded      reshard: the params point at their shards again
//   kReduceFilled   reduce_gradients: the unsharded grads were copied into the reduction's rows
//   kReduceIssued   the reduce-scatter (or ReduceFormat::kInt8's exchange, after encoding the
//                   rows) is issued, its output allocated
//   kScattered      finish_reduce_scatter: it landed (ReduceStage::kScattered)
//   kInstalled      the reduced shards became the grads (the pass's end, or the post-reduce hook)
//
// Only allocation points are fixed by the algorithm (a buffer exists from where the code that
// fills it runs); `allocated` records them for the planner. A buffer may be freed at any event
// from its `last_use` to the end of its cycle: the static_asserts below keep an edit of `freed`
// within that range.
#pragma once

#include <array>
#include <cstdint>
#include <span>

#include <fsdp/core/memory.h>

namespace fsdp::detail {

enum class UnitEvent : uint8_t {
  kGatherIssued,
  kGatherDone,
  kBlockKept,
  kResharded,
  kReduceFilled,
  kReduceIssued,
  kScattered,
  kInstalled,
};

enum class UnitBuffer : uint8_t {
  kUnsharded,       // the gathered parameters in the compute dtype (alloc_unsharded)
  kGatherInFlight,  // gather_input()'s cast or encoded copies and gather_output()'s wire buffers
  kBlockShards,     // reshard_after_forward_size: the block kept for backward's smaller gather
  kReduceRows,      // [N][chunks | flags] in the reduce dtype, the unsharded grads copied in
  kReduceWire,      // kInt8: the encoded rows the exchange sends
  kReduceReceived,  // kInt8: what the exchange receives, decoded at kScattered
  kReduceOutput,    // this rank's reduced shards and flags
};

/// How a unit's gradients travel, which decides the reduction buffers' lifetimes.
enum class ReduceKind : uint8_t {
  kScatter,  // a reduce-scatter over N > 1 ranks
  kInt8,     // ReduceFormat::kInt8: rows encoded into a wire, exchanged, decoded (N > 1)
  kLocal,    // one shard: the rows are the output (nothing to scatter)
};

struct Lifetime {
  UnitBuffer buffer;
  memory::Category category;  // the engine's CategoryScope where it is allocated
  UnitEvent allocated;
  UnitEvent freed;
  UnitEvent last_use;  // the earliest event `freed` may name
};

namespace lifetimes {

using C = memory::Category;
using E = UnitEvent;
using B = UnitBuffer;

inline constexpr std::array<Lifetime, 3> kGather{{
    {B::kUnsharded, C::kGathered, E::kGatherIssued, E::kResharded, E::kResharded},
    // Decoded into the unsharded buffers when the gather lands, then no longer read.
    {B::kGatherInFlight, C::kGathered, E::kGatherIssued, E::kGatherDone, E::kGatherDone},
    // Consumed by the next gather (UnitState's invariant I4: gone once it is done).
    {B::kBlockShards, C::kGathered, E::kBlockKept, E::kGatherDone, E::kGatherDone},
}};

inline constexpr std::array<Lifetime, 2> kScatter{{
    // The collective reads the rows until it completes.
    {B::kReduceRows, C::kGrads, E::kReduceFilled, E::kScattered, E::kScattered},
    {B::kReduceOutput, C::kGrads, E::kReduceIssued, E::kInstalled, E::kInstalled},
}};

inline constexpr std::array<Lifetime, 4> kInt8{{
    // Encoded into the wire before the exchange: only the wire travels.
    {B::kReduceRows, C::kGrads, E::kReduceFilled, E::kReduceIssued, E::kReduceIssued},
    {B::kReduceWire, C::kGrads, E::kReduceIssued, E::kScattered, E::kScattered},
    {B::kReduceReceived, C::kGrads, E::kReduceIssued, E::kScattered, E::kScattered},
    {B::kReduceOutput, C::kGrads, E::kReduceIssued, E::kInstalled, E::kInstalled},
}};

// One shard: the rows become the output (moved, not copied) and live until installed.
inline constexpr std::array<Lifetime, 1> kLocal{{
    {B::kReduceRows, C::kGrads, E::kReduceFilled, E::kInstalled, E::kInstalled},
}};

// A gather cycle runs kGatherIssued .. kResharded (block shards from kBlockKept to the next
// kGatherDone); a reduction kReduceFilled .. kInstalled.
constexpr bool valid(std::span<const Lifetime> table) {
  for (const auto& l : table) {
    const bool block = l.buffer == B::kBlockShards;
    if (block ? l.freed != E::kGatherDone
              : (l.freed < l.last_use || l.freed < l.allocated ||
                 (l.allocated <= E::kResharded) != (l.freed <= E::kResharded)))
      return false;
  }
  return true;
}
static_assert(valid(kGather) && valid(kScatter) && valid(kInt8) && valid(kLocal),
              "a buffer freed before its last use, or outside its cycle");

}  // namespace lifetimes

/// The gather cycle's buffers (every unit).
inline std::span<const Lifetime> gather_lifetimes() {
  return lifetimes::kGather;
}

/// A reduction's buffers.
inline std::span<const Lifetime> reduce_lifetimes(ReduceKind kind) {
  switch (kind) {
    case ReduceKind::kScatter:
      return lifetimes::kScatter;
    case ReduceKind::kInt8:
      return lifetimes::kInt8;
    case ReduceKind::kLocal:
      return lifetimes::kLocal;
  }
  return {};
}

}  // namespace fsdp::detail
