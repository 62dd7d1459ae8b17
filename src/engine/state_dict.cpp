#include <fsdp/state_dict.h>

#include <fsdp/distributed/process_group.h>

#include "param_group.h"
#include "registry.h"

namespace fsdp {

std::vector<ParamShard> param_shards(torch::nn::Module& model) {
  std::vector<ParamShard> out;
  // Parameters outside any unit are whole on every rank: rank 0 of the units' group writes.
  const auto units = detail::units_under(model);
  const bool rank0 = units.empty() || units.front()->options().group()->rank() == 0;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const auto& param = item.value();
    ParamShard s;
    s.name = item.key();
    auto unit = detail::unit_of_param(param.unsafeGetTensorImpl());
    const detail::ShardedParam* sp = nullptr;
    if (unit) {
      for (const auto& p : unit->params()) {
        if (p.param().unsafeGetTensorImpl() == param.unsafeGetTensorImpl())
          sp = &p;
      }
    }
    if (!sp) {
      s.shard = param.dim() == 0 ? param.reshape({1}) : param;
      s.global_shape = param.sizes().vec();
      s.rows = s.shard.size(0);
      s.writer = rank0;
      out.push_back(std::move(s));
      continue;
    }
    TORCH_CHECK(unit->sharded_state() == detail::ShardedState::kSharded,
                "fsdp::param_shards: unit '", unit->name(),
                "' is gathered (fsdp::unshard held, or inside a forward): reshard it "
                "first");
    s.global_shape = sp->shape();
    s.row_begin = sp->row_begin();
    s.rows = sp->local_rows();
    s.shard = sp->sharded_view();
    // Replicas of the same rows: the first rank of the replicate group writes them.
    const auto& replicate = unit->groups().replicate;
    s.writer = !replicate || replicate->rank() == 0;
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace fsdp
