// The unit state machine's transitions and invariants; see unit_state.h.
#include "unit_state.h"

#include <c10/util/Exception.h>

namespace fsdp::detail {

const char* to_string(ShardedState s) {
  switch (s) {
    case ShardedState::kSharded:
      return "kSharded";
    case ShardedState::kGathering:
      return "kGathering";
    case ShardedState::kUnsharded:
      return "kUnsharded";
  }
  return "?";
}

const char* to_string(TrainingState s) {
  switch (s) {
    case TrainingState::kIdle:
      return "kIdle";
    case TrainingState::kForward:
      return "kForward";
    case TrainingState::kPreBackward:
      return "kPreBackward";
    case TrainingState::kPostBackward:
      return "kPostBackward";
  }
  return "?";
}

std::string UnitState::describe() const {
  std::string s = std::string(to_string(sharded_)) + ", " + to_string(training_);
  if (training_ == TrainingState::kForward)
    s += std::string(" (from ") + to_string(before_forward_) + ")";
  for (auto [on, what] : {std::pair{held_, "held"},
                          {user_held_, "user_held"},
                          {counted_, "counted"},
                          {block_shards_, "block_shards"},
                          {grads_stashed_, "grads_stashed"}}) {
    if (on)
      s += std::string(", ") + what;
  }
  return s;
}

void UnitState::check() const {
  const bool ok_counted_gathered = !counted_ || gathered();
  const bool ok_counted_held = !(counted_ && held_);
  const bool ok_held_gathered = !held_ || gathered();
  const bool ok_block = !block_shards_ || sharded_ != ShardedState::kUnsharded;
  const bool ok_forward =
      training_ != TrainingState::kForward || before_forward_ != TrainingState::kForward;
  TORCH_INTERNAL_ASSERT(
      ok_counted_gathered && ok_counted_held && ok_held_gathered && ok_block && ok_forward,
      "fsdp unit '", *name_, "': state invariant broken (",
      !ok_counted_gathered ? "I1 counted => gathered"
      : !ok_counted_held   ? "I2 counted => !held"
      : !ok_held_gathered  ? "I3 held => gathered"
      : !ok_block          ? "I4 block_shards => !kUnsharded"
                           : "I5 no forward inside its own forward",
      "): ", describe());
}

namespace {

// A transition called from a state it does not leave from: a bug in the engine.
[[noreturn]] void bad_transition(const std::string& name, const char* transition,
                                 const std::string& state) {
  TORCH_INTERNAL_ASSERT(false, "fsdp unit '", name, "': ", transition, " from ", state);
}

}  // namespace

void UnitState::gather_issued(bool counted) {
  if (sharded_ != ShardedState::kSharded)
    bad_transition(*name_, "gather_issued", describe());
  sharded_ = ShardedState::kGathering;
  counted_ = counted;
  check();
}

void UnitState::gather_done() {
  if (sharded_ != ShardedState::kGathering)
    bad_transition(*name_, "gather_done", describe());
  sharded_ = ShardedState::kUnsharded;
  check();
}

bool UnitState::resharded() {
  if (sharded_ == ShardedState::kSharded)
    bad_transition(*name_, "resharded", describe());
  sharded_ = ShardedState::kSharded;
  const bool give_back = counted_;
  counted_ = false;
  check();
  return give_back;
}

void UnitState::kept_block_shards() {
  if (sharded_ != ShardedState::kSharded || block_shards_)
    bad_transition(*name_, "kept_block_shards", describe());
  block_shards_ = true;
  check();
}

void UnitState::dropped_block_shards() {
  block_shards_ = false;
  check();
}

void UnitState::forward_entered(bool root_call) {
  if (training_ == TrainingState::kForward)
    bad_transition(*name_, "forward_entered", describe());
  before_forward_ = training_;
  training_ = TrainingState::kForward;
  root_call_ = root_call;
  check();
}

void UnitState::forward_exited() {
  if (training_ != TrainingState::kForward)
    bad_transition(*name_, "forward_exited", describe());
  training_ = before_forward_;
  before_forward_ = TrainingState::kIdle;
  check();
}

void UnitState::backward_began() {
  if (training_ != TrainingState::kIdle)
    bad_transition(*name_, "backward_began", describe());
  training_ = TrainingState::kPreBackward;
  grads_stashed_ = true;
  check();
}

void UnitState::reduce_began() {
  if (training_ != TrainingState::kPreBackward)
    bad_transition(*name_, "reduce_began", describe());
  training_ = TrainingState::kPostBackward;
  check();
}

void UnitState::reduce_done() {
  if (training_ != TrainingState::kPostBackward)
    bad_transition(*name_, "reduce_done", describe());
  training_ = TrainingState::kIdle;
  check();
}

void UnitState::pass_closed() {
  if (training_ == TrainingState::kForward)
    before_forward_ = TrainingState::kIdle;
  else
    training_ = TrainingState::kIdle;
  held_ = false;
  grads_stashed_ = false;
  check();
}

bool UnitState::hold_for_backward() {
  held_ = true;
  const bool give_back = counted_;
  counted_ = false;
  check();
  return give_back;
}

void UnitState::release_hold() {
  held_ = false;
  check();
}

void UnitState::set_user_held(bool held) {
  user_held_ = held;
  check();
}

}  // namespace fsdp::detail
