// Mixed precision (MixedPrecisionPolicy): N ranks computing in bf16 over fp32 master shards
// against one process that does, rank by rank, exactly what the policy says: bf16 copies of
// the fp32 master weights, each rank's forward and backward in bf16, the N gradients reduced
// in reduce_dtype with the same operations as the collective (a sum over ranks in rank order,
// then a division by N), added to fp32 grads, AdamW on the fp32 masters. Same operations on
// the same values, so the tolerance is the fp32 one (rtol 1e-5). Also: the all-gather moves
// exactly half the bytes of fp32, the reduce-scatter follows reduce_dtype, the masters stay
// fp32, and a unit in fp32 (the root) composes with bf16 ones.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>

#include "harness/multiprocess.h"
#include "harness/sharding.h"
#include "harness/wire_format.h"

namespace {

constexpr int kSteps = 4;
// 37 and 5 rows: 2 and 3 do not divide. Rows of 24 and 37 values: int8 blocks of 16, 16, 5.
constexpr int64_t kIn = 24, kHidden = 37, kOut = 5;
constexpr int64_t kBlock = 16;

struct NetImpl : torch::nn::Module {
  NetImpl()
      : a(register_module("a", torch::nn::Linear(kIn, kHidden))),
        b(register_module("b", torch::nn::Linear(kHidden, kHidden))),
        head(register_module("head", torch::nn::Linear(kHidden, kOut))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(fsdp::forward(a, x));
    h = torch::tanh(fsdp::forward(b, h));
    return head(h.to(head->weight.scalar_type()));  // the root may compute in another dtype
  }
  torch::nn::Linear a, b, head;
};
TORCH_MODULE(Net);

Net make_net() {
  torch::manual_seed(11);
  return Net();
}

std::pair<torch::Tensor, torch::Tensor> batch(int step, int64_t rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  return {torch::randn({rows, kIn}, gen), torch::randn({rows, kOut}, gen)};
}

torch::ScalarType dtype_named(const std::string& name) {
  if (name == "bf16")
    return torch::kBFloat16;
  if (name == "fp16")
    return torch::kHalf;
  return torch::kFloat;
}

// The reference: one process playing every rank, as the policy prescribes.
std::vector<torch::Tensor> reference_params(int world, int64_t local, torch::ScalarType param,
                                            torch::ScalarType reduce, bool root_fp32,
                                            const std::string& wire) {
  auto master = make_net();
  std::vector<torch::Tensor> masters = master->parameters();
  torch::optim::AdamW opt(masters, torch::optim::AdamWOptions(1e-2));
  const auto names = master->named_parameters().keys();
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step, local * world);
    std::vector<std::vector<torch::Tensor>> grads(masters.size());
    for (int r = 0; r < world; ++r) {
      auto copy = make_net();  // same structure; weights replaced by casts of the masters
      torch::NoGradGuard no_grad;
      auto params = copy->named_parameters();
      for (size_t i = 0; i < masters.size(); ++i) {
        const bool fp32 = root_fp32 && names[i].rfind("head.", 0) == 0;
        params[names[i]].set_data(
            fp32 ? masters[i].detach().clone()
                 : fsdp::test::wire_round(masters[i].detach(), wire, kBlock).to(param));
      }
      torch::AutoGradMode grad_mode(true);
      auto xr = x.narrow(0, r * local, local).to(param);
      auto h = torch::tanh(copy->a(xr));
      h = torch::tanh(copy->b(h));
      auto out = copy->head(h.to(root_fp32 ? torch::kFloat : param)).to(torch::kFloat);
      torch::nn::functional::mse_loss(out, y.narrow(0, r * local, local)).backward();
      for (size_t i = 0; i < masters.size(); ++i)
        grads[i].push_back(params[names[i]].grad().to(
            root_fp32 && names[i].rfind("head.", 0) == 0 ? torch::kFloat : reduce));
    }
    opt.zero_grad();
    for (size_t i = 0; i < masters.size(); ++i) {
      auto g = torch::stack(grads[i]).sum(0);  // the collective's local sum, in rank order
      g.div_(world);
      masters[i].mutable_grad() = g.to(torch::kFloat);
    }
    opt.step();
  }
  return masters;
}

