// One FSDP unit: the parameters that are gathered together, computed with, and freed together.
//
// A unit moves through two state machines (asserted at every transition):
//
//   ShardedState  SHARDED    only padded shards exist; params point at their sharded views
//                 UNSHARDED  the unsharded buffers are allocated and filled; params point at them
//
//   TrainingState IDLE           between passes
//                 FORWARD        inside fsdp::forward of this unit
//                 PRE_BACKWARD   gathered for backward; autograd is accumulating unsharded grads
//                 POST_BACKWARD  reduce-scattering grads into the shards
//
// One step of a non-root unit under FULL_SHARD:
//   pre_forward:   all-gather (SHARDED -> UNSHARDED), wrap inputs in the post-backward identity
//   post_forward:  reshard (-> SHARDED), hook the outputs
//   pre_backward:  (first output grad) stash sharded grads, all-gather again (-> UNSHARDED)
//   post_backward: (input grads done, or the end-of-backward callback) reduce-scatter the
//                  unsharded grads into the sharded grads, reshard (-> SHARDED)
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <memory>
#include <string>
#include <vector>

#include <fsdp/fully_shard.h>

#include "collectives.h"
#include "sharded_param.h"

namespace fsdp::detail {

enum class ShardedState { kSharded, kUnsharded };
enum class TrainingState { kIdle, kForward, kPreBackward, kPostBackward };

class ParamGroup : public std::enable_shared_from_this<ParamGroup> {
 public:
  ParamGroup(std::string name, std::vector<std::pair<std::string, torch::Tensor>> params,
             FullyShardOptions options);

  const std::string& name() const { return name_; }
  ProcessGroup& group() const { return *options_.group(); }
  const FullyShardOptions& options() const { return options_; }
  const std::vector<ShardedParam>& params() const { return params_; }
  ShardedState sharded_state() const { return sharded_state_; }
  TrainingState training_state() const { return training_state_; }

  std::vector<torch::Tensor> pre_forward(std::vector<torch::Tensor> inputs, bool is_root_call);
  void post_forward(const std::vector<torch::Tensor>& outputs, bool is_root_call);
  /// The module's forward threw: reshard, forget the pending backward, return to IDLE.
  void abandon_forward() noexcept;
  void pre_backward();
  void post_backward();
  /// End of a backward pass: whatever the hooks did not finish (a unit whose inputs needed no
  /// grad, the root) is finished here, then the unit is resharded.
  void finish_backward();

  /// false: backward keeps unsharded grads locally instead of reduce-scattering them
  /// (accumulation without communication); the next backward with true sends the sum.
  void set_requires_gradient_sync(bool sync) { requires_gradient_sync_ = sync; }

  /// Gathers the unit's parameters (one all-gather for the whole unit).
  void unshard();
  /// Frees the unsharded parameters.
  void reshard();

  /// Bytes of the padded shards this rank holds, and of the unit when unsharded.
  int64_t sharded_bytes() const;
  int64_t unsharded_bytes() const;

 private:
  void check_state(ShardedState expected, const char* where) const;
  [[noreturn]] void fail(const std::string& msg) const;

  std::string name_;
  FullyShardOptions options_;
  std::vector<ShardedParam> params_;
  ShardedState sharded_state_ = ShardedState::kSharded;
  TrainingState training_state_ = TrainingState::kIdle;
  // Set by a forward under grad mode; cleared once the backward's post-backward ran.
  bool backward_pending_ = false;
  bool pre_backward_done_ = false;
  bool requires_gradient_sync_ = true;
};

/// Whether a forward of some unit is running on this thread (the outermost one is the root).
bool in_unit_forward();

}  // namespace fsdp::detail
