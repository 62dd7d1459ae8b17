// fsdp::TorchFusedAdamW: torch::optim::AdamW whose step runs torch's own fused kernel
// (at::_fused_adamw_, what torch.optim.AdamW(fused=True) runs in Python): a few launches per
// group of parameters (the kernel works in chunks of tensors) instead of about ten per
// parameter.
//
// Why: LibTorch's C++ AdamW steps parameter by parameter with separate element-wise ops. On a
// GPU that is thousands of tiny kernel launches per step for a model of hundreds of parameter
// shards; fsdp::FusedAdamW (fused_optimizer.h) is a CPU kernel. This is the optimizer of
// parameters that live on a GPU. It is a torch::optim::AdamW (same options, same
// AdamWParamState), so checkpoints and param groups work unchanged; the kernel also exists for
// the CPU, where the tests compare it with torch::optim::AdamW.
#pragma once

#include <torch/optim/adamw.h>

#include <cstdint>
#include <unordered_map>
#include <vector>

namespace fsdp {

class TorchFusedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;

  /// Steps every parameter with a gradient: per param group, one at::_fused_adamw_ call over
  /// all of them (they must share a device and a floating dtype, each gradient its
  /// parameter's; amsgrad is not supported).
  torch::Tensor step(LossClosure closure = nullptr) override;

 private:
  // The kernel reads each parameter's step count from a tensor on its device. Kept here, and
  // rebuilt from AdamWParamState::step() whenever that differs (a loaded checkpoint).
  struct StepTensor {
    torch::Tensor value;  // float32 scalar on the parameter's device
    int64_t step = 0;     // what `value` holds
  };
  std::unordered_map<const void*, StepTensor> steps_;
};

}  // namespace fsdp
