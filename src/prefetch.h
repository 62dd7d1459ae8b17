// Prefetch and the rate limiter: which unit to gather ahead of need, and when not to.
//
// Overlap comes from issuing a unit's all-gather before the unit runs: the backend moves the
// bytes on its own threads (Gloo's worker threads on CPU, a NCCL stream on CUDA) while this
// thread computes the current unit. The schedule is per thread, like autograd's:
//  - forward: the units' order in the previous forward of the same root is recorded; when a
//    unit starts, the one after it in that order is requested (or its explicit list).
//  - backward: the order is the root first (its outputs are the first to get gradients),
//    then the other units of this step's forward in reverse; the next unit that still has a
//    backward pending is requested at kBackwardPre or kBackwardPost.
//  - rate limiter: a request is issued only while fewer than max_inflight_all_gathers units
//    hold a slot (a counted gather, from issue to reshard); otherwise it waits in a queue and
//    is issued when a slot frees. The running unit's own gather is never deferred.
// Every rank runs the same code on the same model, so every rank issues the same collectives
// in the same order, which is all the backend needs to match them.
#pragma once

#include <memory>
#include <vector>

namespace fsdp::detail {

class ParamGroup;

namespace prefetch {

/// The root's forward begins: start recording; the root's limit applies until its backward
/// ends.
void begin_forward(ParamGroup& root);
/// A unit's forward begins (after begin_forward for the root itself).
void record_forward(ParamGroup& unit);
/// The root's forward ended (or threw): keep the recorded order; release what was gathered
/// ahead but never used, and forget deferred requests.
void end_forward();
/// The end-of-backward callback ran: forget deferred requests.
void end_backward();

/// The units to gather ahead when `unit`'s forward starts / its backward reaches the
/// prefetch point.
std::vector<std::shared_ptr<ParamGroup>> forward_targets(const ParamGroup& unit);
std::vector<std::shared_ptr<ParamGroup>> backward_targets(const ParamGroup& unit);

/// Gathers `unit` ahead through the rate limiter (nothing if it is gathered or queued).
void request(ParamGroup& unit);
/// `unit` is about to gather for its own compute: drop it from the queue.
void claim(const ParamGroup& unit);
/// Slot accounting, called by ParamGroup when a counted gather starts and when it ends.
void acquire_slot();
void release_slot();
/// Slots in use now, and the most used at once since the last reset_high_water().
int slots_in_use();
int slots_high_water();
void reset_high_water();

}  // namespace prefetch
}  // namespace fsdp::detail
