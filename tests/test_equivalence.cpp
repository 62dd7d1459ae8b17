// Sharding must be invisible to the math: N ranks with FSDP end where one process without it
// ends, given the same initial parameters and the same global batch.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "gpt.h"
#include "harness/multiprocess.h"
#include "harness/sharding.h"

namespace {

using fsdp_models::GPT;
using fsdp_models::GPTConfig;

constexpr int kSteps = 5;
// AdamW normalises each gradient by its own magnitude, so an element whose gradient is
// rounding noise (a sum that cancels to ~0) moves by a noise-driven amount, and no two
// summation orders agree on it. lr 1e-3 (a usual value) keeps such elements inside 1e-6;
// the key bias, whose gradient is exactly zero in exact arithmetic, is turned off.
constexpr double kAdamLr = 1e-3;
// Adam divides by sqrt(v) + eps: with the default 1e-8, an element whose gradient is ~1e-8
// (cancellation) has its update set by the last bits of that gradient. 1e-6 still leaves real
// gradients (1e-5 and up here) normalised, and bounds the amplification of rounding by 100x.
constexpr double kAdamEps = 1e-6;
// SGD is not scale-invariant: it catches a gradient that is summed instead of averaged,
// which AdamW would hide.
constexpr double kSgdLr = 0.5;
constexpr int64_t kGlobalBatch = 12;  // divisible by 1, 2, 3 and 4 ranks

torch::Tensor batch_tokens(const GPTConfig& cfg, int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  return torch::randint(cfg.vocab_size, {kGlobalBatch, cfg.block_size + 1}, gen,
                        torch::TensorOptions().dtype(torch::kLong));
}

using fsdp::test::expected_shard;

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind,
                                                        std::vector<torch::Tensor> params) {
  if (kind == "adamw") {
    return std::make_unique<torch::optim::AdamW>(
        std::move(params), torch::optim::AdamWOptions(kAdamLr).weight_decay(0.1).eps(kAdamEps));
  }
  return std::make_unique<torch::optim::SGD>(std::move(params),
                                             torch::optim::SGDOptions(kSgdLr).momentum(0.9));
}

GPTConfig test_config() {
  auto cfg = GPTConfig::preset("gpt2-test");
  cfg.attn_bias = false;
  return cfg;
}

