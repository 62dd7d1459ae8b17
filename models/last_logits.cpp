// See last_logits.h.
#include "last_logits.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>

#include <fsdp/distributed/process_group.h>

namespace fsdp_models {

at::Tensor pad_to_group(const at::Tensor& idx,
                        const std::shared_ptr<fsdp::ProcessGroup>& sequence_group) {
  const int64_t n = sequence_group ? sequence_group->size() : 1;
  const int64_t pad = (n - idx.size(1) % n) % n;
  if (pad == 0)
    return idx;
  return at::cat({idx, at::zeros({idx.size(0), pad}, idx.options())}, 1);
}

}  // namespace fsdp_models
