// See include/fsdp/plan/model_states.h. Every size here is the library's own description: a
// parameter's shard, its gradient and a unit's reduction (fsdp/detail/param_layout.h), the fused
// optimizers' slots and state stores (fsdp/optim/state_layout.h). What is restated is which of
// them a rank holds between steps; PlanModelStates.* in tests/test_plan.cpp compares the total
// with a measured step byte for byte.
#include <fsdp/plan/model_states.h>

#include <c10/util/Exception.h>

#include <algorithm>

#include <fsdp/optim/state_layout.h>

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
      local_grad_bytes += s.grad_shard_bytes();
      slot_elements += fsdp::detail::slot_elements(s.local_numel());
      torch_state_bytes += s.grad_shard_bytes();  // zeros_like(param) per moment
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
    const auto layout =
        fsdp::detail::reduce_layout(reduce_elements, trainable, n, reduce, MixedPrecisionPolicy());
    const int64_t output = n > 1 ? layout.output_bytes() : layout.input_bytes();
    out.grads += o.cpu_offload || reduce != master ? local_grad_bytes : output;
  }
  const int moments = o.optimizer == Optimizer::kAdamW         ? 2
                      : o.optimizer == Optimizer::kSgdMomentum ? 1
                                                               : 0;
  if (o.fused) {
    // One stream per moment, in memory or in a file (whose chunk buffers are the memory).
    if (moments > 0) {
      out.optimizer =
          fsdp::detail::state_resident_bytes(o.optimizer_in_file, moments, slot_elements,
                                             detail::esize(o.moments_dtype), o.chunk_bytes);
    }
  } else {
    out.optimizer = moments * torch_state_bytes;  // zeros_like(param) per moment
  }
  return out;
}

}  // namespace fsdp::plan
