// The CUDA path: the collectives layer against values computed on the CPU, a FULL_SHARD run
// (with clipping, with and without CPU offload) against one CPU process, and deferred
// initialisation straight onto the device against an eager CPU build.
//
// Each runs over two process-group kinds:
//  - NCCL, one rank per GPU (world size = the visible GPUs, at most 2; 1 on a one-GPU machine,
//    where NCCL still runs every collective on its own stream);
//  - Gloo carrying CUDA tensors (ProcessGroupOptions::gloo_device), 3 ranks sharing GPU 0:
//    world sizes that divide none of the tensors, on one GPU (NCCL refuses two ranks on one
//    device).
// "Slow" variants put a ~10 ms GPU sleep before every layer's forward and backward, so the
// device runs far behind the host: a missing wait (a gathered buffer read or freed before its
// collective is done, a device-to-host copy read before it lands) then reads wrong values and
// the comparison with the CPU fails.
//
// Our CPU machines have no GPU: every test here GTest-skips there. scripts/gpu_check.sh runs
// them on a GPU (docs/gpu.md has the results).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAFunctions.h>

#include <fsdp/distributed/cuda.h>
#include <fsdp/fsdp.h>
#include <fsdp/optim/fused_optimizer.h>
#include <fsdp/optim/torch_fused_adamw.h>

#include <fsdp/distributed/collectives.h>
#include "gpt.h"
#include "harness/multiprocess.h"
#include "harness/sharding.h"

namespace {

using fsdp::ReduceOp;

// BACKEND=gloo_cuda: Gloo with CUDA tensors, every rank on GPU 0; else NCCL on GPU LOCAL_RANK.
bool on_gloo_cuda(const fsdp::test::WorkerContext& ctx) {
  return ctx.env("BACKEND") == "gloo_cuda";
}

torch::Device this_device(const fsdp::test::WorkerContext& ctx) {
  const int local = fsdp::launch_env_from_environment().local_rank;
  return {torch::kCUDA, static_cast<c10::DeviceIndex>(on_gloo_cuda(ctx) ? 0 : local)};
}

std::shared_ptr<fsdp::ProcessGroup> cuda_group(const fsdp::test::WorkerContext& ctx) {
  // Exact fp32 matmuls on both sides of every comparison.
  at::globalContext().setAllowTF32CuBLAS(false);
  at::globalContext().setAllowTF32CuDNN(false);
  c10::cuda::set_device(this_device(ctx).index());
  if (on_gloo_cuda(ctx)) {
    return fsdp::init_process_group(fsdp::ProcessGroupOptions().gloo_device(c10::kCUDA));
  }
  fsdp::register_nccl_backend();
  return fsdp::init_process_group(fsdp::ProcessGroupOptions().backend("nccl"));
}

// Identity whose forward and backward first keep the GPU busy for `cycles` clock cycles.
struct GpuSleep : torch::autograd::Function<GpuSleep> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               int64_t cycles) {
    ctx->saved_data["cycles"] = cycles;
    at::cuda::sleep(cycles);
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    at::cuda::sleep(ctx->saved_data["cycles"].toInt());
    return {grads[0].clone(), torch::Tensor()};
  }
};

// ~10 ms at the H100's 1.98 GHz boost clock: far longer than any collective of these tests.
constexpr int64_t kSleepCycles = 20'000'000;

