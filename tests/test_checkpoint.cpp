// Activation checkpointing (fsdp/activation_checkpoint.h), composed with sharding.
//
// A small transformer (attention through at::scaled_dot_product_attention, dropout, GELU MLP,
// residuals) trained 5 AdamW steps with checkpointing on and off on 1, 2 and 3 ranks: the
// parameters must be bitwise equal. The recomputation runs the same kernels on the same values
// (dropout draws the same mask from the replayed generator state), and its backward runs the
// same formulas as the unchecked backward, so there is nothing to round differently. Per step,
// the all-gathers must not change (2 per block under full_shard, 1 under shard_grad_op: the
// recomputation uses the gather of the unit's backward), and the bytes alive between forward and
// backward must drop (full < selective < none).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>

#include "engine/saved_ops.h"
#include "harness/errors.h"
#include "harness/multiprocess.h"

namespace {

constexpr int64_t kVocab = 37, kDim = 24, kHeads = 2, kSeq = 10, kBlocks = 3, kBatch = 3;
constexpr int kSteps = 5;

struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
        qkv(register_module("qkv", torch::nn::Linear(kDim, 3 * kDim))),
        proj(register_module("proj", torch::nn::Linear(kDim, kDim))),
        fc(register_module("fc", torch::nn::Linear(kDim, 3 * kDim))),
        out(register_module("out", torch::nn::Linear(3 * kDim, kDim))),
        drop(register_module("drop", torch::nn::Dropout(0.2))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto parts = qkv(ln(x))
                     .view({x.size(0), x.size(1), 3, kHeads, kDim / kHeads})
                     .permute({2, 0, 3, 1, 4})
                     .unbind(0);
    auto a = at::scaled_dot_product_attention(parts[0], parts[1], parts[2], {}, 0.0, true);
    auto h = x + drop(proj(a.transpose(1, 2).reshape({x.size(0), x.size(1), kDim})));
    // relu_ changes a matmul output in place: selective checkpointing must notice.
    return h + drop(out(torch::gelu(fc(h)).relu_()));
  }
  torch::nn::LayerNorm ln;
  torch::nn::Linear qkv, proj, fc, out;
  torch::nn::Dropout drop;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl()
      : emb(register_module("emb", torch::nn::Embedding(kVocab, kDim))),
        head(register_module("head", torch::nn::Linear(kDim, kVocab))) {
    for (int i = 0; i < kBlocks; ++i) {
      std::string name = "b";  // appended: GCC 12 reports a false -Wrestrict on "b" + string
      name.append(std::to_string(i));
      blocks.push_back(register_module(name, Block()));
    }
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    auto x = emb(tokens);
    for (auto& b : blocks)
      x = fsdp::forward(b, x);
    return head(x);
  }
  torch::nn::Embedding emb;
  torch::nn::Linear head;
  std::vector<Block> blocks;
};
TORCH_MODULE(Net);

fsdp::CheckpointMode mode_named(const std::string& s) {
  if (s == "full")
    return fsdp::CheckpointMode::kFull;
  if (s == "selective")
    return fsdp::CheckpointMode::kSelective;
  return fsdp::CheckpointMode::kNone;
}

struct RunResult {
  std::vector<torch::Tensor> params;
  std::vector<int64_t> gathers;     // per step
  int64_t alive_after_forward = 0;  // bytes, step 0
};

RunResult train(const std::shared_ptr<fsdp::ProcessGroup>& pg, fsdp::CheckpointMode mode, int every,
                fsdp::ShardingStrategy strategy) {
  torch::manual_seed(5);
  Net net;
  net->train();
  for (int i = 0; i < kBlocks; ++i) {
    fsdp::FullyShardOptions opts(pg);
    opts.strategy(strategy);
    if (i % every == 0)
      opts.activation_checkpointing(mode);
    fsdp::fully_shard(net->blocks[i], opts);
  }
  fsdp::fully_shard(net, fsdp::FullyShardOptions(pg).strategy(strategy));
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
  RunResult r;
  const int rank = pg->rank(), n = pg->size();
  for (int step = 0; step < kSteps; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(40 + step);
    auto tokens =
        torch::randint(kVocab, {kBatch * n, kSeq + 1}, gen).narrow(0, kBatch * rank, kBatch);
    // Dropout draws from the default generator: the same stream in every run.
    torch::manual_seed(1000 + step * 10 + rank);
    opt.zero_grad();
    pg->comm_stats().reset();
    const int64_t before = fsdp::memory::current_bytes();
    auto logits = fsdp::forward(net, tokens.narrow(1, 0, kSeq));
    auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}),
                                                     tokens.narrow(1, 1, kSeq).reshape({-1}));
    if (step == 0)
      r.alive_after_forward = fsdp::memory::current_bytes() - before;
    loss.backward();
    opt.step();
    r.gathers.push_back(pg->comm_stats().all_gather.calls);
  }
  for (const auto& p : net->parameters())
    r.params.push_back(p.detach().clone());
  return r;
}

