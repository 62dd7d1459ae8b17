// Trains a two-unit model for two steps on one rank through the installed package.
// What it uses of LibTorch, not torch/torch.h: 22 s of CPU to compile instead of 31 (2-core EPYC,
// unoptimised), as a user's own files would.
#include <fsdp/fsdp.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <iostream>

int main() {
  fsdp::memory::install_tracking_allocator();
  auto pg = fsdp::init_process_group();
  torch::nn::Sequential net(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 1));
  fsdp::fully_shard(net, fsdp::FullyShardOptions(pg));
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  auto x = torch::randn({32, 8});
  auto y = x.sum(1, true);
  double first = 0, last = 0;
  for (int step = 0; step < 20; ++step) {
    opt.zero_grad();
    auto loss = torch::mse_loss(fsdp::forward(net, x), y);
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  std::cout << "consumer: loss " << first << " -> " << last << ", peak "
            << fsdp::memory::format_bytes(fsdp::memory::peak_bytes()) << "\n";
  return last < first ? 0 : 1;
}