FSDP_WORKER(mixed_precision) {
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), n = pg->size();
  const auto param = dtype_named(ctx.env("PARAM", "bf16"));
  const auto reduce = dtype_named(ctx.env("REDUCE", "fp32"));
  const bool no_shard = ctx.env("STRATEGY") == "no_shard";
  const bool root_fp32 = ctx.env("ROOT") == "fp32";
  const std::string wire = ctx.env("WIRE");
  const int64_t local = 4;
  auto policy = fsdp::MixedPrecisionPolicy().param_dtype(param).reduce_dtype(reduce);
  if (wire == "bf16")
    policy.gather_format(fsdp::GatherFormat::kBFloat16);
  if (wire == "int8")
    policy.gather_format(fsdp::GatherFormat::kInt8).int8_block_size(kBlock);

  auto run = [&](bool mixed, fsdp::CommStats* traffic) {
    auto net = make_net();
    fsdp::FullyShardOptions opts(pg);
    opts.strategy(no_shard ? fsdp::ShardingStrategy::kNoShard : fsdp::ShardingStrategy::kFullShard);
    if (mixed)
      opts.mp_policy(policy);
    fsdp::fully_shard(net->a, opts);
    fsdp::fully_shard(net->b, opts);
    auto root_opts = opts;
    if (mixed)
      root_opts.mp_policy(root_fp32
                              ? fsdp::MixedPrecisionPolicy()
                              : fsdp::MixedPrecisionPolicy(policy).output_dtype(torch::kFloat));
    fsdp::fully_shard(net, root_opts);
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step, local * n);
      opt.zero_grad();
      const auto before = fsdp::comm_stats(*net);
      auto out = fsdp::forward(net, x.narrow(0, rank * local, local));
      WORKER_CHECK(out.scalar_type() == torch::kFloat) << out.scalar_type();
      torch::nn::functional::mse_loss(out, y.narrow(0, rank * local, local)).backward();
      if (step == 0 && traffic)
        *traffic = fsdp::comm_stats(*net) - before;
      opt.step();
    }
    return net;
  };

  fsdp::CommStats fp32_traffic, mixed_traffic;
  run(false, &fp32_traffic);
  auto net = run(true, &mixed_traffic);

  // The masters stay fp32 and get fp32 grads.
  for (const auto& p : net->parameters()) {
    WORKER_CHECK(p.scalar_type() == torch::kFloat && p.grad().scalar_type() == torch::kFloat)
        << p.scalar_type() << " " << p.grad().scalar_type();
  }
  auto expected = reference_params(n, local, param, reduce, root_fp32, wire);
  auto got = net->parameters();
  double max_diff = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    auto want = no_shard ? expected[i] : fsdp::test::expected_shard(expected[i], rank, n);
    WORKER_EXPECT_CLOSE(got[i], want, 1e-5, 1e-6);
    if (want.numel() > 0)
      max_diff = std::max(max_diff, (got[i] - want).abs().max().item<double>());
  }

  // Traffic: the bf16 units gather half the bytes; reductions follow reduce_dtype. (With an
  // fp32 root only the blocks' share halves: checked through the all-gathers' exact sizes.)
  const int64_t elem = torch::elementSize(param), relem = torch::elementSize(reduce);
  if (!no_shard && !wire.empty()) {
    // Exact sizes: per gather of a unit, every rank's piece of every parameter in the format
    // (int8: 4 bytes per row and block plus a byte per value, padded to 4; bf16 for narrow
    // rows). Blocks a and b gather twice a step (forward, backward), the root once.
    auto unit_bytes = [&](torch::nn::Module& m, bool encoded) {
      int64_t bytes = 0;
      for (const auto& p : m.parameters(/*recurse=*/false)) {
        const int64_t rows = p.size(0), width = p.numel() / rows, chunk = (rows + n - 1) / n;
        int64_t piece = chunk * width * 4;
        if (encoded && wire == "int8" && width >= 16)
          piece = (chunk * (width + 4 * ((width + kBlock - 1) / kBlock)) + 3) / 4 * 4;
        else if (encoded)
          piece = chunk * width * 2;
        bytes += n * piece;
      }
      return bytes;
    };
    auto shape = make_net();
    const auto total = [&](bool encoded) {
      return 2 * (unit_bytes(*shape->a, encoded) + unit_bytes(*shape->b, encoded)) +
             unit_bytes(*shape->head, encoded);
    };
    WORKER_CHECK(fp32_traffic.all_gather.bytes == total(false))
        << fp32_traffic.all_gather.bytes << " vs " << total(false);
    WORKER_CHECK(mixed_traffic.all_gather.bytes == total(true))
        << mixed_traffic.all_gather.bytes << " vs " << total(true);
    WORKER_CHECK(mixed_traffic.reduce_scatter.bytes * 4 ==
                 fp32_traffic.reduce_scatter.bytes * relem);
  } else if (!no_shard && !root_fp32) {
    WORKER_CHECK(mixed_traffic.all_gather.bytes * 4 == fp32_traffic.all_gather.bytes * elem)
        << mixed_traffic.all_gather.bytes << " vs fp32 " << fp32_traffic.all_gather.bytes;
    WORKER_CHECK(mixed_traffic.reduce_scatter.bytes * 4 ==
                 fp32_traffic.reduce_scatter.bytes * relem)
        << mixed_traffic.reduce_scatter.bytes << " vs fp32 " << fp32_traffic.reduce_scatter.bytes;
  }
  if (no_shard) {
    WORKER_CHECK(mixed_traffic.all_gather.calls == 0 &&
                 mixed_traffic.all_reduce.bytes * 4 == fp32_traffic.all_reduce.bytes * relem)
        << mixed_traffic.all_reduce.bytes << " vs fp32 " << fp32_traffic.all_reduce.bytes;
  }
  std::printf(
      "[rank %d] MIXED PRECISION OK: param %s reduce %s%s%s%s, max |fsdp - policy| %.2g, gathered "
      "%lld B (fp32 %lld B), reduced %lld B (fp32 %lld B)\n",
      rank, c10::toString(param), c10::toString(reduce),
      wire.empty() ? "" : (", gather " + wire).c_str(), no_shard ? ", no_shard" : "",
      root_fp32 ? ", fp32 root" : "", max_diff, (long long)mixed_traffic.all_gather.bytes,
      (long long)fp32_traffic.all_gather.bytes,
      (long long)(mixed_traffic.reduce_scatter.bytes + mixed_traffic.all_reduce.bytes),
      (long long)(fp32_traffic.reduce_scatter.bytes + fp32_traffic.all_reduce.bytes));
  return 0;
}

