// ShardedGradScaler: dynamic loss scaling over sharded gradients.
//
// In fp32, scaling by a power of two and unscaling are exact (an exponent shift, absent
// overflow), so a run with the scaler must equal a run without it bit for bit, on every rank;
// that pins the scale/unscale arithmetic. An inf injected into one rank's shard of one grad must
// make every rank skip that step (parameters and optimizer state untouched) and halve the scale
// everywhere; clean steps grow it after growth_interval. In fp16 the same skip semantics hold,
// and unscale_ composes with fsdp::clip_grad_norm_.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>

#include "harness/multiprocess.h"

namespace {

constexpr int64_t kIn = 7, kHidden = 13, kOut = 5;
constexpr int kSteps = 6, kInfStep = 3;

struct NetImpl : torch::nn::Module {
  NetImpl()
      : a(register_module("a", torch::nn::Linear(kIn, kHidden))),
        head(register_module("head", torch::nn::Linear(kHidden, kOut))) {}
  torch::Tensor forward(const torch::Tensor& x) { return head(torch::tanh(fsdp::forward(a, x))); }
  torch::nn::Linear a, head;
};
TORCH_MODULE(Net);

FSDP_WORKER(grad_scaler) {
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), n = pg->size();
  const bool fp16 = ctx.env("PARAM") == "fp16";

  // use_scaler false: the reference, which skips the same step by hand.
  auto run = [&](bool use_scaler, std::vector<double>* scales) {
    torch::manual_seed(3);
    Net net;
    fsdp::FullyShardOptions opts(pg);
    if (fp16)
      opts.mp_policy(fsdp::MixedPrecisionPolicy().param_dtype(torch::kHalf));
    fsdp::fully_shard(net->a, opts);
    if (fp16)  // the loss in fp32
      opts.mp_policy(
          fsdp::MixedPrecisionPolicy().param_dtype(torch::kHalf).output_dtype(torch::kFloat));
    fsdp::fully_shard(net, opts);
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
    fsdp::ShardedGradScaler scaler(
        pg, fsdp::GradScalerOptions().init_scale(1024).growth_interval(2).enabled(use_scaler));
    for (int step = 0; step < kSteps; ++step) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
      auto x = torch::randn({4 * n, kIn}, gen).narrow(0, 4 * rank, 4);
      auto y = torch::randn({4 * n, kOut}, gen).narrow(0, 4 * rank, 4);
      opt.zero_grad();
      auto loss = torch::nn::functional::mse_loss(fsdp::forward(net, x), y);
      scaler.scale(loss).backward();
      if (step == kInfStep && rank == n - 1) {
        // One element of one shard on one rank: the others' grads are finite.
        net->a->weight.grad().view(-1)[0] = std::numeric_limits<float>::infinity();
      }
      const auto before = net->a->weight.detach().clone();
      bool did_step;
      if (!use_scaler) {
        did_step = step != kInfStep;
        if (did_step)
          opt.step();
      } else if (step == kSteps - 1) {
        // Unscale first, then clip by the global norm, then step.
        scaler.unscale_(opt);
        const double norm = fsdp::clip_grad_norm_(net->parameters(), 1e9, *pg);
        WORKER_CHECK(std::isfinite(norm)) << norm;
        did_step = scaler.step(opt);
      } else {
        did_step = scaler.step(opt);
      }
      if (use_scaler) {
        WORKER_CHECK(scaler.found_inf() == (step == kInfStep))
            << "step " << step << " found_inf " << scaler.found_inf();
        scaler.update();
      }
      WORKER_CHECK(did_step == (step != kInfStep)) << "step " << step;
      if (!did_step && before.numel() > 0) {
        WORKER_CHECK(torch::equal(before, net->a->weight.detach()))
            << "skipped step changed a.weight";
      }
      if (scales)
        scales->push_back(scaler.get_scale());
    }
    if (use_scaler) {
      WORKER_CHECK(scaler.skipped_steps() == 1) << scaler.skipped_steps();
    }
    return net;
  };

  std::vector<double> scales;
  auto scaled = run(true, &scales);
  // 1024, two clean steps -> 2048, inf at step 3 -> 1024 (tracker reset at step 2's growth, so
  // step 3 is the first of a new interval), then 2 clean steps -> 2048.
  const std::vector<double> want = {1024, 2048, 2048, 1024, 1024, 2048};
  WORKER_CHECK(scales == want) << "scales " << c10::Join(",", scales);

  if (!fp16) {
    auto plain = run(false, nullptr);
    auto got = scaled->parameters(), ref = plain->parameters();
    for (size_t i = 0; i < got.size(); ++i) {
      WORKER_CHECK(torch::equal(got[i], ref[i]))
          << "param " << i << " differs from the unscaled run";
    }
  }
  for (const auto& p : scaled->parameters())
    WORKER_CHECK(torch::isfinite(p).all().item<bool>()) << "non-finite parameter";
  std::printf("[rank %d] GRAD SCALER OK (%s): scales %s, skipped step %d on every rank\n", rank,
              fp16 ? "fp16" : "fp32, bitwise equal to unscaled", c10::Join(",", scales).c_str(),
              kInfStep);
  return 0;
}

TEST(GradScaler, Fp32ScalingIsExactAndAnInfOnOneRankSkipsTheStepEverywhere) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("grad_scaler", 3));
}

TEST(GradScaler, Fp16SkipsAndBacksOffOnEveryRank) {
  fsdp::test::RunOptions o;
  o.env = {{"PARAM", "fp16"}};
  EXPECT_WORKERS_OK(fsdp::test::run_workers("grad_scaler", 2, o));
}

}  // namespace
