// What helps users: fsdp::unshard for generation, the collective-sequence debug mode, the
// warning for blocks sharded without their model, and the errors fully_shard and
// fsdp::forward give for what they cannot do.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>

#include <c10/util/Exception.h>

#include "engine/param_group.h"
#include "engine/registry.h"
#include "gpt.h"
#include "harness/errors.h"
#include "harness/inspect.h"
#include "harness/multiprocess.h"

namespace {

using fsdp::test::error_of;
using fsdp::test::model_is_sharded;
using fsdp_models::GPT;
using fsdp_models::GPTConfig;

// Greedy decoding: every rank runs the same forwards (they must: each gathers from all).
std::vector<int64_t> generate(GPT& model, const GPTConfig& cfg, int tokens,
                              std::vector<int64_t>& gathers_per_token, fsdp::ProcessGroup& pg) {
  torch::NoGradGuard no_grad;
  std::vector<int64_t> ids{1, 2, 3};
  for (int t = 0; t < tokens; ++t) {
    const int64_t before = pg.comm_stats().all_gather.calls;
    const int64_t n = std::min<int64_t>(cfg.block_size, static_cast<int64_t>(ids.size()));
    auto input = torch::tensor(std::vector<int64_t>(ids.end() - n, ids.end())).unsqueeze(0);
    auto logits = fsdp::forward(model, input).select(1, n - 1).squeeze(0);
    ids.push_back(logits.argmax().item<int64_t>());
    gathers_per_token.push_back(pg.comm_stats().all_gather.calls - before);
  }
  return ids;
}

FSDP_WORKER(generate_unsharded) {
  auto pg = fsdp::init_process_group();
  auto cfg = GPTConfig::preset("gpt2-test");
  torch::manual_seed(8);
  GPT model(cfg);
  fsdp_models::parallelize_gpt(model, fsdp::FullyShardOptions(pg));
  const int64_t units = static_cast<int64_t>(fsdp::detail::units_under(*model).size());
  constexpr int kTokens = 12;

  std::vector<int64_t> per_token_plain, per_token_held;
  auto plain = generate(model, cfg, kTokens, per_token_plain, *pg);
  int64_t unshard_gathers = 0;
  std::vector<int64_t> held;
  {
    const int64_t before = pg->comm_stats().all_gather.calls;
    fsdp::UnshardGuard gathered(model);
    unshard_gathers = pg->comm_stats().all_gather.calls - before;
    held = generate(model, cfg, kTokens, per_token_held, *pg);
  }
  WORKER_CHECK(model_is_sharded(*model)) << "still gathered after the UnshardGuard";
  WORKER_CHECK(plain == held) << "generation differs with the model held unsharded";
  for (int t = 0; t < kTokens; ++t) {
    WORKER_CHECK(per_token_plain[t] == units) << "token " << t << ": " << per_token_plain[t];
    WORKER_CHECK(per_token_held[t] == 0) << "token " << t << ": " << per_token_held[t];
  }
  WORKER_CHECK(unshard_gathers == units) << unshard_gathers << " gathers to unshard";
  // Training through units held by unshard is refused, with a clear message.
  fsdp::unshard(model);
  try {
    fsdp::forward(model, torch::tensor(std::vector<int64_t>{1, 2}).unsqueeze(0));
    WORKER_CHECK(false) << "a grad-mode forward of an unsharded model did not throw";
  } catch (const c10::Error& e) {
    WORKER_CHECK(std::string(e.what()).find("fsdp::reshard") != std::string::npos) << e.what();
  }
  fsdp::reshard(model);
  WORKER_CHECK(model_is_sharded(*model)) << "still gathered after fsdp::reshard";
  std::printf(
      "[rank %d] UNSHARD OK: %d greedy tokens identical; all-gathers per token %lld -> 0 (one "
      "gather of each of %lld units up front)\n",
      pg->rank(), kTokens, (long long)units, (long long)units);
  return 0;
}

TEST(Unshard, GenerationGathersOnceInsteadOfPerToken) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("generate_unsharded", 2));
}