FSDP_WORKER(checkpoint_equal) {
  fsdp::memory::install_tracking_allocator();
  auto pg = fsdp::init_process_group();
  const auto mode = mode_named(ctx.env("MODE", "full"));
  const int every = static_cast<int>(ctx.env_int("EVERY", 1));
  const auto strategy = ctx.env("STRATEGY") == "shard_grad_op"
                            ? fsdp::ShardingStrategy::kShardGradOp
                            : fsdp::ShardingStrategy::kFullShard;
  auto off = train(pg, fsdp::CheckpointMode::kNone, 1, strategy);
  auto on = train(pg, mode, every, strategy);
  double max_diff = 0;
  for (size_t i = 0; i < on.params.size(); ++i) {
    if (on.params[i].numel() == 0)
      continue;
    max_diff = std::max(max_diff, (on.params[i] - off.params[i]).abs().max().item<double>());
    WORKER_CHECK(torch::equal(on.params[i], off.params[i]))
        << "param " << i << " differs: max " << (on.params[i] - off.params[i]).abs().max();
  }
  // Gathers per step: blocks twice (full_shard) or once (shard_grad_op), the root once; a
  // group of one rank gathers nothing.
  const int64_t per_block = strategy == fsdp::ShardingStrategy::kFullShard ? 2 : 1;
  const int64_t want = ctx.world_size == 1 ? 0 : kBlocks * per_block + 1;
  for (int step = 0; step < kSteps; ++step) {
    WORKER_CHECK(on.gathers[step] == off.gathers[step] && on.gathers[step] == want)
        << "step " << step << ": " << on.gathers[step] << " all-gathers with checkpointing, "
        << off.gathers[step] << " without";
  }
  WORKER_CHECK(on.alive_after_forward < off.alive_after_forward)
      << on.alive_after_forward << " B alive after forward with checkpointing, "
      << off.alive_after_forward << " without";
  std::printf(
      "[rank %d] CHECKPOINT OK: %s every %d, %s, %d ranks: params bitwise equal (max diff %g), "
      "%lld all-gathers per step either way, alive after forward %lld B vs %lld B\n",
      ctx.rank, fsdp::to_string(mode), every, fsdp::to_string(strategy), ctx.world_size, max_diff,
      (long long)on.gathers[0], (long long)on.alive_after_forward,
      (long long)off.alive_after_forward);
  return 0;
}

fsdp::test::RunOptions env(std::vector<std::pair<std::string, std::string>> vars) {
  fsdp::test::RunOptions o;
  o.env = std::move(vars);
  return o;
}

TEST(Checkpoint, FullEqualsNoCheckpointingOnOneTwoThreeRanks) {
  for (int world : {1, 2, 3})
    EXPECT_WORKERS_OK(fsdp::test::run_workers("checkpoint_equal", world, env({{"MODE", "full"}})));
}

TEST(Checkpoint, SelectiveEqualsNoCheckpointing) {
  for (int world : {1, 3}) {
    EXPECT_WORKERS_OK(
        fsdp::test::run_workers("checkpoint_equal", world, env({{"MODE", "selective"}})));
  }
}

TEST(Checkpoint, EverySecondBlockUnderShardGradOp) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers(
      "checkpoint_equal", 2,
      env({{"MODE", "full"}, {"EVERY", "2"}, {"STRATEGY", "shard_grad_op"}})));
}

