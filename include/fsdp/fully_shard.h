// The entry point: make a module one FSDP unit, and run its forward through fsdp-cpp.
//
// fully_shard(module, options) shards every parameter of `module` that no inner unit owns
// across the process group. The module keeps its parameter objects; at rest each holds only
// this rank's rows, so model->parameters() yields the shards and an optimizer built on them
// updates shards. C++ modules have no forward hooks, so wherever the model calls a sharded
// module's forward, it calls fsdp::forward(module, args...) instead: that gathers the unit's
// parameters, runs forward, frees them, and hooks autograd so that backward gathers them again
// and reduce-scatters their gradients. On a module that was never sharded, fsdp::forward is
// a plain forward call, so the same model code runs with and without FSDP.
//
// Apply bottom-up: blocks first, then the root (the whole model), whose unit takes what is
// left (embeddings, final norm, head); top-down is refused, and so are units whose parent is a
// torch::nn::Sequential (its forward cannot call fsdp::forward). Arguments and results may hold
// tensors in containers and in structs that declare visit_tensors (fsdp/detail/tensor_visit.h). The
// rules for frozen units, units called several times, and errors: docs/design.md, "One model,
// many graphs".
#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <fsdp/activation_checkpoint.h>
#include <fsdp/detail/enum_names.h>
#include <fsdp/detail/forward_call.h>
#include <fsdp/detail/tensor_visit.h>
#include <fsdp/distributed/process_group.h>
#include <fsdp/mixed_precision.h>

namespace fsdp {

/// Where a unit sits between ZeRO-3 and DDP: what is sharded, what is replicated.
enum class ShardingStrategy {
  /// Parameters, gradients and optimizer state sharded over the group (ZeRO-3). With
  /// reshard_after_forward(false) it behaves as kShardGradOp.
  kFullShard,
  /// As kFullShard, but the parameters stay gathered from forward until the unit's backward
  /// is done (ZeRO-2): one all-gather per step instead of two, a unit's full parameters held
  /// between its forward and its backward.
  kShardGradOp,
  /// Nothing sharded: every rank holds the whole unit, gradients are all-reduced in buckets
  /// of all_reduce_bucket_bytes (DDP semantics; LibTorch's C++ frontend has no DDP).
  kNoShard,
  /// Sharded inside blocks of hybrid_shard_size consecutive ranks (e.g. one node),
  /// replicated across blocks: gradients are reduce-scattered inside the block, then
  /// all-reduced across blocks. reshard_after_forward applies as for kFullShard.
  kHybridShard,
};

/// When backward gathers the next unit (the next in reverse forward order) ahead of need.
enum class BackwardPrefetch {
  kNone,
  /// When the current unit's backward starts: its all-gather overlaps the current unit's
  /// gradient computation. Most overlap; two units' parameters and one unit's gradients live
  /// at once.
  kBackwardPre,
  /// After the current unit's gradients are computed and its reduce-scatter issued: overlaps
  /// only with that reduce-scatter. Less overlap, one unit less of memory.
  kBackwardPost,
};

template <>
struct EnumNames<ShardingStrategy> {
  static constexpr const char* what = "sharding strategy";
  static constexpr std::array<std::pair<ShardingStrategy, const char*>, 4> names{{
      {ShardingStrategy::kFullShard, "full_shard"},
      {ShardingStrategy::kShardGradOp, "shard_grad_op"},
      {ShardingStrategy::kNoShard, "no_shard"},
      {ShardingStrategy::kHybridShard, "hybrid_shard"},
  }};
};
template <>
struct EnumNames<BackwardPrefetch> {
  static constexpr const char* what = "backward prefetch";
  static constexpr std::array<std::pair<BackwardPrefetch, const char*>, 3> names{{
      {BackwardPrefetch::kNone, "none"},
      {BackwardPrefetch::kBackwardPre, "backward_pre"},
      {BackwardPrefetch::kBackwardPost, "backward_post"},
  }};
};

/// FSDP's CPU offload of parameters (FSDP2's CPUOffloadPolicy): the unit's sharded parameters
/// and their gradients live in host memory while it computes on its device. Before each
/// all-gather the shard is copied to the device; after each reduce-scatter the reduced
/// gradient is copied back; the optimizer steps on the host (fsdp::FusedAdamW is made for it).
/// With CPU compute the "device" is the host: the copies still happen (so the tests exercise
/// this path), they only cost memory bandwidth.
struct CPUOffloadPolicy {
  /// Pinned (page-locked) host memory for shards and gradients when CUDA is in use: the
  /// host-to-device copy is then asynchronous on the current stream.
  TORCH_ARG(bool, pin_memory) = true;
};

struct FullyShardOptions {
  explicit FullyShardOptions(std::shared_ptr<ProcessGroup> group) : group_(std::move(group)) {}