FSDP_WORKER(cuda_collectives) {
  auto pg = cuda_group(ctx);
  const int rank = pg->rank(), n = pg->size();
  const auto dev = this_device(ctx);
  WORKER_CHECK(pg->device_type() == c10::kCUDA) << c10::DeviceTypeName(pg->device_type());

  // All-gather of pieces of three dtypes (they move as bytes, in one collective).
  const std::vector<int64_t> sizes{5, 7, 1};
  const std::vector<torch::ScalarType> dtypes{torch::kFloat, torch::kDouble, torch::kBFloat16};
  auto piece = [](int r, int i, int64_t len, torch::ScalarType dt) {
    return (torch::arange(len, torch::kFloat) + 1000 * r + 100 * i).to(dt);
  };
  std::vector<torch::Tensor> inputs, outputs;
  for (int i = 0; i < 3; ++i) {
    inputs.push_back(piece(rank, i, sizes[i], dtypes[i]).to(dev));
    outputs.push_back(torch::full({n * sizes[i]}, -1, torch::TensorOptions(dtypes[i]).device(dev)));
  }
  fsdp::all_gather(*pg, inputs, outputs)->wait();
  for (int i = 0; i < 3; ++i) {
    for (int r = 0; r < n; ++r) {
      auto got = outputs[i].narrow(0, r * sizes[i], sizes[i]).cpu();
      WORKER_CHECK(torch::equal(got, piece(r, i, sizes[i], dtypes[i])))
          << "piece " << i << " from rank " << r << ": " << got;
    }
  }

  // Reduce-scatter (sum and mean) of 11 elements per rank.
  const int64_t s = 11;
  auto input_of = [&](int r) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(77 + r);
    return torch::randn({n * s}, gen);
  };
  auto expect_sum = torch::zeros({s});
  for (int r = 0; r < n; ++r)
    expect_sum += input_of(r).narrow(0, rank * s, s);
  auto out = torch::empty({s}, dev);
  fsdp::reduce_scatter(*pg, input_of(rank).to(dev), out, ReduceOp::kSum)->wait();
  WORKER_EXPECT_CLOSE(out.cpu(), expect_sum, 1e-6, 1e-6);
  fsdp::reduce_scatter(*pg, input_of(rank).to(dev), out, ReduceOp::kAvg)->wait();
  WORKER_EXPECT_CLOSE(out.cpu(), expect_sum / n, 1e-6, 1e-6);

  auto t = torch::full({4}, static_cast<float>(rank + 1), dev);
  fsdp::all_reduce(*pg, t, ReduceOp::kSum)->wait();
  WORKER_EXPECT_CLOSE(t.cpu(), torch::full({4}, n * (n + 1) / 2.0f), 0, 0);
  const int root = n - 1;
  auto b = torch::full({3}, static_cast<float>(rank == root ? 42 : rank), dev);
  fsdp::broadcast(*pg, b, root)->wait();
  WORKER_CHECK(torch::equal(b.cpu(), torch::full({3}, 42.0f))) << b;
  std::printf("[rank %d] %s COLLECTIVES OK on %s\n", rank, pg->backend_name().c_str(),
              dev.str().c_str());
  return 0;
}

// A 3-layer MLP whose widths no world size divides, trained for a few steps with clipping.
struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : l1(register_module("l1", torch::nn::Linear(7, 13))),
        l2(register_module("l2", torch::nn::Linear(13, 11))),
        l3(register_module("l3", torch::nn::Linear(11, 5))) {}
  // Plain calls for the reference, fsdp::forward once the layers are units. sleep_cycles > 0
  // (CUDA only): a GpuSleep before each layer, in forward and in backward.
  torch::Tensor forward(const torch::Tensor& x) {
    if (!fsdp::is_sharded(*l1))
      return l3(torch::tanh(l2(torch::tanh(l1(x)))));
    auto lag = [&](const torch::Tensor& t) {
      return sleep_cycles > 0 ? GpuSleep::apply(t, sleep_cycles) : t;
    };
    auto h = torch::tanh(fsdp::forward(l1, lag(x)));
    h = torch::tanh(fsdp::forward(l2, lag(h)));
    return fsdp::forward(l3, lag(h));
  }
  torch::nn::Linear l1, l2, l3;
  int64_t sleep_cycles = 0;
};
TORCH_MODULE(Mlp);

Mlp make_mlp() {
  torch::manual_seed(7);
  return Mlp();
}

