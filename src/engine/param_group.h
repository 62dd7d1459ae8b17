// One FSDP unit: the parameters that are gathered together, computed with, and freed together.
//
// A unit moves through two state machines, ShardedState and TrainingState, and is kept
// gathered for a few reasons: all of it lives in UnitState (unit_state.h), whose methods are the
// only transitions and which checks the invariants between them. The end of every backward pass
// reshards every unit that fsdp::unshard() does not hold.
//
// One training step of a non-root unit under FULL_SHARD:
//   pre_forward:   all-gather (-> UNSHARDED), prefetch the next unit; the tensor inputs that
//                  require grad go through the post-backward identity (PostBackward)
//   post_forward:  reshard (-> SHARDED); hook the outputs that require grad; remember the call
//                  (CallRecord) so its backward can be recognised
//   pre_backward:  (a call's first output gradient) stash the sharded grads, all-gather again,
//                  prefetch
//   post_backward: (the call's PostBackward node, or the end-of-backward callback for a unit
//                  whose calls did not signal their end) copy the unsharded
//                  grads into a reduce-scatter buffer, reshard, issue the reduce-scatter; it
//                  completes while the next unit computes (finish_reduce_scatter)
//   end of backward: wait_reduces(): the cross-replica all-reduce (hybrid, no-shard) done;
//                  install_grads(): the reduced shards added to the grads; end_backward_pass():
//                  commit, reshard, forget the calls of the pass
//
// A unit called k times before one backward (a shared layer, two losses summed, a Siamese
// encoder) keeps one record per call. Each call's backward gathers the unit if it is not
// gathered, and reduces when it ends, unless another call of the unit is in the middle of its
// backward at that moment (its backwards interleave): the reduction then waits for that one.
// So a unit called twice far apart costs one more all-gather and reduce-scatter instead of
// staying gathered, with its unsharded grads, across everything in between; the reduced
// shards of one pass add up before they reach the grads (end of backward). A frozen unit (no
// trainable parameter) whose outputs require grad is gathered for its backward the same way
// and reduces nothing.
//
// Strategies are combinations of three groups: the shard group (nullptr for kNoShard), the
// replicate group (kNoShard, kHybridShard) and the post-forward group (reshard after forward
// to a block of ranks). Prefetch and the rate limiter live in prefetch.h, the model-wide state
// (forward nesting, backward passes, end of backward, failure) in root_state.h.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fsdp/fully_shard.h>

#include <fsdp/core/trace.h>
#include <fsdp/detail/buffer_lifetimes.h>
#include <fsdp/detail/group_layout.h>
#include <fsdp/distributed/collectives.h>
#include "autograd_node.h"
#include "int8_reduce.h"
#include "pending_reduce.h"

#include "sharded_param.h"
#include "unit_state.h"

namespace fsdp::detail {

class RootState;

/// Whether a unit with these options lets go of its unsharded parameters after forward, and
/// whether it is a sharded one that does (fsdp/detail/group_layout.h says which and why).
inline bool frees_after_forward(const FullyShardOptions& o) {
  return frees_after_forward(o.strategy(), o.reshard_after_forward());
}
inline bool reshards_after_forward(const FullyShardOptions& o) {
  return reshards_after_forward(o.strategy(), o.reshard_after_forward());
}

/// The process groups one unit communicates over, resolved from its options.
struct UnitGroups {
  std::shared_ptr<ProcessGroup> shard;         // null: parameters not sharded
  std::shared_ptr<ProcessGroup> replicate;     // null: no replicas
  std::shared_ptr<ProcessGroup> post_forward;  // null: reshard fully after forward
};

/// One fsdp::forward call of a unit whose backward may still come. Held by the unit, by the
/// hooks on the call's outputs and by its PostBackward node (an intrusive pointer, so autograd
/// can carry it in a capsule).
struct CallRecord : torch::CustomClassHolder {
  std::weak_ptr<ParamGroup> unit;
  /// The model forward (RootState::epoch()) the call belongs to.
  uint64_t epoch = 0;
  /// The PostBackward node on the call's inputs (none if no input required grad).
  std::optional<WeakNode> post_node;
  /// The grad_fn of each output that requires grad: the call's graph is alive while one is.
  std::vector<WeakNode> output_nodes;
  /// Backward passes (RootState::pass_id()) in which its pre-/post-backward ran; 0: not yet.
  uint64_t pre_pass = 0;
  uint64_t post_pass = 0;