fsdp::test::RunOptions env(std::vector<std::pair<std::string, std::string>> vars) {
  fsdp::test::RunOptions o;
  o.env = std::move(vars);
  return o;
}

TEST(MixedPrecision, Bf16ComputeFp32ReduceEqualsThePolicyInOneProcess) {
  for (int world : {2, 3})
    EXPECT_WORKERS_OK(fsdp::test::run_workers("mixed_precision", world,
                                              env({{"PARAM", "bf16"}, {"REDUCE", "fp32"}})));
}

TEST(MixedPrecision, Bf16ReduceHalvesTheReduceScatter) {
  EXPECT_WORKERS_OK(
      fsdp::test::run_workers("mixed_precision", 3, env({{"PARAM", "bf16"}, {"REDUCE", "bf16"}})));
}

TEST(MixedPrecision, Fp16ComputeAndAnFp32Root) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers(
      "mixed_precision", 2, env({{"PARAM", "fp16"}, {"REDUCE", "fp32"}, {"ROOT", "fp32"}})));
}

TEST(MixedPrecision, NoShardCastsLocallyAndAllReducesInReduceDtype) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers(
      "mixed_precision", 2,
      env({{"PARAM", "bf16"}, {"REDUCE", "bf16"}, {"STRATEGY", "no_shard"}})));
}

TEST(MixedPrecision, Fp32ComputeOverABf16GatherAndBf16Reduce) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers(
      "mixed_precision", 2, env({{"PARAM", "fp32"}, {"REDUCE", "bf16"}, {"WIRE", "bf16"}})));
}

TEST(MixedPrecision, Fp32ComputeOverAnInt8Gather) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers(
      "mixed_precision", 2, env({{"PARAM", "fp32"}, {"REDUCE", "fp32"}, {"WIRE", "int8"}})));
  EXPECT_WORKERS_OK(fsdp::test::run_workers(
      "mixed_precision", 3, env({{"PARAM", "fp32"}, {"REDUCE", "bf16"}, {"WIRE", "int8"}})));
}

TEST(MixedPrecision, Bf16ComputeOverAnInt8Gather) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers(
      "mixed_precision", 3, env({{"PARAM", "bf16"}, {"REDUCE", "fp32"}, {"WIRE", "int8"}})));
}

TEST(MixedPrecision, NoShardRoundsThroughTheGatherFormatLocally) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers(
      "mixed_precision", 2,
      env({{"PARAM", "fp32"}, {"REDUCE", "fp32"}, {"WIRE", "int8"}, {"STRATEGY", "no_shard"}})));
}

}  // namespace