// ---- Collective-sequence check ------------------------------------------------------------------

FSDP_WORKER(collective_check) {
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank();
  WORKER_CHECK(pg->checks_collectives()) << "FSDP_CHECK_COLLECTIVES was not picked up";
  auto cfg = GPTConfig::preset("gpt2-test");
  cfg.n_layer = 2;
  torch::manual_seed(9);
  GPT model(cfg);
  fsdp_models::parallelize_gpt(model, fsdp::FullyShardOptions(pg));
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  auto idx = torch::randint(cfg.vocab_size, {2, 9}, torch::TensorOptions().dtype(torch::kLong));
  auto train_step = [&] {
    opt.zero_grad();
    fsdp_models::lm_loss(fsdp::forward(model, idx.narrow(1, 0, 8)), idx.narrow(1, 1, 8)).backward();
    opt.step();
  };
  train_step();  // identical sequences: no complaint
  // A rank-dependent call: rank 1 alone gathers block 1.
  try {
    if (rank == 1)
      fsdp::unshard(*model->blocks[1]);
    train_step();
    WORKER_CHECK(false) << "the divergence was not detected";
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    WORKER_CHECK(msg.find("collective check") != std::string::npos &&
                 msg.find("rank 1 'all-gather") != std::string::npos &&
                 msg.find("unit 'h1'") != std::string::npos &&
                 msg.find("ranks 0,2 'all-gather") != std::string::npos)
        << "unhelpful message: " << msg;
    std::printf("[rank %d] CHECK OK: %s\n", rank, msg.c_str());
  }
  return 0;
}

TEST(CollectiveCheck, NamesTheRankAndCollectiveThatDiverge) {
  fsdp::test::RunOptions opts;
  opts.env = {{"FSDP_CHECK_COLLECTIVES", "1"}};
  opts.timeout = std::chrono::seconds(60);
  EXPECT_WORKERS_OK(fsdp::test::run_workers("collective_check", 3, opts));
}

// ---- Warnings and errors ------------------------------------------------------------------------

struct CapturingHandler : c10::WarningHandler {
  void process(const c10::Warning& w) override { messages.push_back(w.msg()); }
  std::vector<std::string> messages;
};

int count_containing(const std::vector<std::string>& messages, const std::string& text) {
  return static_cast<int>(std::count_if(messages.begin(), messages.end(), [&](const auto& m) {
    return m.find(text) != std::string::npos;
  }));
}

FSDP_WORKER(root_not_sharded_warning) {
  auto pg = fsdp::init_process_group();
  auto cfg = GPTConfig::preset("gpt2-test");
  auto idx = torch::randint(cfg.vocab_size, {2, 9}, torch::TensorOptions().dtype(torch::kLong));
  auto run = [&](bool shard_root) {
    CapturingHandler handler;
    c10::WarningUtils::WarningHandlerGuard guard(&handler);
    torch::manual_seed(10);
    GPT model(cfg);
    for (auto& b : model->blocks)
      fsdp::fully_shard(b, fsdp::FullyShardOptions(pg));
    if (shard_root)
      fsdp::fully_shard(model, fsdp::FullyShardOptions(pg));
    for (int i = 0; i < 2; ++i) {
      fsdp_models::lm_loss(fsdp::forward(model, idx.narrow(1, 0, 8)), idx.narrow(1, 1, 8))
          .backward();
    }
    return count_containing(handler.messages, "call fully_shard on the model as well");
  };
  const int without_root = run(false), with_root = run(true);
  WORKER_CHECK(without_root == 1) << without_root << " warnings with the model not sharded";
  WORKER_CHECK(with_root == 0) << with_root << " warnings with the model sharded";
  std::printf("[rank %d] WARNING OK: blocks without their model warn once, a sharded model not\n",
              pg->rank());
  return 0;
}

