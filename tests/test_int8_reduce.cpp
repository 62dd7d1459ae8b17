// ReduceFormat::kInt8: the gradient reduce-scatter sent as int8 with per-block scales, decoded
// and summed by each shard's owner, with error feedback. On 3 ranks (no parameter divisible),
// full_shard and hybrid 2 x 2:
//  - one step's reduced gradient is within the quantization bound of the fp32 reduction;
//  - with error feedback the sum of K reductions of the same gradient stays within one step's
//    bound of K times the exact one, while without it the error grows with K;
//  - the reduce-scatter moves about a quarter of fp32's bytes;
//  - the flags come out as with fp32 (a parameter only one rank gives a gradient gets one on
//    every rank), in a root unit of a few scalars;
//  - a backward pass that fails after a unit reduced drops that unit's residual: the retried
//    pass gives bitwise the gradients of a model that never failed.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>

#include "harness/multiprocess.h"

namespace {

constexpr int64_t kIn = 29, kOut = 37;
constexpr int64_t kBlock = 32;

// Set by the failure test: the backward between the two units throws (after `b` reduced).
bool g_throw_between_units = false;

struct ThrowInBackward : torch::autograd::Function<ThrowInBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g) {
    if (g_throw_between_units)
      throw std::runtime_error("injected backward failure");
    return g;
  }
};

struct NetImpl : torch::nn::Module {
  NetImpl()
      : a(register_module("a", torch::nn::Linear(kIn, kOut))),
        b(register_module("b", torch::nn::Linear(kOut, 5))),
        tiny(register_parameter("tiny", torch::tensor({0.5f, -1.5f, 2.0f}))),
        unused(register_parameter("unused", torch::ones({4}))) {}
  // `with_unused`: this rank uses `unused` too (only some ranks do).
  torch::Tensor forward(const torch::Tensor& x, bool with_unused) {
    auto h = ThrowInBackward::apply(torch::tanh(fsdp::forward(a, x)));
    auto out = fsdp::forward(b, h) * tiny.sum();
    if (with_unused)
      out = out + unused.sum();
    return out;
  }
  torch::nn::Linear a, b;
  torch::Tensor tiny, unused;  // the root unit: 7 elements
};
TORCH_MODULE(Net);

Net make(const std::shared_ptr<fsdp::ProcessGroup>& pg, bool hybrid, bool int8, bool feedback) {
  torch::manual_seed(3);
  Net net;
  fsdp::FullyShardOptions o(pg);
  if (hybrid)
    o.strategy(fsdp::ShardingStrategy::kHybridShard).hybrid_shard_size(2);
  if (int8) {
    o.mp_policy(fsdp::MixedPrecisionPolicy()
                    .reduce_format(fsdp::ReduceFormat::kInt8)
                    .int8_block_size(kBlock)
                    .error_feedback(feedback));
  }
  fsdp::fully_shard(net->a, o);
  fsdp::fully_shard(net->b, o);
  fsdp::fully_shard(net, o);
  return net;
}

// One backward of a fixed batch (per rank); the shard grads as one flat double tensor.
torch::Tensor grads_of_one_step(Net& net, int rank) {
  for (auto& p : net->parameters())
    p.mutable_grad() = torch::Tensor();
  torch::manual_seed(50 + rank);
  auto x = torch::randn({4, kIn});
  net->forward(x, rank == 1).square().mean().backward();
  std::vector<torch::Tensor> flat;
  for (auto& p : net->parameters()) {
    flat.push_back(p.grad().defined() ? p.grad().detach().flatten().to(torch::kDouble)
                                      : torch::full({p.numel()}, -1e9, torch::kDouble));
  }
  return torch::cat(flat);
}

