// One FSDP unit: the parameters that are gathered together, computed with, and freed together.
//
// A unit moves through two state machines (asserted at every transition):
//
//   ShardedState  SHARDED    only padded shards exist; params point at their sharded views
//                 GATHERING  an all-gather into the unsharded buffers is in flight
//                 UNSHARDED  the unsharded buffers are filled; params point at them
//
//   TrainingState IDLE           between passes
//                 FORWARD        inside fsdp::forward of this unit
//                 PRE_BACKWARD   gathered for backward; autograd is accumulating unsharded grads
//                 POST_BACKWARD  turning the unsharded grads into sharded ones
//
// One step of a non-root unit under FULL_SHARD:
//   pre_forward:   all-gather (-> UNSHARDED), prefetch the next unit, wrap inputs in the
//                  post-backward identity
//   post_forward:  reshard (-> SHARDED), hook the outputs
//   pre_backward:  (first output grad) stash sharded grads, all-gather again, prefetch
//   post_backward: (input grads done, or the end-of-backward callback) copy the unsharded
//                  grads into a reduce-scatter buffer, reshard, issue the reduce-scatter;
//                  it completes while the next unit computes (finish_reduce_scatter)
//   end of backward: finish_reduce(): the cross-replica all-reduce (hybrid, no-shard) and
//                  the sharded grads put in place
//
// Strategies are combinations of three groups: the shard group (nullptr for kNoShard), the
// replicate group (kNoShard, kHybridShard) and the post-forward group (reshard after forward
// to a block of ranks). Prefetch and the rate limiter live in prefetch.h.
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fsdp/fully_shard.h>

#include "collectives.h"
#include "sharded_param.h"

namespace fsdp::detail {

enum class ShardedState { kSharded, kGathering, kUnsharded };
enum class TrainingState { kIdle, kForward, kPreBackward, kPostBackward };

/// The process groups one unit communicates over, resolved from its options.
struct UnitGroups {
  std::shared_ptr<ProcessGroup> shard;         // null: parameters not sharded
  std::shared_ptr<ProcessGroup> replicate;     // null: no replicas
  std::shared_ptr<ProcessGroup> post_forward;  // null: reshard fully after forward
};

class ParamGroup : public std::enable_shared_from_this<ParamGroup> {
 public:
  ParamGroup(std::string name, std::vector<std::pair<std::string, torch::Tensor>> params,
             FullyShardOptions options, UnitGroups groups);

  const std::string& name() const { return name_; }
  const FullyShardOptions& options() const { return options_; }
  const UnitGroups& groups() const { return groups_; }
  int shard_size() const { return groups_.shard ? groups_.shard->size() : 1; }
  const std::vector<ShardedParam>& params() const { return params_; }
  ShardedState sharded_state() const { return sharded_state_; }
  TrainingState training_state() const { return training_state_; }
  bool backward_pending() const { return backward_pending_; }
  /// Kept gathered from forward into backward (the root, kShardGradOp).
  bool held() const { return held_; }

  std::vector<torch::Tensor> pre_forward(std::vector<torch::Tensor> inputs, bool is_root_call);
  void post_forward(const std::vector<torch::Tensor>& outputs, bool is_root_call);
  /// The module's forward threw: reshard, forget the pending backward, return to IDLE.
  void abandon_forward() noexcept;
  void pre_backward();
  void post_backward();
  /// End of a backward pass: whatever the hooks did not finish (a unit whose inputs needed no
  /// grad, the root) is finished here.
  void finish_backward();

  /// Completes this unit's reduce-scatter if one is in flight and issues the cross-replica
  /// all-reduce that follows it. Bounds the reduce-scatter buffers alive at once.
  void finish_reduce_scatter();
  /// Completes all gradient communication of the last post_backward and installs the grads.
  void finish_reduce();
  bool reduce_pending() const { return reduce_.has_value(); }

  /// false: backward keeps unsharded grads locally instead of reduce-scattering them
  /// (accumulation without communication); the next backward with true sends the sum.
  void set_requires_gradient_sync(bool sync) { requires_gradient_sync_ = sync; }

  /// Starts gathering the unit's parameters (one all-gather for the whole unit). `counted`:
  /// the gather occupies a slot of the rate limiter until the unit reshards.
  void issue_unshard(bool counted);
  /// Waits for the gather and points the params at the unsharded tensors.
  void wait_unshard();
  void unshard(bool counted) {
    issue_unshard(counted);
    wait_unshard();
  }
  /// Frees the unsharded parameters (waiting for an in-flight gather first).
  void reshard();
  /// Drops the blocks kept by reshard-after-forward-to-a-block and the held flag: at the end
  /// of a backward, nothing of this step may stay.
  void reset_after_backward();

  /// Explicit prefetch lists (nullopt: follow the recorded order).
  std::optional<std::vector<std::weak_ptr<ParamGroup>>> forward_prefetch_list;
  std::optional<std::vector<std::weak_ptr<ParamGroup>>> backward_prefetch_list;

  /// Bytes of the padded shards this rank holds, and of the unit when unsharded.
  int64_t sharded_bytes() const;
  int64_t unsharded_bytes() const;

 private:
  // Gradient communication of one post_backward, in flight until finish_reduce().
  struct PendingReduce {
    std::vector<ShardedParam*> params;
    torch::Tensor input;   // reduce-scatter input (released when the reduce-scatter is done)
    torch::Tensor output;  // this rank's reduced shards, params.size() pieces back to back
    std::unique_ptr<CollectiveWork> reduce_scatter;
    std::vector<std::unique_ptr<CollectiveWork>> all_reduces;
    bool all_reduce_issued = false;
  };

  void issue_all_reduce();
  void release_slot();
  void check_state(ShardedState expected, const char* where) const;
  [[noreturn]] void fail(const std::string& msg) const;
  ProcessGroup& group() const { return *options_.group(); }

  std::string name_;
  FullyShardOptions options_;
  UnitGroups groups_;
  std::vector<ShardedParam> params_;
  ShardedState sharded_state_ = ShardedState::kSharded;
  TrainingState training_state_ = TrainingState::kIdle;
  std::unique_ptr<CollectiveWork> gather_;
  bool counted_ = false;
  bool held_ = false;
  bool block_shards_ = false;
  // Set by a forward under grad mode; cleared once the backward's post-backward ran.
  bool backward_pending_ = false;
  bool pre_backward_done_ = false;
  bool requires_gradient_sync_ = true;
  std::optional<PendingReduce> reduce_;
};

/// Whether a forward of some unit is running on this thread (the outermost one is the root).
bool in_unit_forward();

}  // namespace fsdp::detail
