// Prefetch and the rate limiter of one model: which unit to gather ahead of need, and when not to.
//
// Overlap comes from issuing a unit's all-gather before the unit runs: the backend moves the
// bytes on its own threads (Gloo's lane threads on CPU, a NCCL stream on CUDA) while this
// thread computes the current unit. One Prefetcher belongs to each model's RootState, so two
// models never share a schedule, and nothing here depends on which thread runs a hook.
//  - forward: the units' order in the model's previous forward is recorded (one entry per call,
//    so a unit called twice appears twice); when the k-th call of a forward starts, the unit of
//    the (k+1)-th call of the previous forward is requested (or the unit's explicit list).
//  - backward: the predicted order is the root call's unit first (its outputs are the first to
//    get gradients), then the other calls of the last forward in reverse. A cursor follows the
//    backward through it; at a unit's pre-backward (kBackwardPre) or after its reduce-scatter
//    is issued (kBackwardPost), the next unit in that order that still expects a backward is
//    requested.
//  - rate limiter: a request is issued only while fewer than max_inflight_all_gathers units hold
//    a slot (a counted gather, from issue to reshard); otherwise it waits in a queue and is
//    issued when a slot frees. A unit's own gather for its compute is never deferred.
// Every rank runs the same code on the same model, so every rank issues the same collectives in
// the same order, which is all the backend needs to match them. A wrong prediction (the graph
// changed) costs time or memory, never correctness: a unit gathered ahead and not used is freed
// when the forward ends or at the end of backward.
#pragma once

#include <deque>
#include <memory>
#include <vector>

namespace fsdp::detail {

class ParamGroup;

class Prefetcher {
 public:
  /// The model's forward begins (its outermost call): record the order anew; `limit` is the
  /// rate limiter's bound until the next forward.
  void begin_forward(int limit);
  /// A unit's forward call begins (called before forward_targets for it).
  void record_forward(ParamGroup& unit);
  /// The model's forward ended. A completed forward's order replaces the previous one; a forward
  /// that threw keeps the previous one. Deferred requests are dropped either way.
  void end_forward(bool completed);
  /// The model's backward pass begins (its first hook): predict the order, reset the cursor.
  void begin_backward();
  /// The backward pass ended: forget deferred requests.
  void end_backward();

  /// The units to gather ahead when `unit`'s forward call starts.
  std::vector<std::shared_ptr<ParamGroup>> forward_targets(const ParamGroup& unit) const;
  /// The units to gather ahead at `unit`'s backward prefetch point; advances the cursor.
  std::vector<std::shared_ptr<ParamGroup>> backward_targets(const ParamGroup& unit);

  /// Gathers `unit` ahead through the rate limiter (nothing if it is gathered or queued).
  void request(ParamGroup& unit);
  /// `unit` is about to gather for its own compute: drop it from the queue.
  void claim(const ParamGroup& unit);
  /// Forgets every deferred request (a forward or backward is failing: rolling back must not
  /// issue the gathers a freed slot would otherwise let through).
  void drop_queued() { queue_.clear(); }
  /// Slot accounting, called by ParamGroup when a counted gather starts and when it ends
  /// (UnitState::counted: a unit gives its slot back exactly once). Releasing a slot that is
  /// not in use is an engine bug and asserts; it is never clamped away.
  void acquire_slot();
  void release_slot();
  int slots_in_use() const { return in_use_; }
  /// The most slots used at once since the last reset_high_water().
  int slots_high_water() const { return high_water_; }
  void reset_high_water() { high_water_ = in_use_; }

 private:
  void issue_queued();

  std::vector<std::weak_ptr<ParamGroup>> recording_;  // this forward, one entry per call
  std::vector<std::weak_ptr<ParamGroup>> order_;      // the last completed forward
  std::vector<std::weak_ptr<ParamGroup>> backward_order_;
  size_t backward_cursor_ = 0;
  int limit_ = 2;
  int in_use_ = 0;
  int high_water_ = 0;
  std::deque<std::weak_ptr<ParamGroup>> queue_;
};

}  // namespace fsdp::detail