  /// The ranks the unit spans (sharded over, replicated over, or both: see strategy).
  TORCH_ARG(std::shared_ptr<ProcessGroup>, group);
  TORCH_ARG(ShardingStrategy, strategy) = ShardingStrategy::kFullShard;
  /// kHybridShard (and only it): ranks per shard block; must divide the group size. Blocks
  /// are consecutive ranks, so with torchrun's rank order a block of LOCAL_WORLD_SIZE ranks is
  /// one node.
  TORCH_ARG(int, hybrid_shard_size) = 0;
  /// kHybridShard (and only it): the cross-replica group, given instead of derived from `group`.
  /// `group` is then the shard group (one replica's ranks) and this one the ranks at this rank's
  /// place in every replica: fsdp::ReplicaQuorum's replica_group() and replicate_group(), which
  /// a process that joined a running job cannot derive (its world group has no backend).
  /// hybrid_shard_size is then 0 or the size of `group`.
  TORCH_ARG(std::shared_ptr<ProcessGroup>, replicate_group);
  /// kFullShard and kHybridShard: free the unsharded parameters after forward and gather them
  /// again for backward (unset: true, the memory-saving default, ZeRO-3); false keeps them
  /// from forward to backward. The outermost unit of a forward (the root) never reshards
  /// after forward: its backward starts right away. kShardGradOp is kFullShard with false
  /// (so true is refused with it); kNoShard never gathers (any value is refused).
  TORCH_ARG(std::optional<bool>, reshard_after_forward);
  /// kFullShard and kHybridShard, resharding after forward: a value k > 0 keeps the
  /// parameters sharded over blocks of k consecutive ranks (one node, say) after forward
  /// instead of over the whole shard group, so backward's all-gather stays inside the block
  /// (FSDP2's integer reshard_after_forward, ZeRO++ hpZ). Costs (shard size / k) x this
  /// rank's shard bytes per unit between its forward and its backward. k must divide the
  /// shard group size (k = the shard group size is plain resharding). 0: off.
  TORCH_ARG(int, reshard_after_forward_size) = 0;
  /// Broadcast group rank 0's parameters and buffers before sharding, so every rank starts
  /// from the same values whatever its random seed. Parameters filled by param_init are not
  /// broadcast (param_init must give every rank the same values); buffers still are.
  TORCH_ARG(bool, sync_module_states) = true;

  /// Issue the all-gather of the unit that ran next in the previous forward when this unit's
  /// forward starts, so it proceeds (on the backend's threads) while this unit computes.
  /// The order is recorded on every forward; the first one runs without prefetch.
  TORCH_ARG(bool, forward_prefetch) = true;
  TORCH_ARG(BackwardPrefetch, backward_prefetch) = BackwardPrefetch::kBackwardPre;
  /// Rate limiter: at most this many units gathered for the compute pipeline at once (the
  /// running unit and its prefetches; the root and units kept gathered from forward into
  /// backward do not count). A prefetch beyond it waits until a unit is freed. The root's
  /// value applies to the whole step. With 1, a unit's own gather takes the only slot, so a
  /// prefetch waits until the running unit frees it and only fills the gap between two
  /// units (no overlap with compute); the FSDP paper uses 2.
  TORCH_ARG(int, max_inflight_all_gathers) = 2;
  /// kNoShard and the cross-block all-reduce of kHybridShard: gradients are all-reduced in
  /// buckets of at most this many bytes (one bucket per unit when the unit is smaller).
  TORCH_ARG(int64_t, all_reduce_bucket_bytes) = int64_t{25} << 20;
  /// Gloo: a unit's all-gather is carried out in backend calls of at most this many bytes of
  /// output (0: one call for the whole unit). Gloo stages each call in flat buffers of its own
  /// ((1 + 1/N) x the call), so buckets bound that transient, and calls of a few MiB also run
  /// faster than one large one (bench/bench_collectives: 4 MiB buckets gather a 64 MiB unit
  /// 1.4-1.9x faster than one call, with 0.17-0.22x the unit in temporaries instead of
  /// 1.33-1.5x).
  /// It stays one all-gather in CommStats. Ignored on NCCL.
  TORCH_ARG(int64_t, all_gather_bucket_bytes) = int64_t{4} << 20;
  /// Gather, compute and reduce dtypes (fsdp/mixed_precision.h). Default: all in the
  /// parameters' own dtype.
  TORCH_ARG(MixedPrecisionPolicy, mp_policy);
  /// Keep the sharded parameters and their gradients in host memory (see CPUOffloadPolicy).
  TORCH_ARG(std::optional<CPUOffloadPolicy>, offload_policy);
  /// Activation checkpointing of the unit's forward (fsdp/activation_checkpoint.h): kFull keeps
  /// only its inputs for backward and runs the forward again, on the parameters gathered for the
  /// unit's backward; kSelective also keeps its matmul outputs. The arguments of fsdp::forward
  /// are copied for the recomputation (std::ref arguments cannot be replayed: an error).
  TORCH_ARG(CheckpointMode, activation_checkpointing) = CheckpointMode::kNone;