// Single process: the memory kept by each mode, ordered; the caller's random stream untouched.
TEST(Checkpoint, FunctionKeepsLessAndLeavesTheRandomStreamAlone) {
  fsdp::memory::install_tracking_allocator();
  torch::manual_seed(0);
  torch::nn::Linear a(64, 256), b(256, 64);
  auto x = torch::randn({128, 64}, torch::requires_grad());
  auto region = [&](const std::vector<torch::Tensor>& in) -> std::vector<torch::Tensor> {
    auto h = torch::dropout(torch::tanh(a(in[0])), 0.3, true);
    return {b(torch::sigmoid(h) * h)};
  };
  std::vector<torch::Tensor> grads;
  std::vector<int64_t> kept;
  std::vector<double> next_draw;
  for (auto mode : {fsdp::CheckpointMode::kNone, fsdp::CheckpointMode::kSelective,
                    fsdp::CheckpointMode::kFull}) {
    a->zero_grad();
    b->zero_grad();
    x.mutable_grad() = torch::Tensor();
    torch::manual_seed(7);
    const int64_t before = fsdp::memory::current_bytes();
    auto y = fsdp::checkpoint(region, {x}, mode)[0];
    kept.push_back(fsdp::memory::current_bytes() - before);
    y.square().sum().backward();
    next_draw.push_back(torch::rand({1}).item<double>());
    grads.push_back(torch::cat({x.grad().flatten(), a->weight.grad().flatten(),
                                b->weight.grad().flatten(), b->bias.grad().flatten()}));
  }
  EXPECT_TRUE(torch::equal(grads[0], grads[1])) << (grads[0] - grads[1]).abs().max();
  EXPECT_TRUE(torch::equal(grads[0], grads[2])) << (grads[0] - grads[2]).abs().max();
  EXPECT_EQ(next_draw[0], next_draw[1]);
  EXPECT_EQ(next_draw[0], next_draw[2]);
  EXPECT_GT(kept[0], kept[1]) << "selective kept " << kept[1] << " B, none " << kept[0];
  EXPECT_GT(kept[1], kept[2]) << "full kept " << kept[2] << " B, selective " << kept[1];
  std::printf("kept between forward and backward: none %lld B, selective %lld B, full %lld B\n",
              (long long)kept[0], (long long)kept[1], (long long)kept[2]);
}

TEST(Checkpoint, InputChangedInPlaceBeforeBackwardIsAnError) {
  torch::nn::Linear a(4, 4);
  auto x = torch::randn({2, 4});
  auto y = fsdp::checkpoint(
      [&](const std::vector<torch::Tensor>& in) -> std::vector<torch::Tensor> {
        return {a(in[0])};
      },
      {x})[0];
  x.add_(1);
  auto msg = fsdp::test::error_of([&] { y.sum().backward(); });
  EXPECT_NE(msg.find("modified in place after the region's forward"), std::string::npos) << msg;
}

// The op cache's dispatch key must not change how any other op computes: CustomRNGKeyId
// counts as a backend for composite kernels, and native_layer_norm's generic kernel rounds
// differently from the CPU one (found by this test).
TEST(Checkpoint, OpsOutsideTheCacheComputeAsUsualInsideASelectiveRegion) {
  torch::manual_seed(0);
  Block b;
  auto x = torch::randn({3, kSeq, kDim});
  auto q = torch::randn({3, 2, kSeq, 12});
  std::vector<std::pair<std::string, std::function<torch::Tensor()>>> ops = {
      {"layer_norm", [&] { return b->ln(x); }},
      {"linear", [&] { return b->qkv(x); }},
      {"sdpa", [&] { return at::scaled_dot_product_attention(q, q * 2, q * 3, {}, 0.0, true); }},
      {"gelu", [&] { return torch::gelu(x); }},
      {"softmax", [&] { return torch::softmax(x, -1); }},
  };
  fsdp::detail::SavedOps cache;
  for (auto& [name, op] : ops) {
    auto outside = op();
    torch::Tensor inside;
    {
      fsdp::detail::SavedOps::Scope scope(&cache, /*record=*/true);
      inside = op();
    }
    EXPECT_TRUE(torch::equal(outside, inside)) << name << ": " << (outside - inside).abs().max();
  }
}

}  // namespace