// Trains on rows [first, first + count) of each global batch; returns the per-step losses.
std::vector<double> train(GPT& model, torch::optim::Optimizer& opt, const GPTConfig& cfg,
                          int64_t first, int64_t count) {
  std::vector<double> losses;
  for (int step = 0; step < kSteps; ++step) {
    auto tokens = batch_tokens(cfg, step).narrow(0, first, count);
    auto x = tokens.narrow(1, 0, cfg.block_size), y = tokens.narrow(1, 1, cfg.block_size);
    opt.zero_grad();
    auto loss = fsdp_models::lm_loss(fsdp::forward(model, x), y);
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

int check_equivalence(const std::string& optimizer, bool reshard_after_forward = true) {
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), world = pg->size();
  auto cfg = test_config();

  // FSDP_EQUIVALENCE_SEED lets a stress run try many initialisations (the default is fixed).
  const char* seed_var = std::getenv("FSDP_EQUIVALENCE_SEED");
  const int64_t seed = seed_var ? std::atoll(seed_var) : 1234;
  torch::manual_seed(seed);
  GPT reference(cfg);
  // Other ranks start from different values: sync_module_states must make them rank 0's.
  torch::manual_seed(seed + 7 * rank);
  GPT model(cfg);
  fsdp_models::parallelize_gpt(
      model, fsdp::FullyShardOptions(pg).reshard_after_forward(reshard_after_forward));

  const int64_t local = kGlobalBatch / world;
  auto opt = make_optimizer(optimizer, model->parameters());
  pg->comm_stats().reset();
  auto losses = train(model, *opt, cfg, rank * local, local);
  auto ref_opt = make_optimizer(optimizer, reference->parameters());
  auto ref_losses = train(reference, *ref_opt, cfg, 0, kGlobalBatch);

  auto ref_params = reference->named_parameters();
  double max_diff = 0;
  for (const auto& item : model->named_parameters()) {
    auto want = expected_shard(ref_params[item.key()], rank, world);
    WORKER_CHECK(item.value().sizes() == want.sizes())
        << item.key() << " shard " << item.value().sizes() << " vs " << want.sizes();
    WORKER_EXPECT_CLOSE(item.value(), want, 1e-5, 1e-6);
    if (want.numel() > 0) {
      max_diff = std::max(max_diff, (item.value() - want).abs().max().item<double>());
    }
  }
  // Without resharding after forward, blocks stay gathered into backward: one all-gather per
  // unit per step instead of two for the blocks.
  // On one rank there is nothing to gather or scatter: no collective at all.
  const int64_t units = world == 1 ? 0 : cfg.n_layer + 1;
  const int64_t gathers_per_step =
      world == 1 ? 0 : (reshard_after_forward ? 2 * cfg.n_layer + 1 : units);
  WORKER_CHECK(pg->comm_stats().all_gather.calls == kSteps * gathers_per_step)
      << pg->comm_stats().all_gather.calls << " all-gathers in " << kSteps << " steps";
  WORKER_CHECK(pg->comm_stats().reduce_scatter.calls == kSteps * units)
      << pg->comm_stats().reduce_scatter.calls << " reduce-scatters in " << kSteps << " steps";
  // The mean of the ranks' losses is the loss of the global batch.
  auto mean = torch::tensor(losses, torch::kDouble);
  fsdp::all_reduce(*pg, mean, fsdp::ReduceOp::kSum)->wait();
  for (int step = 0; step < kSteps; ++step) {
    const double got = mean[step].item<double>() / world;
    WORKER_CHECK(std::abs(got - ref_losses[step]) <= 1e-5 * std::abs(ref_losses[step]))
        << "step " << step << " loss " << got << " vs reference " << ref_losses[step];
  }
  std::printf(
      "[rank %d/%d] PARAMS OK after %d %s steps: max |fsdp - reference| = %.3g, "
      "loss %.6f -> %.6f\n",
      rank, world, kSteps, optimizer.c_str(), max_diff, ref_losses.front(), ref_losses.back());
  return 0;
}

FSDP_WORKER(gpt_equivalence_adamw) {
  return check_equivalence("adamw");
}
FSDP_WORKER(gpt_equivalence_sgd) {
  return check_equivalence("sgd");
}

// The global gradient norm of the shards equals the single-process norm, and clipping scales
// every shard as clipping the whole model would. CLIP_STRATEGY=no_shard takes the path without
// a collective (every rank's grads are whole and equal): a norm weighed or summed as if
// sharded would be off by the world size.
FSDP_WORKER(clip_grad_norm) {
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), world = pg->size();
  const bool no_shard = ctx.env("CLIP_STRATEGY", "full_shard") == "no_shard";
  auto cfg = test_config();
  torch::manual_seed(99);
  GPT reference(cfg);
  torch::manual_seed(99);
  GPT model(cfg);
  fsdp_models::parallelize_gpt(
      model, fsdp::FullyShardOptions(pg).strategy(no_shard ? fsdp::ShardingStrategy::kNoShard
                                                           : fsdp::ShardingStrategy::kFullShard));
  const int64_t local = kGlobalBatch / world;
  auto tokens = batch_tokens(cfg, 0);
  auto mine = tokens.narrow(0, rank * local, local);
  fsdp_models::lm_loss(fsdp::forward(model, mine.narrow(1, 0, cfg.block_size)),
                       mine.narrow(1, 1, cfg.block_size))
      .backward();
  fsdp_models::lm_loss(reference->forward(tokens.narrow(1, 0, cfg.block_size)),
                       tokens.narrow(1, 1, cfg.block_size))
      .backward();
  const double max_norm = 0.05;
  const double norm = fsdp::clip_grad_norm_(model->parameters(), max_norm, *pg);
  const double ref_norm = torch::nn::utils::clip_grad_norm_(reference->parameters(), max_norm);
  WORKER_CHECK(std::abs(norm - ref_norm) <= 1e-5 * ref_norm) << norm << " vs " << ref_norm;
  WORKER_CHECK(ref_norm > max_norm) << "the test must actually clip: norm " << ref_norm;
  auto ref_params = reference->named_parameters();
  for (const auto& item : model->named_parameters()) {
    auto want = no_shard ? ref_params[item.key()].grad()
                         : expected_shard(ref_params[item.key()].grad(), rank, world);
    WORKER_EXPECT_CLOSE(item.value().grad(), want, 1e-5, 1e-7);
  }
  std::printf("[rank %d/%d] CLIP OK: global norm %.6f (reference %.6f), clipped to %.2f\n", rank,
              world, norm, ref_norm, max_norm);
  return 0;
}

TEST(ClipGradNorm, GlobalNormAndClippedGradsMatchSingleProcess) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("clip_grad_norm", 3));
}