FSDP_WORKER(int8_reduce) {
  auto pg = fsdp::init_process_group();
  const bool hybrid = ctx.world_size == 4;
  auto exact_net = make(pg, hybrid, false, false);
  const auto exact = grads_of_one_step(exact_net, ctx.rank);
  const int64_t fp32_bytes = fsdp::comm_stats(*exact_net).reduce_scatter.bytes;

  constexpr int kSteps = 24;
  double first_error = 0, feedback_error = 0, plain_error = 0;
  for (bool feedback : {true, false}) {
    auto net = make(pg, hybrid, true, feedback);
    const int64_t before = fsdp::comm_stats(*net).reduce_scatter.bytes;
    auto sum = torch::zeros_like(exact);
    for (int k = 0; k < kSteps; ++k) {
      auto g = grads_of_one_step(net, ctx.rank);
      // Parameters without a gradient anywhere stay without one; the others have one.
      WORKER_CHECK(((g == -1e9) == (exact == -1e9)).all().item<bool>()) << "flags differ";
      if (k == 0) {
        const double bytes =
            static_cast<double>(fsdp::comm_stats(*net).reduce_scatter.bytes - before);
        WORKER_CHECK(bytes < 0.36 * fp32_bytes)
            << "int8 moved " << bytes << " bytes, fp32 " << fp32_bytes;
        first_error = (g - exact).abs().max().item<double>();
      }
      sum += g;
    }
    const double err = (sum - kSteps * exact).abs().max().item<double>();
    (feedback ? feedback_error : plain_error) = err;
  }
  // One step: each rank's piece is off by at most half a step of its block (its block's
  // largest magnitude / 254), so the mean of the pieces by at most the largest such step: bound
  // by the largest local (unreduced) gradient of any rank, computed here without sharding.
  double scale = 0;
  for (int r = 0; r < ctx.world_size; ++r) {
    torch::manual_seed(3);
    Net local;  // no unit: fsdp::forward runs the modules as they are
    torch::manual_seed(50 + r);
    auto x = torch::randn({4, kIn});
    local->forward(x, r == 1).square().mean().backward();
    for (auto& p : local->parameters()) {
      if (p.grad().defined())
        scale = std::max(scale, p.grad().abs().max().item<double>());
    }
  }
  WORKER_CHECK(first_error > 0) << "int8 reduction equal to fp32: nothing was quantized";
  WORKER_CHECK(first_error <= scale / 254 * 1.01) << first_error << " vs " << scale;
  // Error feedback: the sum's error stays within about one step's; without it, it grows.
  WORKER_CHECK(feedback_error <= 2 * first_error) << feedback_error << " vs " << first_error;
  WORKER_CHECK(plain_error > 4 * feedback_error) << plain_error << " vs " << feedback_error;
  std::cout << "rank " << ctx.rank << (hybrid ? " hybrid" : " full_shard")
            << ": one step max error " << first_error << " (scale " << scale << "), after "
            << kSteps << " steps " << feedback_error << " with feedback, " << plain_error
            << " without; reduce-scatter bytes int8/fp32 checked OK\n";
  return 0;
}

FSDP_WORKER(int8_reduce_failure) {
  auto pg = fsdp::init_process_group();
  auto fresh = make(pg, false, true, true);
  const auto expected = grads_of_one_step(fresh, ctx.rank);
  auto failed = make(pg, false, true, true);
  g_throw_between_units = true;
  bool threw = false;
  try {
    grads_of_one_step(failed, ctx.rank);
  } catch (const std::exception& e) {
    threw = std::string(e.what()).find("injected backward failure") != std::string::npos;
  }
  g_throw_between_units = false;
  WORKER_CHECK(threw) << "the injected failure did not throw";
  const auto retried = grads_of_one_step(failed, ctx.rank);
  WORKER_CHECK(torch::equal(retried, expected))
      << "after a failed pass the gradients differ from a model that never failed by "
      << (retried - expected).abs().max().item<double>();
  std::cout << "rank " << ctx.rank << ": failed pass rolled back, retried gradients bitwise "
            << "a fresh model's OK\n";
  return 0;
}

TEST(Int8Reduce, AFailedPassDropsTheResidualOfUnitsItReduced) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("int8_reduce_failure", 3));
}

TEST(Int8Reduce, ErrorFeedbackKeepsTheSumExactAndMovesAQuarterOfTheBytes) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("int8_reduce", 3));
}

TEST(Int8Reduce, HybridShardQuantizesTheShardDimension) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("int8_reduce", 4));
}

}  // namespace