TEST(Checks, WarnsWhenBlocksAreShardedButNotTheModel) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("root_not_sharded_warning", 2));
}

struct TwoLinearImpl : torch::nn::Module {
  TwoLinearImpl()
      : a(register_module("a", torch::nn::Linear(4, 4))),
        b(register_module("b", torch::nn::Linear(4, 4))) {}
  torch::Tensor forward(const torch::Tensor& x, torch::Tensor& cache) {
    cache = x.detach();
    return b(a(x));
  }
  torch::nn::Linear a, b;
};
TORCH_MODULE(TwoLinear);

FSDP_WORKER(user_errors) {
  auto pg = fsdp::init_process_group();
  // Top-down: the model first, then a block inside it.
  {
    TwoLinear m;
    fsdp::fully_shard(m, fsdp::FullyShardOptions(pg));
    auto msg = error_of([&] { fsdp::fully_shard(m->a, fsdp::FullyShardOptions(pg)); });
    WORKER_CHECK(msg.find("bottom-up") != std::string::npos) << "top-down: '" << msg << "'";
  }
  // Trainable parameters of two dtypes in one unit: rejected when sharding, not at backward.
  {
    TwoLinear m;
    m->b->to(torch::kDouble);
    auto msg = error_of([&] { fsdp::fully_shard(m, fsdp::FullyShardOptions(pg)); });
    WORKER_CHECK(msg.find("different dtypes") != std::string::npos &&
                 msg.find("a.weight") != std::string::npos)
        << "mixed dtypes: '" << msg << "'";
    m->b->weight.set_requires_grad(false);
    m->b->bias.set_requires_grad(false);
    fsdp::fully_shard(m, fsdp::FullyShardOptions(pg));  // frozen ones may differ
  }
  // Units inside a torch::nn::Sequential: its forward would bypass fsdp::forward.
  {
    torch::nn::Sequential seq(torch::nn::Linear(4, 4), torch::nn::ReLU(), torch::nn::Linear(4, 4));
    fsdp::fully_shard(seq[0], fsdp::FullyShardOptions(pg));
    auto msg = error_of([&] { fsdp::fully_shard(seq, fsdp::FullyShardOptions(pg)); });
    WORKER_CHECK(msg.find("torch::nn::Sequential") != std::string::npos &&
                 msg.find("fsdp::forward(child") != std::string::npos)
        << "Sequential: '" << msg << "'";
    torch::nn::Sequential whole(torch::nn::Linear(4, 4), torch::nn::ReLU());
    fsdp::fully_shard(whole, fsdp::FullyShardOptions(pg));  // one unit: fine
    fsdp::forward(whole, torch::randn({2, 4})).sum().backward();
  }
  // A by-reference argument (std::ref) passes through, and is refused when it would carry a
  // gradient around the unit's hooks.
  {
    TwoLinear m;
    fsdp::fully_shard(m, fsdp::FullyShardOptions(pg));
    torch::Tensor cache = torch::zeros({1});
    auto x = torch::randn({2, 4});
    fsdp::forward(m, x, std::ref(cache)).sum().backward();
    WORKER_CHECK(cache.sizes() == x.sizes()) << "the callee's write through std::ref was lost";
    torch::Tensor needs_grad = torch::zeros({1}, torch::requires_grad());
    auto msg = error_of([&] { fsdp::forward(m, x, std::ref(needs_grad)); });
    WORKER_CHECK(msg.find("std::ref") != std::string::npos) << "std::ref: '" << msg << "'";
    WORKER_CHECK(model_is_sharded(*m)) << "a refused forward left the unit gathered";
  }
  std::printf(
      "[rank %d] ERRORS OK: top-down sharding, mixed trainable dtypes, units in a "
      "Sequential, std::ref\n",
      pg->rank());
  return 0;
}

TEST(Checks, UserErrorsAreNamed) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("user_errors", 2));
}

}  // namespace
