#include "optimizer_factory.h"

#include <filesystem>

#include <fsdp/optim/fused_optimizer.h>
#include <fsdp/optim/torch_fused_adamw.h>

namespace fsdp_trainer {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const Config& config,
                                                        std::vector<torch::Tensor> decay,
                                                        std::vector<torch::Tensor> no_decay) {
  const auto& t = config.training;
  const auto& o = config.optimizer;
  // Shards on a GPU (training.device = cuda without fsdp.cpu_offload): the fused optimizers of
  // fsdp::FusedAdamW / FusedSGD are CPU kernels; torch's own fused CUDA AdamW and its SGD step
  // there instead (config.cpp refuses the options only the CPU kernels have).
  const bool on_gpu = !decay.empty() ? !decay[0].device().is_cpu()
                                     : (!no_decay.empty() && !no_decay[0].device().is_cpu());
  auto state = fsdp::OptimizerStateOptions()
                   .moments_dtype(o.moments_dtype == "bf16" ? torch::kBFloat16 : torch::kFloat32)
                   .chunk_bytes(static_cast<int64_t>(o.chunk_mb * (1 << 20)))
                   .direct_io(o.direct_io);
  if (o.offload == "file") {
    const auto dir = offload_dir(config);
    if (o.offload_dir.empty())  // the default lives in the run directory: made on demand
      std::filesystem::create_directories(dir);
    state.offload_dir(dir);
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (o.name == "sgd") {
    auto sgd = torch::optim::SGDOptions(t.lr)
                   .momentum(o.momentum)
                   .nesterov(o.nesterov)
                   .weight_decay(t.weight_decay);
    groups.emplace_back(std::move(decay), std::make_unique<torch::optim::SGDOptions>(sgd));
    groups.emplace_back(std::move(no_decay), std::make_unique<torch::optim::SGDOptions>(
                                                 torch::optim::SGDOptions(sgd).weight_decay(0.0)));
    if (on_gpu)
      return std::make_unique<torch::optim::SGD>(std::move(groups), sgd);
    return std::make_unique<fsdp::FusedSGD>(std::move(groups), sgd, state);
  }
  auto adamw =
      torch::optim::AdamWOptions(t.lr).betas({t.beta1, t.beta2}).weight_decay(t.weight_decay);
  groups.emplace_back(std::move(decay), std::make_unique<torch::optim::AdamWOptions>(adamw));
  groups.emplace_back(std::move(no_decay),
                      std::make_unique<torch::optim::AdamWOptions>(
                          torch::optim::AdamWOptions(adamw).weight_decay(0.0)));
  if (o.name == "adamw")
    return std::make_unique<torch::optim::AdamW>(std::move(groups), adamw);
  if (on_gpu)
    return std::make_unique<fsdp::TorchFusedAdamW>(std::move(groups), adamw);
  return std::make_unique<fsdp::FusedAdamW>(std::move(groups), adamw, state);
}

}  // namespace fsdp_trainer
