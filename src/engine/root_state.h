// The runtime state of one FSDP model (FSDP2's root FSDPState): its units, the nesting of its
// forward, its prefetch schedule and rate limiter, and its backward passes.
//
// A model is a root unit (the outermost sharded module) and every unit under it. fully_shard()
// makes each new unit the root of a RootState of its own and moves the states of the units
// already sharded under its module into it, so after the usual bottom-up application (blocks,
// then the model) one RootState holds all of them, in creation order. That order is the same
// on every rank, and every loop over the units that communicates runs in it.
//
// Nothing here is global or thread_local: two models in one process (teacher and student,
// generator and discriminator, an EMA copy) have two RootStates, and autograd may run the hooks
// on any thread (its device threads on CUDA). A RootState is driven by one thread at a time:
// the caller's, or autograd's while the caller is blocked in backward().
//
// Iterations. The outermost fsdp::forward of the model (forward depth 0, outside any backward)
// begins an iteration: calls whose graph has died since (an evaluation under grad mode, an
// exception between forward and backward) are forgotten and their holds released, and the
// prefetcher starts recording. Several forwards may precede one backward (two losses summed).
//
// Backward passes. The first hook of the model in a backward pass (autograd graph task) opens
// a pass and queues one end-of-backward callback on the engine for it; the callback finishes
// every unit (post-backward of units whose hooks did not finish, gradient communication, and a
// reshard of everything), so after every backward the model is sharded. If the pass fails (an
// exception in some node), autograd drops the callback without running it; the token it
// carries notices in its destructor, which runs before the exception reaches the caller, and
// rolls the pass back: collectives in flight are waited for, the sharded grads are what they
// were before the pass, and every unit is resharded. The next step then runs as if the failed
// pass had never started.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "prefetch.h"

namespace fsdp::detail {

class ParamGroup;

class RootState : public std::enable_shared_from_this<RootState> {
 public:
  /// Adds `unit` (created after every unit already here).
  void add(const std::shared_ptr<ParamGroup>& unit);
  /// Moves the units of `inner` into this state (an enclosing module was sharded).
  void adopt(RootState& inner);
  /// The live units, in creation order.
  std::vector<std::shared_ptr<ParamGroup>> units() const;
  /// Asserts that the rate limiter's slots in use are exactly the model's counted units (at
  /// the end of a forward and of a backward pass, where nothing is in between).
  void check_slots() const;
  /// The unit created last: the outermost module.
  std::shared_ptr<ParamGroup> root_unit() const;

  Prefetcher& prefetcher() { return prefetcher_; }

  // ---- Forward ----
  /// `unit`'s forward call begins; true if it is the model's outermost call (the root call).
  bool enter_forward(ParamGroup& unit);
  /// The call ended (failed: it threw). The root call's end ends the model's forward.
  void exit_forward(bool failed);
  /// Counts the model's forwards (root calls): the epoch of the forward running now.
  uint64_t epoch() const { return epoch_; }

  // ---- Backward ----
  /// A hook of this model runs in a backward pass: opens the pass (once per autograd graph
  /// task) and returns its id.
  uint64_t on_backward_hook();
  /// The backward pass open now, or 0.
  uint64_t pass_id() const { return open_pass_; }
  /// Some call of the model may still run its backward (the model waits for a backward).
  bool expects_backward() const;

  /// Reduce-scatters issued but not yet waited, oldest first. Each post-backward completes the
  /// earlier ones before issuing its own, so at most one unit's reduce-scatter buffers are
  /// alive while the next unit computes (FSDP2 does the same).
  void track_reduce_scatter(ParamGroup& unit);
  void finish_reduce_scatters();
  /// A reduce point of the pass (`current` has just issued its reduction): runs the
  /// post-reduce hooks of the other units whose reductions are complete
  /// (ParamGroup::run_post_reduce_hook), then starts the next round.
  void run_post_reduce_hooks(const ParamGroup* current);
  /// Counts reduce points; all-reduces issued in the current round are not waited for yet.
  uint64_t reduce_round() const { return reduce_round_; }

 private:
  struct PassToken;
  void begin_iteration(ParamGroup& root_call);
  void end_backward_pass(uint64_t pass);
  void abort_backward_pass(uint64_t pass) noexcept;

  std::vector<std::weak_ptr<ParamGroup>> units_;
  Prefetcher prefetcher_;
  std::vector<std::weak_ptr<ParamGroup>> reducing_;
  uint64_t reduce_round_ = 1;
  int forward_depth_ = 0;
  // The current root call began an iteration (it ran outside any backward pass).
  bool iteration_open_ = false;
  uint64_t epoch_ = 0;
  // Backward passes: ids count from 1; 0 is "no pass open".
  uint64_t last_pass_ = 0;
  uint64_t open_pass_ = 0;
};

}  // namespace fsdp::detail
