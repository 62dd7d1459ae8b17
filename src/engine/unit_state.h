// Where one unit is in a training step: its two state machines (as FSDP2's FSDPParamGroup has
// TrainingState and ShardedState) and the reasons it stays gathered, with every transition a
// method of UnitState and the invariants between them checked after each one.
//
// ShardedState   kSharded    only padded shards exist; params point at their sharded views
//                kGathering  an all-gather into the unsharded buffers is in flight
//                kUnsharded  the unsharded buffers are filled; params point at them
// TrainingState  kIdle         neither in a forward of this unit nor in its backward
//                kForward      inside fsdp::forward of this unit
//                kPreBackward  its backward runs in the current backward pass: gathered, its
//                              sharded grads stashed, autograd accumulating unsharded grads
//                kPostBackward turning the unsharded grads into a reduce-scatter
//
// Why a gathered unit stays gathered (ParamGroup::release() reshards only when none holds):
//   held         a forward call whose backward is still to come keeps it (the root call of the
//                model's forward, kShardGradOp, reshard_after_forward(false)); released by its
//                backward's reduction, by the end of the backward pass, or when the call's
//                graph dies
//   user_held    fsdp::unshard() keeps it until fsdp::reshard()
//   in a forward or a backward (TrainingState other than kIdle)
// and
//   counted      the gather occupies a slot of the rate limiter (Prefetcher) until the unit
//                reshards: a prefetch, or a unit's own gather for its compute
//   block_shards after a reshard to a block (reshard_after_forward_size), the unit keeps its
//                block of the gathered parameters for backward's smaller all-gather
//   grads_stashed the sharded grads were moved aside for this backward pass (put back, with
//                the reduced shards added, when the pass ends; unchanged when it fails)
//
// docs/design.md, "The unit state machine", has the transitions as a table. The invariants
// (checked with TORCH_INTERNAL_ASSERT after every transition, in every build: a few compares
// per unit per step):
//   I1 counted => gathered             a slot belongs to a gather in flight or done
//   I2 counted => !held                held memory is the strategy's, not the prefetch
//                                      pipeline's: holding gives the slot back
//   I3 held => gathered                a hold keeps the unsharded parameters
//   I4 block_shards => !kUnsharded     block shards live until the gather that uses them ends
//   I5 kForward => the state to return to is not kForward (no forward inside its own forward)
#pragma once

#include <string>

namespace fsdp::detail {

enum class ShardedState { kSharded, kGathering, kUnsharded };
enum class TrainingState { kIdle, kForward, kPreBackward, kPostBackward };

const char* to_string(ShardedState s);
const char* to_string(TrainingState s);

class UnitState {
 public:
  /// `name`: the unit's, for the assertion messages.
  explicit UnitState(const std::string* name) : name_(name) {}

  ShardedState sharded() const { return sharded_; }
  TrainingState training() const { return training_; }
  bool gathered() const { return sharded_ != ShardedState::kSharded; }
  bool counted() const { return counted_; }
  bool held() const { return held_; }
  bool user_held() const { return user_held_; }
  bool block_shards() const { return block_shards_; }
  bool grads_stashed() const { return grads_stashed_; }
  /// The current forward is the outermost fsdp::forward of the model.
  bool root_call() const { return root_call_; }
  /// Nothing keeps the unit gathered: release() may reshard it.
  bool releasable() const { return !user_held_ && !held_ && training_ == TrainingState::kIdle; }

  // ---- ShardedState ----
  /// kSharded -> kGathering. `counted`: the gather takes a rate-limiter slot.
  void gather_issued(bool counted);
  /// kGathering -> kUnsharded (the block shards, if any, were consumed by the gather).
  void gather_done();
  /// kGathering | kUnsharded -> kSharded. Returns whether the gather held a slot, which the
  /// caller gives back to the Prefetcher (exactly once: the flag is cleared here).
  [[nodiscard]] bool resharded();
  /// In kSharded, after a reshard to a block: the unit keeps its block of the parameters.
  void kept_block_shards();
  void dropped_block_shards();

  // ---- TrainingState ----
  /// Any state but kForward -> kForward (the caller refuses a forward inside its own forward).
  void forward_entered(bool root_call);
  /// kForward -> the state the forward started in (kPreBackward for a recomputation).
  void forward_exited();
  /// kIdle -> kPreBackward; the sharded grads are stashed from now until the pass closes.
  void backward_began();
  /// kPreBackward -> kPostBackward.
  void reduce_began();
  /// kPostBackward -> kIdle.
  void reduce_done();
  /// The backward pass ended or was rolled back: -> kIdle (a unit inside a forward stays in
  /// kForward and returns to kIdle), no hold from the pass, grads no longer stashed.
  void pass_closed();

  // ---- Holds ----
  /// Held from forward into backward. Returns whether the gather's slot must be given back.
  [[nodiscard]] bool hold_for_backward();
  void release_hold();
  void set_user_held(bool held);

  /// "kUnsharded, kIdle, held, counted": for messages.
  std::string describe() const;

 private:
  void check() const;

  const std::string* name_;
  ShardedState sharded_ = ShardedState::kSharded;
  TrainingState training_ = TrainingState::kIdle;
  TrainingState before_forward_ = TrainingState::kIdle;
  bool counted_ = false;
  bool held_ = false;
  bool user_held_ = false;
  bool block_shards_ = false;
  bool grads_stashed_ = false;
  bool root_call_ = false;
};

}  // namespace fsdp::detail
