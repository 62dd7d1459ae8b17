// The optimizer inside backward (fsdp::set_post_reduce_hook + FusedOptimizer::step_params):
// each unit is stepped as soon as its gradients are reduced, and its grads dropped. The
// parameters after training must be bitwise those of the usual backward-then-step, under every
// strategy, in fp32 and bf16, with a module called twice, a frozen unit, gradient accumulation
// (with and without sync on the first micro-batch) and world sizes that divide no parameter;
// and the gradients alive at once must fall from the whole model's to about one unit's.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>

#include <fsdp/core/memory.h>
#include <fsdp/fsdp.h>
#include <fsdp/optim/fused_optimizer.h>

#include "harness/multiprocess.h"

namespace {

constexpr int64_t kDim = 23;  // 2, 3 and 4 ranks divide no parameter's rows
constexpr int kBlocks = 6;

struct BlockImpl : torch::nn::Module {
  BlockImpl() : fc(register_module("fc", torch::nn::Linear(kDim, kDim))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + torch::tanh(fc(x)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl()
      : head(register_module("head", torch::nn::Linear(kDim, 5))),
        gain(register_parameter("gain", torch::tensor(1.25))) {
    for (int i = 0; i < kBlocks; ++i)
      blocks.push_back(register_module(std::string(1, 'b') + std::to_string(i), Block()));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = x;
    for (int i = 0; i < kBlocks; ++i) {
      h = fsdp::forward(blocks[i], h);
      if (i == 1)
        h = fsdp::forward(blocks[i], h);  // a module called twice
    }
    return head(h) * gain;
  }
  std::vector<Block> blocks;
  torch::nn::Linear head;
  torch::Tensor gain;  // 0-d, in the root unit
};
TORCH_MODULE(Net);

struct Run {
  std::vector<torch::Tensor> params;
  int64_t peak_grad_bytes = 0;  // the largest kGrads high-water mark of a step
  int hooks = 0;                // post-reduce hook calls
};

// `in_backward`: step inside backward; `sync_first`: the first micro-batch reduces too (its
// hook is not set, so only the last micro-batch's backward steps).
Run train(const std::shared_ptr<fsdp::ProcessGroup>& pg, const std::string& strategy,
          const std::string& precision, bool in_backward, bool sync_first, int rank) {
  torch::manual_seed(7);
  Net net;
  net->blocks[3]->fc->weight.requires_grad_(false);  // a frozen unit (its bias too)
  net->blocks[3]->fc->bias.requires_grad_(false);
  fsdp::FullyShardOptions o(pg);
  if (strategy == "no_shard")
    o.strategy(fsdp::ShardingStrategy::kNoShard);
  if (strategy == "shard_grad_op")
    o.strategy(fsdp::ShardingStrategy::kShardGradOp);
  if (strategy == "hybrid")
    o.strategy(fsdp::ShardingStrategy::kHybridShard).hybrid_shard_size(2);
  if (precision == "bf16") {
    o.mp_policy(
        fsdp::MixedPrecisionPolicy().param_dtype(torch::kBFloat16).reduce_dtype(torch::kBFloat16));
  }
  for (auto& b : net->blocks)
    fsdp::fully_shard(b, o);
  fsdp::fully_shard(net, o);
  std::vector<torch::Tensor> trainable;
  for (const auto& p : net->parameters()) {
    if (p.requires_grad())
      trainable.push_back(p);
  }
  fsdp::FusedAdamW opt(trainable, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  Run run;
  fsdp::PostReduceHook hook = [&](const std::vector<torch::Tensor>& params) {
    ++run.hooks;
    opt.step_params(params);
    for (auto p : params)
      p.mutable_grad() = torch::Tensor();
  };
  fsdp::memory::CategoryScope activations(fsdp::memory::Category::kActivations);
  for (int step = 0; step < 4; ++step) {
    fsdp::memory::reset_peak();
    for (int micro = 0; micro < 2; ++micro) {
      const bool last = micro == 1;
      fsdp::set_requires_gradient_sync(*net, last || sync_first);
      fsdp::set_post_reduce_hook(*net, in_backward && last ? hook : nullptr);
      torch::manual_seed(100 + 10 * step + 2 * rank + micro);
      auto x = torch::randn({3, kDim});
      auto out = fsdp::forward(net, x);
      out.to(torch::kFloat).square().mean().backward();
    }
    if (!in_backward) {
      opt.step();
      opt.zero_grad();
    }
    run.peak_grad_bytes = std::max(
        run.peak_grad_bytes, fsdp::memory::peak_by_category()[fsdp::memory::Category::kGrads]);
  }
  fsdp::set_post_reduce_hook(*net, nullptr);
  for (const auto& p : net->parameters()) {
    WORKER_CHECK(!p.grad().defined() || !in_backward) << "a grad left after the hooks";
    run.params.push_back(p.detach().clone());
  }
  return run;
}

FSDP_WORKER(optimizer_in_backward_equivalence) {
  fsdp::memory::install_tracking_allocator();
  auto pg = fsdp::init_process_group();
  std::vector<std::string> strategies = {"full_shard", "shard_grad_op", "no_shard"};
  if (ctx.world_size == 4)
    strategies = {"hybrid"};
  for (const auto& strategy : strategies) {
    for (const char* precision : {"fp32", "bf16"}) {
      for (bool sync_first : {false, true}) {
        auto plain = train(pg, strategy, precision, false, sync_first, ctx.rank);
        auto inside = train(pg, strategy, precision, true, sync_first, ctx.rank);
        // One hook per trainable unit per step: 5 trainable blocks and the root, 4 steps.
        WORKER_CHECK(plain.hooks == 0 && inside.hooks == 4 * (kBlocks - 1 + 1))
            << strategy << ": " << inside.hooks << " hook calls";
        WORKER_CHECK(plain.params.size() == inside.params.size());
        for (size_t i = 0; i < plain.params.size(); ++i) {
          const auto& a = plain.params[i];
          const auto& b = inside.params[i];
          WORKER_CHECK(a.sizes() == b.sizes());
          WORKER_CHECK(std::memcmp(a.data_ptr(), b.data_ptr(), a.numel() * a.element_size()) == 0)
              << strategy << " " << precision << " sync_first " << sync_first << ": parameter " << i
              << " differs by " << (a - b).abs().max().item<float>();
        }
        std::cout << "rank " << ctx.rank << " " << strategy << " " << precision
                  << (sync_first ? " sync_first" : "")
                  << ": stepped in backward, bitwise equal; peak grad bytes "
                  << inside.peak_grad_bytes << " vs " << plain.peak_grad_bytes << " OK\n";
      }
    }
  }
  return 0;
}

// One rank (no communication) and three (shards that divide no size); hybrid_shard on four below.
TEST(OptimizerInBackward, BitwiseTheUsualStep) {
  for (int world : {1, 3})
    EXPECT_WORKERS_OK(fsdp::test::run_workers("optimizer_in_backward_equivalence", world));
}

TEST(OptimizerInBackward, HybridShardBitwiseTheUsualStep) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("optimizer_in_backward_equivalence", 4));
}

constexpr int kUnits = 24;
constexpr int64_t kWidth = 256;

struct StackImpl : torch::nn::Module {
  StackImpl() {
    for (int i = 0; i < kUnits; ++i)
      layers.push_back(register_module(std::string(1, 'l') + std::to_string(i),
                                       torch::nn::Linear(kWidth, kWidth)));
  }
  torch::Tensor forward(torch::Tensor h) {
    for (auto& l : layers)
      h = torch::relu(fsdp::forward(l, h));
    return h;
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(Stack);

// A deep stack of equal units: the usual step keeps every unit's sharded grads until the
// optimizer runs; inside backward each unit's are freed after its step.
FSDP_WORKER(optimizer_in_backward_memory) {
  fsdp::memory::install_tracking_allocator();
  auto pg = fsdp::init_process_group();
  std::array<int64_t, 2> peaks{};
  for (bool in_backward : {false, true}) {
    torch::manual_seed(1);
    Stack net;
    for (auto& l : net->layers)
      fsdp::fully_shard(l, fsdp::FullyShardOptions(pg));
    fsdp::fully_shard(net, fsdp::FullyShardOptions(pg));
    fsdp::FusedSGD opt(net->parameters(), torch::optim::SGDOptions(1e-3));
    if (in_backward) {
      fsdp::set_post_reduce_hook(*net, [&](const std::vector<torch::Tensor>& params) {
        opt.step_params(params);
        for (auto p : params)
          p.mutable_grad() = torch::Tensor();
      });
    }
    int64_t peak = 0;
    for (int step = 0; step < 3; ++step) {
      fsdp::memory::reset_peak();
      torch::manual_seed(50 + step + ctx.rank);
      fsdp::forward(net, torch::randn({4, kWidth})).square().mean().backward();
      if (!in_backward) {
        opt.step();
        opt.zero_grad();
      }
      peak = std::max(peak, fsdp::memory::peak_by_category()[fsdp::memory::Category::kGrads]);
    }
    peaks[in_backward ? 1 : 0] = peak;
  }
  // One unit's sharded grads (+ its bias) in fp32; the unsharded grad of the unit in backward
  // and the reduce-scatter buffers come on top in both runs.
  const int64_t unit_shard = (kWidth * kWidth + kWidth) * 4 / ctx.world_size;
  std::cout << "rank " << ctx.rank << ": peak gradient bytes " << peaks[0] << " usual, " << peaks[1]
            << " in backward (one unit's shard " << unit_shard << ") OK\n";
  // The usual step holds all the units' shards at the end of backward.
  WORKER_CHECK(peaks[0] >= kUnits * unit_shard) << peaks[0];
  // Inside backward: the unsharded grads and reduce buffers in flight, plus at most a few
  // units' reduced shards waiting for their hook (one round behind).
  const int64_t unsharded_and_buffers = 3 * (kWidth * kWidth + kWidth) * 4;
  WORKER_CHECK(peaks[1] <= unsharded_and_buffers + 3 * unit_shard)
      << peaks[1] << " > " << unsharded_and_buffers + 3 * unit_shard;
  WORKER_CHECK(peaks[1] < peaks[0]) << peaks[1] << " vs " << peaks[0];
  return 0;
}

TEST(OptimizerInBackward, GradientsOfAboutOneUnitAlive) {
  for (int world : {2, 3})
    EXPECT_WORKERS_OK(fsdp::test::run_workers("optimizer_in_backward_memory", world));
}

}  // namespace