  /// The graph that would run this call's backward still exists.
  bool alive() const;
};

class ParamGroup : public std::enable_shared_from_this<ParamGroup> {
 public:
  ParamGroup(std::string name, std::vector<std::pair<std::string, torch::Tensor>> params,
             FullyShardOptions options, UnitGroups groups);

  /// The unit's module path inside the model (e.g. "h3"), or its class name for a root.
  const std::string& name() const { return name_; }
  void set_name(std::string name) {
    name_ = std::move(name);
    moments_.reset();
  }
  const FullyShardOptions& options() const { return options_; }
  const UnitGroups& groups() const { return groups_; }
  int shard_size() const { return groups_.shard ? groups_.shard->size() : 1; }
  const std::vector<ShardedParam>& params() const { return params_; }
  bool has_trainable_params() const;
  ShardedState sharded_state() const { return unit_state_.sharded(); }
  TrainingState training_state() const { return unit_state_.training(); }
  bool held() const { return unit_state_.held(); }
  const UnitState& unit_state() const { return unit_state_; }

  /// The model state this unit belongs to (changes once, when an enclosing module is sharded).
  RootState& state() const { return *state_; }
  const std::shared_ptr<RootState>& state_ptr() const { return state_; }
  void set_state(std::shared_ptr<RootState> state) {
    state_ = std::move(state);
    moments_.reset();
  }

  // ---- Forward (called by fsdp::forward through ForwardCall) ----
  /// Gathers the unit, prefetches; `is_root_call`: the outermost fsdp::forward of the model.
  void pre_forward(bool is_root_call);
  /// Passes the inputs that require grad through PostBackward (returns them unchanged when
  /// grad mode is off or none requires grad).
  std::vector<torch::Tensor> wrap_inputs(std::vector<torch::Tensor> inputs);
  /// Frees the unit unless something holds it, and hooks the outputs that require grad.
  void post_forward(const std::vector<torch::Tensor>& outputs);
  /// The module's forward (or post_forward) threw: forget the call, reshard unless held.
  void abort_forward();
  bool in_forward() const { return unit_state_.training() == TrainingState::kForward; }

  // ---- Backward (hooks, the end-of-backward callback, failure) ----
  /// A call's output received its first gradient in this backward pass.
  void pre_backward(CallRecord& call);
  /// A call's PostBackward node ran: its inputs' gradients are complete.
  void post_backward(CallRecord& call);
  /// End of a successful backward pass, step 1: post-backward for a unit still in backward.
  void finish_backward();
  /// Step 2: completes all gradient communication (may throw: the pass is then rolled back).
  void wait_reduces();
  /// Step 3: adds the reduced shards to the grads (local work only).
  void install_grads();
  /// Step 4: commits the pass (accumulated grads of no-sync passes), reshards, forgets the
  /// calls this pass processed, drops block shards. Nothing of the pass stays gathered.
  void end_backward_pass(uint64_t pass);
  /// The backward pass failed: waits for every collective in flight, restores the sharded
  /// grads to what they were before the pass, drops what the pass accumulated, reshards.
  /// Collects failures instead of throwing (it runs while another exception propagates).
  void abort_backward_pass(uint64_t pass, std::vector<std::string>& errors);
  /// A call of this unit may still run its backward (its graph is alive).
  bool expects_backward() const;
  /// A call of this unit whose backward has not started in the open pass may still run it.
  bool awaits_backward() const;
  /// Forgets calls whose graph died and releases the hold when none is left. `failed_epoch`:
  /// also forgets the calls of that forward (it threw).
  void forget_calls(std::optional<uint64_t> failed_epoch);

  /// Completes this unit's reduce-scatter if one is in flight and issues the cross-replica
  /// all-reduce that follows it. Bounds the reduce-scatter buffers alive at once.
  void finish_reduce_scatter();

  /// fsdp::set_replicate_group.
  void set_replicate_group(std::shared_ptr<ProcessGroup> group);
  /// fsdp::set_shard_group.
  void set_shard_group(std::shared_ptr<ProcessGroup> group);

