// CPUOffloadPolicy: shards and gradients on the host, staged to the compute device for each
// all-gather and copied back after each reduction. On CPU the device is the host, so what this
// checks is that the offload path (staged gather inputs, host gradient copies, a unit that
// owns its unsharded buffer even on one rank) changes nothing in the math: parameters after
// training are bitwise those of the same run without offload, under every strategy and with
// mixed precision and a compressed gather format. tests/cuda/test_nccl.cpp runs the same on a
// GPU (scripts/gpu_check.sh; docs/gpu.md).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>

#include <fsdp/core/memory.h>
#include <fsdp/fsdp.h>
#include <fsdp/optim/fused_optimizer.h>

#include "harness/multiprocess.h"

namespace {

struct BlockImpl : torch::nn::Module {
  BlockImpl() : fc(register_module("fc", torch::nn::Linear(9, 9))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + torch::gelu(fc(x)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl()
      : a(register_module("a", Block())),
        b(register_module("b", Block())),
        head(register_module("head", torch::nn::Linear(9, 5))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return head(fsdp::forward(b, fsdp::forward(a, x)));
  }
  Block a, b;
  torch::nn::Linear head;
};
TORCH_MODULE(Net);

// Returns the parameters after training; *allocations: tensors allocated by the steps.
std::vector<torch::Tensor> train(const std::shared_ptr<fsdp::ProcessGroup>& pg,
                                 const std::string& strategy, const std::string& precision,
                                 bool offload, int rank, int64_t* allocations) {
  torch::manual_seed(3);
  Net net;
  fsdp::FullyShardOptions o(pg);
  if (strategy == "no_shard")
    o.strategy(fsdp::ShardingStrategy::kNoShard);
  if (strategy == "shard_grad_op")
    o.strategy(fsdp::ShardingStrategy::kShardGradOp);
  if (precision == "bf16")
    o.mp_policy(fsdp::MixedPrecisionPolicy().param_dtype(torch::kBFloat16));
  if (precision == "int8")
    o.mp_policy(fsdp::MixedPrecisionPolicy().gather_format(fsdp::GatherFormat::kInt8));
  if (offload)
    o.offload_policy(fsdp::CPUOffloadPolicy());
  fsdp::fully_shard(net->a, o);
  fsdp::fully_shard(net->b, o);
  fsdp::fully_shard(net, o);
  fsdp::FusedAdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  const int64_t before = fsdp::memory::stats().num_allocations;
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(100 + 10 * step + rank);
    auto x = torch::randn({4, 9});
    fsdp::forward(net, x).square().mean().backward();
    opt.step();
    opt.zero_grad();
  }
  *allocations = fsdp::memory::stats().num_allocations - before;
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters()) {
    // At rest every parameter is its host shard.
    WORKER_CHECK(p.device().is_cpu()) << "a parameter at rest on " << p.device();
    out.push_back(p.detach().clone());
  }
  return out;
}

FSDP_WORKER(cpu_offload_equivalence) {
  fsdp::memory::install_tracking_allocator();
  auto pg = fsdp::init_process_group();
  for (const char* strategy : {"full_shard", "shard_grad_op", "no_shard"}) {
    for (const char* precision : {"fp32", "bf16", "int8"}) {
      int64_t plain_allocs = 0, offload_allocs = 0;
      auto plain = train(pg, strategy, precision, false, ctx.rank, &plain_allocs);
      auto offloaded = train(pg, strategy, precision, true, ctx.rank, &offload_allocs);
      // The offload path ran: staged gather inputs and host gradient copies are allocations
      // the plain run does not make. (Except where the plain run copies too: a bf16 unit that
      // gathers nothing still casts its reduced gradient to fp32, into a new tensor.)
      const bool gathers = ctx.world_size > 1 && std::string(strategy) != "no_shard";
      if (gathers || std::string(precision) != "bf16") {
        WORKER_CHECK(offload_allocs > plain_allocs)
            << strategy << " " << precision << ": " << offload_allocs << " vs " << plain_allocs;
      }
      WORKER_CHECK(plain.size() == offloaded.size());
      for (size_t i = 0; i < plain.size(); ++i) {
        WORKER_CHECK(plain[i].sizes() == offloaded[i].sizes());
        WORKER_CHECK(std::memcmp(plain[i].data_ptr(), offloaded[i].data_ptr(),
                                 plain[i].numel() * plain[i].element_size()) == 0)
            << strategy << " " << precision << ": parameter " << i << " differs by "
            << (plain[i] - offloaded[i]).abs().max().item<float>();
      }
      std::cout << "rank " << ctx.rank << " " << strategy << " " << precision
                << ": offloaded run bitwise equal\n";
    }
  }
  return 0;
}

TEST(CpuOffload, SameParametersWithAndWithoutOffload) {
  for (int world : {1, 2, 3})
    EXPECT_WORKERS_OK(fsdp::test::run_workers("cpu_offload_equivalence", world));
}

}  // namespace
