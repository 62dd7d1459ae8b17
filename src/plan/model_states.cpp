// See include/fsdp/plan/model_states.h. A parameter's shard is the engine's own layout
// (fsdp/detail/param_layout.h); each other rule below restates where the engine allocates (the
// file and function named): a change there must change this, and PlanModelStates.* in
// tests/test_plan.cpp compares the two byte for byte.
#include <fsdp/plan/model_states.h>

#include <c10/util/Exception.h>

#include <algorithm>

#include "unit_bytes.h"

namespace fsdp::plan {

RankStates model_states(const std::vector<UnitInfo>& units, const StateOptions& o, int rank) {
  TORCH_CHECK(o.world_size >= 1 && rank >= 0 && rank < o.world_size, "fsdp::plan: rank ", rank,
              " of a world of ", o.world_size);
  const auto [n, r] = detail::shard_group(o, rank);

  RankStates out;
  int64_t slot_elements = 0;  // fused optimizer layout over this rank's trainable shards
  int64_t torch_state_bytes = 0;
  for (const auto& unit : units) {
    int64_t reduce_elements = 0, trainable = 0, local_grad_bytes = 0;
    torch::ScalarType master = torch::kFloat32;
    for (const auto& p : unit.params) {
      // As the engine lays the parameter out (ShardedParam): only its shard matters here.
      const auto s =
          fsdp::detail::param_layout(p.shape, p.dtype, r, n, MixedPrecisionPolicy(), o.cpu_offload);
      // The padded shard, in the parameter's own (master) dtype.
      out.params += s.shard_bytes();
      if (!p.trainable)
        continue;
      master = p.dtype;
      ++trainable;
      reduce_elements += s.shard_numel();
      const int64_t local = s.local_numel();
      local_grad_bytes += local * detail::esize(p.dtype);
      slot_elements += (local + 63) / 64 * 64;  // src/optim/fused_optimizer.cpp, kSlotAlign
      torch_state_bytes += local * detail::esize(p.dtype);
    }
    if (trainable == 0)
      continue;
    // src/engine/param_group.cpp, reduce_gradients: one reduce-scatter output per unit of
    // [padded shards | one flag per parameter] in the reduce dtype. The grads alias it when that
    // is the master dtype (ShardedParam::add_to_stash); otherwise, and under CPU offload, each
    // gets a tensor of its own real rows and the output is freed.
    const bool mixed = !(o.root_full_precision && unit.path.empty());
    const torch::ScalarType reduce = fsdp::detail::reduce_dtype_of(
        mixed ? MixedPrecisionPolicy().param_dtype(o.param_dtype).reduce_dtype(o.reduce_dtype)
              : MixedPrecisionPolicy(),
        master);
    out.grads += o.cpu_offload || reduce != master
                     ? local_grad_bytes
                     : (reduce_elements + trainable) * detail::esize(reduce);
  }
  const int moments = o.optimizer == Optimizer::kAdamW         ? 2
                      : o.optimizer == Optimizer::kSgdMomentum ? 1
                                                               : 0;
  if (o.fused) {
    const int64_t esize = detail::esize(o.moments_dtype);
    if (moments > 0 && o.optimizer_in_file) {
      // src/optim/optimizer_state_store.cpp, FileStore: two chunk buffers (every moment's part
      // of a chunk), chunks of whole 4096-element blocks, each buffer 4096 bytes over for
      // O_DIRECT alignment. The file itself is not memory.
      constexpr int64_t kAlign = 4096;
      const int64_t per_element = moments * esize;
      int64_t chunk = std::max<int64_t>(1, o.chunk_bytes / per_element / kAlign) * kAlign;
      chunk = std::min(chunk, detail::ceil_div(slot_elements, kAlign) * kAlign);
      chunk = std::max(chunk, kAlign);
      out.optimizer = 2 * (chunk * per_element + kAlign);
    } else if (moments > 0) {
      // MemoryStore: one buffer per moment, at least a byte.
      out.optimizer = moments * std::max<int64_t>(slot_elements * esize, 1);
    }
  } else {
    out.optimizer = moments * torch_state_bytes;  // zeros_like(param) per moment
  }
  return out;
}

}  // namespace fsdp::plan