TEST(ClipGradNorm, NoShardNormIsLocalAndMatchesSingleProcess) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("clip_grad_norm", 3,
                                            fsdp::test::with_env({{"CLIP_STRATEGY", "no_shard"}})));
}

class Equivalence : public ::testing::TestWithParam<int> {};

TEST_P(Equivalence, AdamWMatchesSingleProcess) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("gpt_equivalence_adamw", GetParam()));
}

// Gradient accumulation over kMicro micro-batches per rank, with a reduce-scatter after every
// micro-batch (sync) or only after the last (no_sync): both must equal one step on the whole
// global batch, and the traffic must be what each mode promises.
int check_accumulation(const std::string& optimizer, bool no_sync) {
  constexpr int kMicro = 2;
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), world = pg->size();
  auto cfg = test_config();
  torch::manual_seed(4321);
  GPT reference(cfg);
  torch::manual_seed(4321);
  GPT model(cfg);
  fsdp_models::parallelize_gpt(model, fsdp::FullyShardOptions(pg));
  auto opt = make_optimizer(optimizer, model->parameters());
  const int64_t local = kGlobalBatch / world, micro = local / kMicro;
  pg->comm_stats().reset();
  for (int step = 0; step < kSteps; ++step) {
    auto tokens = batch_tokens(cfg, step).narrow(0, rank * local, local);
    opt->zero_grad();
    for (int m = 0; m < kMicro; ++m) {
      if (no_sync)
        fsdp::set_requires_gradient_sync(*model, m == kMicro - 1);
      auto mb = tokens.narrow(0, m * micro, micro);
      // Each micro-batch's mean loss, scaled so that the sum is the mean over the rank's batch.
      auto loss = fsdp_models::lm_loss(fsdp::forward(model, mb.narrow(1, 0, cfg.block_size)),
                                       mb.narrow(1, 1, cfg.block_size)) /
                  kMicro;
      loss.backward();
    }
    opt->step();
  }
  auto ref_opt = make_optimizer(optimizer, reference->parameters());
  train(reference, *ref_opt, cfg, 0, kGlobalBatch);

  const int64_t units = cfg.n_layer + 1;
  const int64_t rs_per_step = no_sync ? units : kMicro * units;
  WORKER_CHECK(pg->comm_stats().reduce_scatter.calls == kSteps * rs_per_step)
      << pg->comm_stats().reduce_scatter.calls << " reduce-scatters in " << kSteps << " steps of "
      << kMicro << " micro-batches";
  auto ref_params = reference->named_parameters();
  double max_diff = 0;
  for (const auto& item : model->named_parameters()) {
    auto want = expected_shard(ref_params[item.key()], rank, world);
    WORKER_EXPECT_CLOSE(item.value(), want, 1e-5, 1e-6);
    if (want.numel() > 0) {
      max_diff = std::max(max_diff, (item.value() - want).abs().max().item<double>());
    }
  }
  std::printf(
      "[rank %d/%d] ACCUMULATION OK (%s, %s): %d micro-batches = one batch, max |fsdp - "
      "reference| = %.3g, %lld reduce-scatters per step\n",
      rank, world, optimizer.c_str(), no_sync ? "no_sync" : "sync every micro-batch", kMicro,
      max_diff, static_cast<long long>(rs_per_step));
  return 0;
}

FSDP_WORKER(accumulation_sync_sgd) {
  return check_accumulation("sgd", false);
}
FSDP_WORKER(accumulation_no_sync_sgd) {
  return check_accumulation("sgd", true);
}
FSDP_WORKER(accumulation_no_sync_adamw) {
  return check_accumulation("adamw", true);
}

TEST(GradientAccumulation, SyncEveryMicroBatchMatchesOneBigBatch) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("accumulation_sync_sgd", 3));
}

TEST(GradientAccumulation, NoSyncMatchesOneBigBatchWithOneReduceScatter) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("accumulation_no_sync_sgd", 3));
  EXPECT_WORKERS_OK(fsdp::test::run_workers("accumulation_no_sync_adamw", 2));
}

// reshard_after_forward(false): parameters stay gathered from forward into backward
// (ZeRO-2-like memory for parameters), with the same math.
FSDP_WORKER(gpt_equivalence_keep_gathered) {
  return check_equivalence("adamw", false);
}

TEST(EquivalenceKeepGathered, AdamWMatchesSingleProcessWorld3) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("gpt_equivalence_keep_gathered", 3));
}

TEST_P(Equivalence, SgdMomentumMatchesSingleProcess) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("gpt_equivalence_sgd", GetParam()));
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Equivalence, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

}  // namespace