FSDP_WORKER(cuda_full_shard_steps) {
  auto pg = cuda_group(ctx);
  const int rank = pg->rank(), n = pg->size();
  const auto dev = this_device(ctx);
  constexpr int kSteps = 4;
  const int64_t global_batch = 4 * n;
  auto batch = [&](int step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
    return std::make_pair(torch::randn({global_batch, 7}, gen),
                          torch::randn({global_batch, 5}, gen));
  };

  // Reference: one CPU process, the whole batch.
  auto ref = make_mlp();
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    ref_opt.zero_grad();
    torch::nn::functional::mse_loss(ref->forward(x), y).backward();
    torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.5);
    ref_opt.step();
  }

  // OFFLOAD=1: CPUOffloadPolicy, shards and grads in pinned host memory, stepped there by the
  // fused CPU AdamW; else shards on the GPU, stepped by torch's fused CUDA AdamW.
  const bool offload = ctx.env("OFFLOAD") == "1";
  auto options = fsdp::FullyShardOptions(pg);
  if (offload)
    options.offload_policy(fsdp::CPUOffloadPolicy());
  const bool slow = ctx.env("SLOW") == "1";
  auto net = make_mlp();
  net->to(dev);
  if (slow)
    net->sleep_cycles = kSleepCycles;
  for (const auto& layer : {net->l1, net->l2, net->l3})
    fsdp::fully_shard(layer, options);
  fsdp::fully_shard(net, options);
  std::unique_ptr<torch::optim::Optimizer> opt_holder;
  if (offload)
    opt_holder =
        std::make_unique<fsdp::FusedAdamW>(net->parameters(), torch::optim::AdamWOptions(1e-2));
  else  // the optimizer fsdp-train steps shards on a GPU with
    opt_holder = std::make_unique<fsdp::TorchFusedAdamW>(net->parameters(),
                                                         torch::optim::AdamWOptions(1e-2));
  auto& opt = *opt_holder;
  const int64_t rows = global_batch / n;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    opt.zero_grad();
    auto out = fsdp::forward(net, x.narrow(0, rank * rows, rows).to(dev));
    torch::nn::functional::mse_loss(out, y.narrow(0, rank * rows, rows).to(dev)).backward();
    const double norm = fsdp::clip_grad_norm_(net->parameters(), 0.5, *pg);
    WORKER_CHECK(std::isfinite(norm) && norm > 0) << norm;
    opt.step();
  }
  torch::cuda::synchronize();
  auto ref_params = ref->named_parameters();
  for (const auto& item : net->named_parameters()) {
    if (offload) {
      WORKER_CHECK(item.value().device().is_cpu() && item.value().is_pinned())
          << item.key() << " at rest on " << item.value().device() << ", pinned "
          << item.value().is_pinned();
    } else {
      WORKER_CHECK(item.value().device() == dev) << item.key() << " on " << item.value().device();
    }
    WORKER_EXPECT_CLOSE(item.value().cpu(),
                        fsdp::test::expected_shard(ref_params[item.key()], rank, n), 1e-5, 1e-6);
  }
  std::printf("[rank %d] %s FULL_SHARD OK%s%s: %d steps with clipping equal one CPU process\n",
              rank, pg->backend_name().c_str(), offload ? " (CPU offload)" : "",
              slow ? " (GPU lagging the host)" : "", kSteps);
  return 0;
}

// Deferred init onto the GPU: placeholders on the device, each rank fills only its shard.
FSDP_WORKER(cuda_deferred_init) {
  auto pg = cuda_group(ctx);
  const int rank = pg->rank(), n = pg->size();
  const auto dev = this_device(ctx);
  auto cfg = fsdp_models::GPTConfig::preset("gpt2-tiny");
  cfg.vocab_size = 97, cfg.block_size = 16, cfg.n_layer = 2;
  fsdp_models::GPT eager(cfg, fsdp_models::ModelInit().seed(5));

  fsdp_models::GPT model(cfg, fsdp_models::ModelInit().device(torch::kMeta).seed(5));
  fsdp_models::to_hollow(*model, torch::TensorOptions().dtype(torch::kFloat32).device(dev));
  auto options = fsdp::FullyShardOptions(pg).param_init(
      fsdp_models::shard_initializer(*model, fsdp_models::gpt_init_scheme(cfg), 5));
  fsdp_models::parallelize_gpt(model, options);
  auto eager_params = eager->named_parameters();
  for (const auto& item : model->named_parameters()) {
    WORKER_CHECK(item.value().device() == dev) << item.key() << " on " << item.value().device();
    WORKER_CHECK(torch::equal(item.value().cpu(),
                              fsdp::test::expected_shard(eager_params[item.key()], rank, n)))
        << item.key();
  }
  auto idx = torch::randint(0, cfg.vocab_size, {2, 16}, torch::kLong);
  auto logits = fsdp::forward(model, idx.to(dev));
  torch::NoGradGuard no_grad;
  WORKER_EXPECT_CLOSE(logits.cpu(), eager->forward(idx), 1e-4, 1e-5);
  std::printf("[rank %d] %s DEFERRED INIT OK: shards and logits equal an eager CPU build\n",
              rank, pg->backend_name().c_str());
  return 0;
}

