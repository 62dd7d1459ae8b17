// Builds the configured optimizer ([optimizer]: torch's AdamW, fsdp::FusedAdamW or
// fsdp::FusedSGD, with their state in memory or offloaded to a file).
#pragma once

#include <torch/torch.h>

#include <memory>
#include <vector>

#include "config/config.h"

namespace fsdp_trainer {

/// `decay` get training.weight_decay, `no_decay` (norms, biases) none. Offload problems (the
/// directory, the space for the state) are errors here, before the first step.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const Config& config,
                                                        std::vector<torch::Tensor> decay,
                                                        std::vector<torch::Tensor> no_decay);

}  // namespace fsdp_trainer
