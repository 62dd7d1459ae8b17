// The small model the checkpoint and state-dict tests share: two linear layers with sizes 2, 3
// and 4 ranks do not divide (13 and 5 rows), and a 0-d parameter, which lives in the root unit.
#pragma once

#include <torch/torch.h>

namespace fsdp::test {

struct SmallNetImpl : torch::nn::Module {
  SmallNetImpl()
      : a(register_module("a", torch::nn::Linear(7, 13))),
        b(register_module("b", torch::nn::Linear(13, 5))),
        gain(register_parameter("gain", torch::tensor(1.5))) {}
  torch::nn::Linear a, b;
  torch::Tensor gain;  // 0-d, in the root unit
};
TORCH_MODULE(SmallNet);

}  // namespace fsdp::test