int visible_gpus() {
  return torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
}

#define REQUIRE_A_GPU()                                                      \
  if (visible_gpus() < 1)                                                    \
  GTEST_SKIP() << "needs a CUDA device, none visible (scripts/gpu_check.sh " \
                  "runs these on a GPU machine)"

// One rank per GPU, at most 2.
int nccl_world() {
  return std::min(visible_gpus(), 2);
}

constexpr int kGlooCudaRanks = 3;

fsdp::test::RunOptions options(std::vector<std::pair<std::string, std::string>> env) {
  auto o = fsdp::test::with_env(std::move(env));
  o.timeout = std::chrono::seconds(120);  // CUDA contexts and NCCL communicators start slowly
  return o;
}

fsdp::test::RunOptions gloo_cuda_run(std::vector<std::pair<std::string, std::string>> env = {}) {
  env.emplace_back("BACKEND", "gloo_cuda");
  return options(std::move(env));
}

TEST(Nccl, CollectivesMatchCpuValues) {
  REQUIRE_A_GPU();
  EXPECT_WORKERS_OK(fsdp::test::run_workers("cuda_collectives", nccl_world(), options({})));
}

TEST(Nccl, FullShardStepsWithClippingEqualOneCpuProcess) {
  REQUIRE_A_GPU();
  EXPECT_WORKERS_OK(fsdp::test::run_workers("cuda_full_shard_steps", nccl_world(), options({})));
}

TEST(Nccl, CpuOffloadStepsEqualOneCpuProcess) {
  REQUIRE_A_GPU();
  EXPECT_WORKERS_OK(
      fsdp::test::run_workers("cuda_full_shard_steps", nccl_world(), options({{"OFFLOAD", "1"}})));
}

TEST(Nccl, GpuLaggingTheHostChangesNothing) {
  REQUIRE_A_GPU();
  EXPECT_WORKERS_OK(
      fsdp::test::run_workers("cuda_full_shard_steps", nccl_world(), options({{"SLOW", "1"}})));
}

TEST(Nccl, GpuLaggingTheHostChangesNothingWithCpuOffload) {
  REQUIRE_A_GPU();
  EXPECT_WORKERS_OK(fsdp::test::run_workers("cuda_full_shard_steps", nccl_world(),
                                            options({{"SLOW", "1"}, {"OFFLOAD", "1"}})));
}

TEST(Nccl, DeferredInitOnTheDeviceEqualsEagerCpuBuild) {
  REQUIRE_A_GPU();
  EXPECT_WORKERS_OK(fsdp::test::run_workers("cuda_deferred_init", nccl_world(), options({})));
}

TEST(GlooCuda, CollectivesMatchCpuValues) {
  REQUIRE_A_GPU();
  EXPECT_WORKERS_OK(fsdp::test::run_workers("cuda_collectives", kGlooCudaRanks, gloo_cuda_run()));
}

TEST(GlooCuda, FullShardStepsOnThreeRanksOfOneGpuEqualOneCpuProcess) {
  REQUIRE_A_GPU();
  EXPECT_WORKERS_OK(
      fsdp::test::run_workers("cuda_full_shard_steps", kGlooCudaRanks, gloo_cuda_run()));
}

TEST(GlooCuda, CpuOffloadOnThreeRanksOfOneGpu) {
  REQUIRE_A_GPU();
  EXPECT_WORKERS_OK(fsdp::test::run_workers("cuda_full_shard_steps", kGlooCudaRanks,
                                            gloo_cuda_run({{"OFFLOAD", "1"}})));
}

TEST(GlooCuda, GpuLaggingTheHostChangesNothing) {
  REQUIRE_A_GPU();
  EXPECT_WORKERS_OK(fsdp::test::run_workers("cuda_full_shard_steps", kGlooCudaRanks,
                                            gloo_cuda_run({{"SLOW", "1"}, {"OFFLOAD", "1"}})));
}

TEST(GlooCuda, DeferredInitOnThreeRanksOfOneGpu) {
  REQUIRE_A_GPU();
  EXPECT_WORKERS_OK(fsdp::test::run_workers("cuda_deferred_init", kGlooCudaRanks, gloo_cuda_run()));
}

}  // namespace
