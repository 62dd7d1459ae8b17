// See last_logits.h.
#include "last_logits.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>

#include <c10/util/Exception.h>

#include <fsdp/distributed/process_group.h>
#include <fsdp/tensor_parallel/tp_ops.h>

namespace fsdp_models {

int64_t LastLogits::first_of(int64_t t, const char* model) const {
  TORCH_CHECK(positions >= 1 && positions <= t, model, ": the last ", positions,
              " positions' logits asked of ", t);
  return t - positions;
}

at::Tensor pad_to_group(const at::Tensor& idx,
                        const std::shared_ptr<fsdp::ProcessGroup>& sequence_group) {
  const int64_t n = sequence_group ? sequence_group->size() : 1;
  const int64_t pad = (n - idx.size(1) % n) % n;
  if (pad == 0)
    return idx;
  return at::cat({idx, at::zeros({idx.size(0), pad}, idx.options())}, 1);
}

at::Tensor positions_of(const at::Tensor& normed,
                        const std::shared_ptr<fsdp::ProcessGroup>& sequence_group, int64_t from,
                        int64_t count) {
  const auto whole =
      sequence_group ? fsdp::tp::gather_from_group(normed, 1, sequence_group) : normed;
  return whole.narrow(1, from, count);
}

}  // namespace fsdp_models
