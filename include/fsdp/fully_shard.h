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
// left (embeddings, final norm, head).
#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <array>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <fsdp/process_group.h>

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

const char* to_string(ShardingStrategy s);
const char* to_string(BackwardPrefetch p);

struct FullyShardOptions {
  explicit FullyShardOptions(std::shared_ptr<ProcessGroup> group) : group_(std::move(group)) {}

  /// The ranks the unit spans (sharded over, replicated over, or both: see strategy).
  TORCH_ARG(std::shared_ptr<ProcessGroup>, group);
  TORCH_ARG(ShardingStrategy, strategy) = ShardingStrategy::kFullShard;
  /// kHybridShard: ranks per shard block; must divide the group size. Blocks are consecutive
  /// ranks, so with torchrun's rank order a block of LOCAL_WORLD_SIZE ranks is one node.
  TORCH_ARG(int, hybrid_shard_size) = 0;
  /// Free the unsharded parameters after forward and gather them again for backward (the
  /// memory-saving default, ZeRO-3). The outermost unit of a forward (the root) never
  /// reshards after forward: its backward starts right away.
  TORCH_ARG(bool, reshard_after_forward) = true;
  /// With reshard_after_forward and a value k > 1: after forward, keep the parameters
  /// sharded over blocks of k consecutive ranks (one node, say) instead of over the whole
  /// shard group, so backward's all-gather stays inside the block (FSDP2's integer
  /// reshard_after_forward, ZeRO++ hpZ). Costs (shard size / k) x this rank's shard bytes
  /// per unit between its forward and its backward. k must divide the shard group size.
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
  /// value applies to the whole step. 1 disables prefetch; the FSDP paper uses 2.
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

/// Makes `module` one FSDP unit over `options.group()`.
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

/// Gradient accumulation without communication (DDP's no_sync, FSDP2's
/// set_requires_gradient_sync): with `sync` false, the backward passes of every unit under
/// `module` keep their unsharded gradients locally (one full-size gradient per unit per rank)
/// instead of reduce-scattering them; the first backward after setting it back to true
/// reduce-scatters the sum. With the default (true) every backward reduce-scatters and the
/// shards' grads accumulate: less memory, more traffic. Both give the gradient of the sum.
void set_requires_gradient_sync(torch::nn::Module& module, bool sync);

namespace detail {
class ParamGroup;
/// The unit of `module`, or nullptr.
std::shared_ptr<ParamGroup> find_unit(const torch::nn::Module& module);
/// Gathers the unit's parameters; returns the tensor arguments, wrapped so that autograd
/// tells the unit when its backward is done.
std::vector<torch::Tensor> pre_forward(ParamGroup& unit, std::vector<torch::Tensor> args);
/// Frees the unit's parameters (unless it is the root of this forward) and hooks the outputs
/// so that backward gathers them again.
void post_forward(ParamGroup& unit, const std::vector<torch::Tensor>& outputs);
/// The module's forward threw: reshard and return the unit to idle so training can go on.
void abort_forward(ParamGroup& unit) noexcept;

template <typename T>
inline constexpr bool is_tensor_v = std::is_same_v<std::decay_t<T>, torch::Tensor>;

template <typename M>
decltype(auto) module_impl(M& m) {
  if constexpr (requires { m.ptr(); }) {
    return *m.ptr();  // ModuleHolder
  } else if constexpr (requires { *m; }) {
    return *m;  // shared_ptr / pointer
  } else {
    return (m);
  }
}

template <typename... Args>
constexpr std::array<int, sizeof...(Args)> tensor_slots() {
  std::array<int, sizeof...(Args)> slots{};
  int next = 0, i = 0;
  ((slots[i++] = is_tensor_v<Args> ? next++ : -1), ...);
  return slots;
}

inline void collect_tensors(const torch::Tensor& t, std::vector<torch::Tensor>& out) {
  if (t.defined())
    out.push_back(t);
}
inline void collect_tensors(const std::vector<torch::Tensor>& ts, std::vector<torch::Tensor>& out) {
  for (const auto& t : ts)
    collect_tensors(t, out);
}
template <typename... Ts>
void collect_tensors(const std::tuple<Ts...>& tup, std::vector<torch::Tensor>& out) {
  std::apply([&](const auto&... e) { (collect_tensors(e, out), ...); }, tup);
}
template <typename A, typename B>
void collect_tensors(const std::pair<A, B>& p, std::vector<torch::Tensor>& out) {
  collect_tensors(p.first, out);
  collect_tensors(p.second, out);
}
template <typename T>
void collect_tensors(const T&, std::vector<torch::Tensor>&) {}  // not a tensor: nothing to hook

template <typename Impl, typename Tuple, size_t... I>
decltype(auto) call_forward(Impl& impl, Tuple& args, std::vector<torch::Tensor>& wrapped,
                            std::index_sequence<I...>) {
  constexpr auto slots = tensor_slots<std::tuple_element_t<I, Tuple>...>();
  auto pick = [&]<size_t J>(std::integral_constant<size_t, J>) -> decltype(auto) {
    if constexpr (is_tensor_v<std::tuple_element_t<J, Tuple>>) {
      return static_cast<const torch::Tensor&>(wrapped[slots[J]]);
    } else {
      return std::forward<std::tuple_element_t<J, Tuple>>(std::get<J>(args));
    }
  };
  return impl.forward(pick(std::integral_constant<size_t, I>{})...);
}
}  // namespace detail

/// Calls module->forward(args...) as an FSDP unit: parameters are gathered before and freed
/// after, and backward is hooked. Tensor arguments are passed through an autograd identity so
/// the unit learns when its backward has finished; other arguments are passed unchanged.
/// `module` may be a ModuleHolder (Linear, or your TORCH_MODULE), a shared_ptr, or a module.
template <typename M, typename... Args>
decltype(auto) forward(M&& module, Args&&... args) {
  auto& impl = detail::module_impl(module);
  auto unit = detail::find_unit(impl);
  if (!unit)
    return impl.forward(std::forward<Args>(args)...);

  std::vector<torch::Tensor> tensors;
  (
      [&] {
        if constexpr (detail::is_tensor_v<Args>)
          tensors.push_back(args);
      }(),
      ...);
  auto wrapped = detail::pre_forward(*unit, std::move(tensors));
  auto arg_tuple = std::forward_as_tuple(std::forward<Args>(args)...);
  using Result =
      decltype(detail::call_forward(impl, arg_tuple, wrapped, std::index_sequence_for<Args...>{}));
  try {
    if constexpr (std::is_void_v<Result>) {
      detail::call_forward(impl, arg_tuple, wrapped, std::index_sequence_for<Args...>{});
      detail::post_forward(*unit, {});
    } else {
      Result result =
          detail::call_forward(impl, arg_tuple, wrapped, std::index_sequence_for<Args...>{});
      std::vector<torch::Tensor> outputs;
      detail::collect_tensors(result, outputs);
      detail::post_forward(*unit, outputs);
      return result;
    }
  } catch (...) {
    detail::abort_forward(*unit);
    throw;
  }
}

}  // namespace fsdp