  /// fsdp::set_post_reduce_hook.
  void set_post_reduce_hook(PostReduceHook hook) { post_reduce_hook_ = std::move(hook); }
  /// Runs the post-reduce hook on this pass's reduced grads, if there is a hook, the unit
  /// reduced in this pass and the hook has not run yet: installs the reduced shards into the
  /// grads first (waiting for what is still in flight). Before the end of the pass
  /// (`end_of_pass` false) only when nothing can reduce again in this pass (no call of the
  /// unit still expects its backward) and the reductions are already complete or were issued
  /// before reduce point `round` (not just now: waiting for those would stall backward).
  /// Returns whether the hook ran.
  bool run_post_reduce_hook(bool end_of_pass, uint64_t round);

  /// false: backward keeps unsharded grads locally instead of reduce-scattering them
  /// (accumulation without communication); the next backward with true sends the sum.
  void set_requires_gradient_sync(bool sync) { requires_gradient_sync_ = sync; }

  // ---- Gathering ----
  /// Starts gathering the unit's parameters (one all-gather for the whole unit). `counted`:
  /// the gather occupies a slot of the rate limiter until the unit reshards.
  void issue_unshard(bool counted);
  /// Waits for the gather and points the params at the unsharded tensors.
  void wait_unshard();
  void unshard(bool counted) {
    issue_unshard(counted);
    wait_unshard();
  }
  /// Frees the unsharded parameters (waiting for an in-flight gather first). Does not look at
  /// why the unit is gathered: callers decide (see release()).
  void reshard();
  /// Reshards unless something still holds the unit (UnitState::releasable: user-held, held, in a
  /// forward or a backward).
  void release();
  /// fsdp::unshard / fsdp::reshard.
  void set_user_held(bool held);

  /// Explicit prefetch lists (nullopt: follow the recorded order).
  std::optional<std::vector<std::weak_ptr<ParamGroup>>> forward_prefetch_list;
  std::optional<std::vector<std::weak_ptr<ParamGroup>>> backward_prefetch_list;

  /// Bytes of the padded shards this rank holds, and of the unit when unsharded.
  int64_t sharded_bytes() const;
  int64_t unsharded_bytes() const;
  /// The dtype gradients are reduced in (MixedPrecisionPolicy), for master dtype `master`.
  torch::ScalarType reduce_dtype(torch::ScalarType master) const;

 private:
  void begin_backward();
  void reduce_gradients();
  void issue_all_reduce();
  // CPU offload: starts r's device-to-host copy (PendingReduce::start_host_copy) once its
  // output is final.
  void start_host_copy(PendingReduce& r) const;
  void drop_block_shards();
  /// Frees the gather cycle's buffers whose lifetime ends at `event` (buffer_lifetimes.h).
  void free_at(UnitEvent event);
  /// The reductions' grads are installed (kInstalled): their records and buffers go.
  void drop_installed_reduces();
  [[noreturn]] void fail(const std::string& msg) const;
  std::string context() const;
  // fsdp::memory moments ("forward h3", "backward (root)", "recompute h3"), registered on first
  // use and again after a rename or a change of model.
  struct Moments {
    int forward, backward, recompute;
  };
  const Moments& moments();
  void set_backward_moment_of_root();

  std::string name_;
  FullyShardOptions options_;
  UnitGroups groups_;
  std::vector<ShardedParam> params_;
  std::shared_ptr<RootState> state_;
  UnitState unit_state_{&name_};
  std::unique_ptr<CollectiveWork> gather_;
  std::vector<torch::Tensor> gather_inputs_;  // cast or encoded shards in flight
  // Calls whose backward may still come, oldest first; the call being formed by a forward.
  std::vector<c10::intrusive_ptr<CallRecord>> calls_;
  c10::intrusive_ptr<CallRecord> forming_;
  bool requires_gradient_sync_ = true;
  std::optional<Moments> moments_;
  int moment_before_forward_ = 0;
  // One per reduction of this pass: one per call whose backward ran on its own.
  std::vector<PendingReduce> reduces_;
  // What this pass did with the unit's grads (pending_reduce.h).
  PassReductionState pass_reduction_;
  PostReduceHook post_reduce_hook_;
  // ReduceFormat::kInt8 with a reduce-scatter (made on the first reduction that needs it).
  std::optional<Int8Reduce> int8_reduce_;
  // Trace spans (fsdp/core/trace.h) that open in one hook and close in another: the forward
  // (pre_forward to the end of post_forward; "recompute" when it runs inside a backward) and the
  // backward (the first pre_backward of the pass to the end of reduce_gradients). Inert unless
  // tracing was on when they opened.
  trace::Mark forward_span_, backward_span_;
  const char* forward_kind_ = "forward";
};

}  // namespace fsdp::detail
