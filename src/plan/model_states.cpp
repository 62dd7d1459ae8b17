// See include/fsdp/plan/model_states.h. Each rule below restates where the engine allocates
// (the file and function named): a change there must change this, and PlanModelStates.* in
// tests/test_plan.cpp compares the two byte for byte.
#include <fsdp/plan/model_states.h>

#include <c10/util/Exception.h>

#include <algorithm>

namespace fsdp::plan {
namespace {

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// A parameter's dim-0 sharding over `n` ranks, seen from shard rank `r`
// (src/engine/sharded_param.cpp, the ShardedParam constructor).
struct Shard {
  int64_t chunk_rows = 0;  // rows of the padded shard
  int64_t local_rows = 0;  // real rows on this rank
  int64_t row_numel = 0;
};

Shard shard_of(const ParamInfo& p, int n, int r) {
  Shard s;
  const int64_t rows = p.shape.empty() ? 1 : p.shape[0];
  int64_t numel = 1;
  for (auto d : p.shape)
    numel *= d;
  s.row_numel = rows == 0 ? (p.shape.empty() ? 0 : 1) : numel / rows;
  s.chunk_rows = ceil_div(rows, n);
  s.local_rows = std::clamp<int64_t>(rows - r * s.chunk_rows, 0, s.chunk_rows);
  return s;
}

int64_t element_size(torch::ScalarType t) {
  return static_cast<int64_t>(c10::elementSize(t));
}

}  // namespace

RankStates model_states(const std::vector<UnitInfo>& units, const StateOptions& o, int rank) {
  TORCH_CHECK(o.world_size >= 1 && rank >= 0 && rank < o.world_size, "fsdp::plan: rank ", rank,
              " of a world of ", o.world_size);
  // The shard group (src/engine/fully_shard.cpp, resolve_groups): blocks of consecutive ranks
  // under kHybridShard, nothing sharded under kNoShard.
  int n = o.world_size;
  if (o.strategy == ShardingStrategy::kNoShard) {
    n = 1;
  } else if (o.strategy == ShardingStrategy::kHybridShard) {
    TORCH_CHECK(o.hybrid_shard_size >= 1 && o.world_size % o.hybrid_shard_size == 0,
                "fsdp::plan: hybrid_shard_size ", o.hybrid_shard_size,
                " does not divide the world size ", o.world_size);
    n = o.hybrid_shard_size;
  }
  const int r = rank % n;

  RankStates out;
  int64_t slot_elements = 0;  // fused optimizer layout over this rank's trainable shards
  int64_t torch_state_bytes = 0;
  for (const auto& unit : units) {
    int64_t reduce_elements = 0, trainable = 0, local_grad_bytes = 0;
    torch::ScalarType master = torch::kFloat32;
    for (const auto& p : unit.params) {
      const Shard s = shard_of(p, n, r);
      // The padded shard, in the parameter's own (master) dtype.
      out.params += s.chunk_rows * s.row_numel * element_size(p.dtype);
      if (!p.trainable)
        continue;
      master = p.dtype;
      ++trainable;
      reduce_elements += s.chunk_rows * s.row_numel;
      local_grad_bytes += s.local_rows * s.row_numel * element_size(p.dtype);
      const int64_t local = s.local_rows * s.row_numel;
      slot_elements += (local + 63) / 64 * 64;  // src/optim/fused_optimizer.cpp, kSlotAlign
      torch_state_bytes += local * element_size(p.dtype);
    }
    if (trainable == 0)
      continue;
    // src/engine/param_group.cpp, reduce_gradients: one reduce-scatter output per unit of
    // [padded shards | one flag per parameter] in the reduce dtype. The grads alias it when that
    // is the master dtype (ShardedParam::add_to_stash); otherwise, and under CPU offload, each
    // gets a tensor of its own real rows and the output is freed.
    const bool mixed = !(o.root_full_precision && unit.path.empty());
    const torch::ScalarType reduce = !mixed           ? master
                                     : o.reduce_dtype ? *o.reduce_dtype
                                     : o.param_dtype  ? *o.param_dtype
                                                      : master;
    out.grads += o.cpu_offload || reduce != master
                     ? local_grad_bytes
                     : (reduce_elements + trainable) * element_size(reduce);
  }
  const int moments = o.optimizer == Optimizer::kAdamW         ? 2
                      : o.optimizer == Optimizer::kSgdMomentum ? 1
                                                               : 0;
  if (o.fused) {
    const int64_t esize = element_size(o.moments_dtype);
    if (moments > 0 && o.optimizer_in_file) {
      // src/optim/optimizer_state_store.cpp, FileStore: two chunk buffers (every moment's part
      // of a chunk), chunks of whole 4096-element blocks, each buffer 4096 bytes over for
      // O_DIRECT alignment. The file itself is not memory.
      constexpr int64_t kAlign = 4096;
      const int64_t per_element = moments * esize;
      int64_t chunk = std::max<int64_t>(1, o.chunk_bytes / per_element / kAlign) * kAlign;
      chunk = std::min(chunk, ceil_div(slot_elements, kAlign) * kAlign);
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
