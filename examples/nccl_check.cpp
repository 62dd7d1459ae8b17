// Links the NCCL path (fsdp::cuda) into a program and, where a GPU exists, runs one FULL_SHARD
// step on it. Our machines have no GPU: there it only proves that fsdp::cuda compiles, links
// against the wheel's libtorch_cuda and NCCL, and loads; it says so and exits 0.
#include <torch/torch.h>

#include <cstdio>

#include <fsdp/cuda.h>
#include <fsdp/fsdp.h>

int main() {
  fsdp::register_nccl_backend();
  if (!torch::cuda::is_available()) {
    std::printf("nccl_check: fsdp::cuda linked and loaded; no CUDA device here, nothing run\n");
    return 0;
  }
  auto pg = fsdp::init_process_group(fsdp::ProcessGroupOptions().backend("nccl"));
  const auto device = torch::Device(torch::kCUDA, fsdp::launch_env_from_environment().local_rank);
  torch::nn::Sequential net(torch::nn::Linear(64, 64), torch::nn::ReLU(), torch::nn::Linear(64, 8));
  net->to(device);
  fsdp::fully_shard(net, fsdp::FullyShardOptions(pg));
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-3));
  auto loss = fsdp::forward(net, torch::randn({16, 64}, device)).square().mean();
  loss.backward();
  opt.step();
  torch::cuda::synchronize();
  std::printf("nccl_check: rank %d one step on %s, loss %.4f\n", pg->rank(), device.str().c_str(),
              loss.item<double>());
  return 0;
}
