// StepProfiler attributes time to the right row: a rank that arrives late makes the other wait
// in an all-gather (forward) or a gradient all-reduce (backward), and those waits must land in
// the wait rows of the rank that waited, not in its compute rows, while the late rank's delay
// lands where it happened. Delays of 0.4 s against a model that computes in milliseconds, so
// the thresholds (>= 0.3 s where the delay belongs, < 0.2 s elsewhere) leave room for a loaded
// machine.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>

#include <chrono>
#include <thread>

#include "harness/multiprocess.h"

namespace {

constexpr double kDelay = 0.4;

void sleep_for(double seconds) {
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
}

// Identity in forward; sleeps in backward on the ranks that pass `seconds` > 0.
struct SleepInBackward : torch::autograd::Function<SleepInBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               double seconds) {
    ctx->saved_data["seconds"] = seconds;
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    sleep_for(ctx->saved_data["seconds"].toDouble());
    return {g[0], torch::Tensor()};
  }
};

struct TwoLayerImpl : torch::nn::Module {
  TwoLayerImpl()
      : a(register_module("a", torch::nn::Linear(8, 16))),
        b(register_module("b", torch::nn::Linear(16, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return fsdp::forward(b, torch::tanh(fsdp::forward(a, x)));
  }
  torch::nn::Linear a, b;
};
TORCH_MODULE(TwoLayer);

TwoLayer make_model(const std::shared_ptr<fsdp::ProcessGroup>& pg,
                    fsdp::ShardingStrategy strategy) {
  torch::manual_seed(3);
  TwoLayer net;
  auto options = fsdp::FullyShardOptions(pg).strategy(strategy);
  fsdp::fully_shard(net->a, options);
  fsdp::fully_shard(net->b, options);
  fsdp::fully_shard(net, options);
  return net;
}

// One profiled step; `late_*`: this rank's delay before forward (outside every scope), inside
// backward, and inside the optimizer scope.
fsdp::StepBreakdown profiled_step(TwoLayer& net, double late_forward, double late_backward,
                                  double in_optimizer) {
  fsdp::StepProfiler prof(net.ptr());
  torch::optim::SGD opt(net->parameters(), 0.1);
  prof.begin_step();
  sleep_for(late_forward);
  torch::Tensor loss;
  {
    auto s = prof.forward();
    loss = fsdp::forward(net, torch::randn({4, 8})).square().mean();
    loss = SleepInBackward::apply(loss, late_backward);
  }
  {
    auto s = prof.backward();
    loss.backward();
  }
  {
    auto s = prof.optimizer();
    sleep_for(in_optimizer);
    opt.step();
  }
  return prof.end_step();
}

FSDP_WORKER(profiler_attribution) {
  auto pg = fsdp::init_process_group();
  const bool late = pg->rank() == 1;
  auto sharded = make_model(pg, fsdp::ShardingStrategy::kFullShard);
  auto replicated = make_model(pg, fsdp::ShardingStrategy::kNoShard);
  profiled_step(sharded, 0, 0, 0);  // warm up the connections
  profiled_step(replicated, 0, 0, 0);

  // Rank 1 starts its forward late: rank 0 waits in the root's all-gather.
  auto b = profiled_step(sharded, late ? kDelay : 0, 0, 0.1);
  WORKER_CHECK(b.comm.all_gather.calls > 0) << b.to_string();
  WORKER_CHECK(b.optimizer_s >= 0.1 && b.optimizer_s < 0.3) << b.to_string();
  if (late) {
    WORKER_CHECK(b.other_s >= kDelay - 0.02 && b.all_gather_wait_s < 0.2) << b.to_string();
  } else {
    WORKER_CHECK(b.all_gather_wait_forward_s >= 0.3 && b.forward_s < 0.2 && b.other_s < 0.2)
        << b.to_string();
  }
  WORKER_CHECK(b.all_gather_wait_forward_s <= b.all_gather_wait_s) << b.to_string();

  // Rank 1 is slow inside backward (no_shard: no all-gathers): rank 0 waits for the
  // gradient all-reduce at the end of its backward.
  b = profiled_step(replicated, 0, late ? kDelay : 0, 0);
  WORKER_CHECK(b.comm.all_gather.calls == 0 && b.all_gather_wait_s == 0 &&
               b.comm.all_reduce.calls > 0)
      << b.to_string();
  if (late) {
    WORKER_CHECK(b.backward_s >= kDelay - 0.02 && b.reduce_wait_s < 0.2) << b.to_string();
  } else {
    WORKER_CHECK(b.reduce_wait_s >= 0.3 && b.backward_s < 0.2) << b.to_string();
  }
  std::printf("[rank %d] PROFILER OK: waits attributed to the waiting rank\n%s", pg->rank(),
              b.to_string().c_str());
  return 0;
}

TEST(StepProfiler, LateRankShowsAsWaitOnTheOthersAndWhereItWasLate) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("profiler_attribution", 2));
}

}  // namespace