  /// Deferred initialisation: fills this rank's shard of a parameter directly, so the full
  /// parameter never exists in memory. Called once per parameter with the module's parameter
  /// object (shape only: it may be a placeholder without real storage, e.g.
  /// fsdp_models::to_hollow()), the shard to fill (rows [first_row, first_row + shard.size(0))
  /// of the parameter, unpadded; possibly empty) and first_row. Must be deterministic: every
  /// rank computes its own rows.
  using ParamInit = std::function<void(const torch::Tensor& param, const torch::Tensor& shard,
                                       int64_t first_row)>;
  TORCH_ARG(ParamInit, param_init) = nullptr;
};

/// Makes `module` one FSDP unit over `options.group()`. Options that contradict each other or
/// do nothing with the strategy (hybrid_shard_size without kHybridShard, reshard_after_forward
/// with kShardGradOp or kNoShard, reshard_after_forward_size without resharding after forward)
/// are refused with one message naming both.
void fully_shard(const std::shared_ptr<torch::nn::Module>& module,
                 const FullyShardOptions& options);
template <typename M>
void fully_shard(const torch::nn::ModuleHolder<M>& module, const FullyShardOptions& options) {
  fully_shard(std::static_pointer_cast<torch::nn::Module>(module.ptr()), options);
}

/// True if fully_shard() was applied to `module`.
bool is_sharded(const torch::nn::Module& module);

/// Explicit prefetch (overrides the recorded order for this unit): when `module`'s forward
/// starts, the units of `modules` are gathered ahead, in this order, through the rate
/// limiter. Every module must be a unit. An empty list turns forward prefetch off for it.
void set_modules_to_forward_prefetch(
    const torch::nn::Module& module,
    const std::vector<std::shared_ptr<torch::nn::Module>>& modules);
/// Same for backward: gathered when `module`'s backward starts (kBackwardPre) or after its
/// reduce-scatter is issued (kBackwardPost).
void set_modules_to_backward_prefetch(
    const torch::nn::Module& module,
    const std::vector<std::shared_ptr<torch::nn::Module>>& modules);

/// Counters of every collective the units under `module` issued, summed over the distinct
/// process groups they use (hybrid blocks, reshard-after-forward blocks included).
CommStats comm_stats(const torch::nn::Module& module);
/// Resets those counters.
void reset_comm_stats(const torch::nn::Module& module);

/// Releases now what fsdp keeps for models that no longer exist (their units, and through them
/// their buffers and process groups), which it otherwise releases lazily, at its next call for
/// another model. Call it after the last model is gone, before main returns, on a GPU above all:
/// a NCCL process group released during static destruction, after the CUDA runtime has shut
/// down, aborts the process ("driver shutting down").
void release_dead_models();

/// Gradient accumulation without communication (DDP's no_sync, FSDP2's
/// set_requires_gradient_sync): with `sync` false, the backward passes of every unit under
/// `module` keep their unsharded gradients locally (one full-size gradient per unit per rank)
/// instead of reduce-scattering them; the first backward after setting it back to true
/// reduce-scatters the sum. With the default (true) every backward reduce-scatters and the
/// shards' grads accumulate: less memory, more traffic. Both give the gradient of the sum.
void set_requires_gradient_sync(torch::nn::Module& module, bool sync);

/// Fault tolerance (fsdp/distributed/replica_quorum.h): the group over which every unit under
/// `module` averages its gradients across replicas (hybrid_shard, no_shard) becomes `group`, the
/// ranks at this rank's shard position in the replicas still training. The units' shard groups
/// stay. Between steps only: refused while a unit is gathered or in a backward pass. A unit
/// without replicas (full_shard, shard_grad_op) accepts only a group of one rank.
void set_replicate_group(torch::nn::Module& module, std::shared_ptr<ProcessGroup> group);

/// Fault tolerance: the shard group of every unit under `module` becomes `group`, a new group
/// over the same ranks in the same order (each member at the same place: the shards do not
/// move). A Gloo group whose collective timed out has closed its connections for good, so a
/// replica that goes on after a fault gets fresh ones. A unit's post-forward blocks
/// (reshard_after_forward_size) are made anew from `group` (collective over it: every member
/// calls this for the same units in the same order). Between steps only; a unit sharded over one
/// rank accepts only a group of one.
void set_shard_group(torch::nn::Module& module, std::shared_ptr<ProcessGroup> group);

/// Called with a unit's trainable parameters once their .grad holds the backward pass's
/// reduced gradient (this rank's shard, added to what the grads held before the pass).
using PostReduceHook = std::function<void(const std::vector<torch::Tensor>& params)>;

/// The optimizer inside backward: for every unit under `module`, `hook` runs during backward as
/// soon as the unit's gradients are reduced, while the backward of the units before it goes on
/// (it runs on the thread of backward, after the next unit's reduce-scatter is issued, so that
/// collective overlaps it). A hook that steps the unit's parameters and then drops their grads
/// (FusedOptimizer::step_params, then grad = undefined) keeps about one unit's sharded
/// gradients alive instead of the whole model's. A unit reduced by several calls in one pass
/// (a module called twice) runs its hook once, after its last reduction; a unit whose calls
/// may still run their backward, and the root, run theirs at the end of backward. Passes
/// without gradient sync (set_requires_gradient_sync(false)) reduce nothing and run no hook.
/// Not transactional: when a pass fails after some units' hooks ran, those units keep what
/// their hooks did (the others are rolled back as usual). nullptr removes the hook.
void set_post_reduce_hook(torch::nn::Module& module, PostReduceHook hook);

/// Calls module->forward(args...) as an FSDP unit: parameters are gathered before and freed
/// after, and backward is hooked. Tensors inside the arguments (nested in containers and in
/// types that declare them, see fsdp/detail/tensor_visit.h) that require grad pass through an
/// autograd identity, so the unit learns when its backward has finished; tensors inside the
/// result that require grad get a hook that gathers the unit again for backward. `module` may
/// be a ModuleHolder (Linear, or your TORCH_MODULE), a shared_ptr, or a module. The result is
/// returned by value.
template <typename M, typename... Args>
auto forward(M&& module, Args&&... args) {
  auto& impl = detail::module_impl(module);
  using Result = std::remove_cvref_t<decltype(impl.forward(std::forward<Args>(args)...))>;
  static_assert(std::is_void_v<Result> || detail::kWalkable<Result>,
                "fsdp::forward: the module's forward returns a type that may hold tensors fsdp "
                "cannot see. Give it a member `template <typename F> void visit_tensors(F&& f)` "
                "(see fsdp/detail/tensor_visit.h)");
  auto unit = detail::find_unit(impl);
  if (!unit) {
    if constexpr (std::is_void_v<Result>)
      return impl.forward(std::forward<Args>(args)...);
    else
      return Result(impl.forward(std::forward<Args>(args)...));
  }
  detail::ForwardCall call(std::move(unit));
  std::tuple<detail::ArgSlot<Args>...> slots(std::forward<Args>(args)...);
  std::vector<torch::Tensor> inputs;
  std::apply([&](auto&... slot) { (slot.collect(call, inputs), ...); }, slots);
  if (!inputs.empty()) {
    auto wrapped = call.wrap_inputs(std::move(inputs));
    size_t next = 0;
    std::apply([&](auto&... slot) { (slot.replace(call, wrapped, next), ...); }, slots);
  }
  if constexpr (std::is_void_v<Result>) {
    std::apply([&](auto&... slot) { impl.forward(slot.get()...); }, slots);
    call.finish({});
  } else {
    constexpr bool replayable = (detail::ArgSlot<Args>::kReplayable && ... && true);
    const auto ac = call.checkpoint_mode(replayable);
    Result result = [&]() -> Result {
      if constexpr (replayable && std::is_move_constructible_v<Result>) {
        if (ac != CheckpointMode::kNone)
          return detail::checkpointed_forward<Result, Args...>(impl, ac, slots, call.unit_name());
      }
      return std::apply(
          [&](auto&... slot) -> decltype(auto) { return impl.forward(slot.get()...); }, slots);
    }();
    std::vector<torch::Tensor> outputs;
    auto f = [&](torch::Tensor& t) {
      t = call.cast_output(t);
      if (t.defined())
        outputs.push_back(t);
    };
    detail::walk_tensors(result, f);
    call.finish(outputs);
    return result;
  }
}

}  // namespace fsdp
