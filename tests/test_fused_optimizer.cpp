// fsdp::FusedAdamW / FusedSGD: the same math as torch's optimizers, the same results on every
// CPU capability and with the state in a file, and clear errors for a bad offload directory.
#include <ATen/Version.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fsdp/core/memory.h>
#include <fsdp/fsdp.h>
#include <fsdp/optim/fused_optimizer.h>
#include <fsdp/optim/torch_fused_adamw.h>

#include "harness/files.h"
#include "harness/multiprocess.h"
#include "harness/small_net.h"
#include "optim/optimizer_kernels.h"

namespace {

namespace fs = std::filesystem;
using fsdp::FusedAdamW;
using fsdp::FusedSGD;
using fsdp::OptimizerStateOptions;

bool bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(),
                     a.numel() * a.element_size()) == 0;
}

// Units in the last place between two float tensors, elementwise (same sign assumed where
// they differ by little).
int64_t max_ulps(const torch::Tensor& a, const torch::Tensor& b) {
  auto ia = a.contiguous().view(torch::kInt32).to(torch::kInt64);
  auto ib = b.contiguous().view(torch::kInt32).to(torch::kInt64);
  return (ia - ib).abs().max().item<int64_t>();
}

// The difference in units of float's epsilon times max(|b|, floor): an AdamW step moves a
// parameter by about lr, so a one-ulp difference in that update is ~lr * 2^-23 whatever the
// parameter's own size (near zero, "ulps of the parameter" would exaggerate it).
double scaled_ulps(const torch::Tensor& a, const torch::Tensor& b, double floor) {
  auto scale = b.abs().clamp_min(floor) * std::numeric_limits<float>::epsilon();
  return ((a - b).abs() / scale).max().item<double>();
}

// Sizes that exercise whole vectors, tails and pieces across kPieceElements (32768).
const std::vector<int64_t> kSizes{1, 15, 17, 100, 1000, 40000, 70001};

std::vector<torch::Tensor> make_params(uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<torch::Tensor> out;
  for (auto n : kSizes)
    out.push_back(torch::randn({n}));
  out.push_back(torch::randn({37, 29}));
  return out;
}

void set_grads(std::vector<torch::Tensor>& params, uint64_t seed) {
  torch::manual_seed(seed);
  for (auto& p : params)
    p.mutable_grad() = torch::randn_like(p) * 0.1;
}

std::vector<torch::Tensor> clone_all(const std::vector<torch::Tensor>& v) {
  std::vector<torch::Tensor> out;
  for (const auto& t : v)
    out.push_back(t.detach().clone());
  return out;
}

// --- The kernels, capability by capability -----------------------------------------------

TEST(FusedKernels, EveryCapabilityGivesBitwiseTheSameResult) {
  const auto* reference = fsdp::detail::kernels_for("DEFAULT");
  ASSERT_NE(reference, nullptr);
  int compared = 0;
  for (const char* cap : {"AVX2", "AVX512"}) {
    const auto* table = fsdp::detail::kernels_for(cap);
    if (!table)
      continue;  // this CPU cannot run it (reported below)
    for (bool bf16 : {false, true}) {
      for (bool amsgrad : {false, true}) {
        torch::manual_seed(3);
        const int64_t n = 1000 + 13;
        auto p = torch::randn({n}), g = torch::randn({n}) * 0.1;
        auto dtype = bf16 ? torch::kBFloat16 : torch::kFloat32;
        auto m = (torch::randn({n}) * 0.01).to(dtype), v = (torch::rand({n}) * 1e-3).to(dtype);
        auto x = v.clone();
        // Non-finite values too: the vector and scalar paths must round (or keep) them alike.
        g[5] = std::numeric_limits<float>::infinity();
        g[6] = std::numeric_limits<float>::quiet_NaN();
        g[n - 2] = -std::numeric_limits<float>::infinity();
        m[7] = std::numeric_limits<float>::infinity();
        v[n - 3] = std::numeric_limits<float>::quiet_NaN();
        fsdp::detail::AdamWScalars s;
        s.apply_decay = true;
        s.decay = 0.999f;
        s.beta1 = 0.9f, s.one_minus_beta1 = 0.1f, s.beta2 = 0.999f, s.one_minus_beta2 = 0.001f;
        s.bias_correction2_sqrt = 0.3f, s.eps = 1e-8f, s.neg_step_size = -1e-3f;
        s.amsgrad = amsgrad;
        s.rounding_key = 77;
        auto run = [&](const fsdp::detail::KernelTable& t) {
          auto pp = p.clone(), mm = m.clone(), vv = v.clone(), xx = x.clone();
          // Cut into uneven spans: results must not depend on where spans start.
          for (int64_t b = 0; b < n;) {
            int64_t e = std::min(n, b + 1 + (b * 7919) % 301);
            fsdp::detail::AdamWSpan sp;
            const int64_t es = bf16 ? 2 : 4;
            sp.param = pp.data_ptr<float>() + b;
            sp.grad = g.data_ptr<float>() + b;
            sp.exp_avg = static_cast<char*>(mm.data_ptr()) + b * es;
            sp.exp_avg_sq = static_cast<char*>(vv.data_ptr()) + b * es;
            sp.max_exp_avg_sq = static_cast<char*>(xx.data_ptr()) + b * es;
            sp.n = e - b;
            sp.first = b;
            t.adamw(s, sp, bf16);
            b = e;
          }
          return std::vector<torch::Tensor>{pp, mm, vv, xx};
        };
        auto want = run(*reference), got = run(*table);
        for (size_t k = 0; k < want.size(); ++k)
          EXPECT_TRUE(bitwise_equal(want[k], got[k]))
              << cap << " bf16=" << bf16 << " amsgrad=" << amsgrad << " tensor " << k;
        ++compared;
      }
    }
  }
  std::cout << "capability in use: " << fsdp::FusedOptimizer::kernel_capability() << ", compared "
            << compared << " configurations against DEFAULT\n";
  EXPECT_GT(compared, 0) << "no vector capability on this CPU: nothing was compared";
}

// --- AdamW against torch::optim::AdamW ---------------------------------------------------

// One step from the same non-trivial state: the moments are bitwise torch's; the parameters
// differ only where MKL's vectorised sqrt (which torch's sqrt_ uses) is not correctly rounded,
// by one ulp.
TEST(FusedAdamW, OneStepMatchesTorchAdamW) {
  for (bool amsgrad : {false, true}) {
    for (double wd : {0.0, 0.1}) {
      auto params = make_params(1), ref = clone_all(params);
      for (auto& r : ref)
        r.requires_grad_(true);
      for (auto& p : params)
        p.requires_grad_(true);
      auto opts = torch::optim::AdamWOptions(2e-3).weight_decay(wd).amsgrad(amsgrad);
      FusedAdamW fused(params, opts);
      torch::optim::AdamW torch_opt(ref, opts);
      for (int step = 0; step < 3; ++step) {
        set_grads(params, 10 + step);
        set_grads(ref, 10 + step);
        fused.step();
        torch_opt.step();
      }
      int64_t differing = 0, total = 0;
      double worst = 0, max_abs = 0;
      for (size_t i = 0; i < params.size(); ++i) {
        auto& st = static_cast<torch::optim::AdamWParamState&>(
            *torch_opt.state()[ref[i].unsafeGetTensorImpl()]);
        int64_t step = 0;
        auto mine = fused.get_state(params[i], &step);
        EXPECT_EQ(step, st.step());
        // Moments depend on the gradients only (not on the parameters): bitwise.
        EXPECT_TRUE(bitwise_equal(mine["exp_avg"], st.exp_avg())) << "param " << i;
        EXPECT_TRUE(bitwise_equal(mine["exp_avg_sq"], st.exp_avg_sq())) << "param " << i;
        if (amsgrad) {
          EXPECT_TRUE(bitwise_equal(mine["max_exp_avg_sq"], st.max_exp_avg_sq()));
        }
        differing += (params[i] != ref[i]).sum().item<int64_t>();
        total += params[i].numel();
        worst = std::max(worst, scaled_ulps(params[i], ref[i], 2e-3));
        max_abs = std::max(max_abs, (params[i] - ref[i]).abs().max().item<double>());
      }
      std::cout << "amsgrad=" << amsgrad << " wd=" << wd << ": " << differing << " of " << total
                << " parameters differ from torch::optim::AdamW after 3 steps, max |diff| "
                << max_abs << " = " << worst << " ulp of max(|p|, lr)\n";
      EXPECT_LE(worst, 3);
      EXPECT_LT(differing, total / 100);
    }
  }
}

// fsdp::TorchFusedAdamW (the optimizer of shards on a GPU) runs torch's fused AdamW kernel,
// which ATen also has for the CPU: the same update as torch::optim::AdamW to float rounding,
// the same state (moments and step counts), and it resumes from torch::optim::AdamW's state
// (a loaded checkpoint) with the step count the state says.
TEST(TorchFusedAdamW, MatchesTorchAdamWAndResumesFromItsState) {
  for (double wd : {0.0, 0.1}) {
    auto params = make_params(2), ref = clone_all(params);
    for (auto& r : ref)
      r.requires_grad_(true);
    for (auto& p : params)
      p.requires_grad_(true);
    auto opts = torch::optim::AdamWOptions(2e-3).weight_decay(wd);
    torch::optim::AdamW torch_opt(ref, opts);
    // Two steps of torch's, whose state the fused one then takes over, then three of each.
    auto start = clone_all(params);
    for (int step = 0; step < 2; ++step) {
      set_grads(ref, 20 + step);
      torch_opt.step();
    }
    for (size_t i = 0; i < params.size(); ++i)
      params[i].detach().copy_(ref[i].detach());
    fsdp::TorchFusedAdamW fused(params, opts);
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& st = static_cast<torch::optim::AdamWParamState&>(
          *torch_opt.state()[ref[i].unsafeGetTensorImpl()]);
      auto copy = std::make_unique<torch::optim::AdamWParamState>();
      copy->step(st.step());
      copy->exp_avg(st.exp_avg().clone());
      copy->exp_avg_sq(st.exp_avg_sq().clone());
      fused.state()[params[i].unsafeGetTensorImpl()] = std::move(copy);
    }
    for (int step = 2; step < 5; ++step) {
      set_grads(params, 20 + step);
      set_grads(ref, 20 + step);
      fused.step();
      torch_opt.step();
    }
    double worst = 0, worst_moment = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& st = static_cast<torch::optim::AdamWParamState&>(
          *torch_opt.state()[ref[i].unsafeGetTensorImpl()]);
      const auto& mine = static_cast<torch::optim::AdamWParamState&>(
          *fused.state()[params[i].unsafeGetTensorImpl()]);
      EXPECT_EQ(mine.step(), 5);
      EXPECT_EQ(st.step(), 5);
      // The kernel moves the first moment by a lerp, torch::optim::AdamW by mul and add:
      // float rounding apart, relative to each moment tensor's largest element.
      for (const auto& [a, b] : {std::pair{mine.exp_avg(), st.exp_avg()},
                                 std::pair{mine.exp_avg_sq(), st.exp_avg_sq()}}) {
        worst_moment = std::max(
            worst_moment, ((a - b).abs().max() / b.abs().max()).item<double>());
      }
      worst = std::max(worst, scaled_ulps(params[i], ref[i], 2e-3));
      // It moved the parameters (the comparison is not between two untouched copies).
      EXPECT_FALSE(torch::equal(params[i], start[i])) << "param " << i;
    }
    // A state loaded after the fused optimizer has stepped (its cached step tensors then hold
    // 5): torch's steps twice more alone, the fused one takes its state (step 7) and both step.
    for (int step = 5; step < 7; ++step) {
      set_grads(ref, 20 + step);
      torch_opt.step();
    }
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].detach().copy_(ref[i].detach());
      const auto& st = static_cast<torch::optim::AdamWParamState&>(
          *torch_opt.state()[ref[i].unsafeGetTensorImpl()]);
      auto copy = std::make_unique<torch::optim::AdamWParamState>();
      copy->step(st.step());
      copy->exp_avg(st.exp_avg().clone());
      copy->exp_avg_sq(st.exp_avg_sq().clone());
      fused.state()[params[i].unsafeGetTensorImpl()] = std::move(copy);
    }
    set_grads(params, 27);
    set_grads(ref, 27);
    fused.step();
    torch_opt.step();
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(static_cast<torch::optim::AdamWParamState&>(
                    *fused.state()[params[i].unsafeGetTensorImpl()])
                    .step(),
                8);
      worst = std::max(worst, scaled_ulps(params[i], ref[i], 2e-3));
    }
    std::cout << "wd=" << wd << ": TorchFusedAdamW within " << worst
              << " ulp of max(|p|, lr) of torch::optim::AdamW after 5 steps and after a reload, "
                 "moments within "
              << worst_moment << " of their largest element\n";
    EXPECT_LE(worst, 8);
    EXPECT_LE(worst_moment, 1e-6);
  }
}

// The claim above, made exact: torch::optim::AdamW's own sequence of ATen ops with only the
// sqrt replaced by a correctly rounded one (in double, then rounded to float) is bitwise what
// the fused kernel computes, parameters included. ATen's vector kernels fuse the multiply-adds
// of add_(alpha) and addcmul_ (GCC contracts them under AVX2/AVX-512); its scalar DEFAULT
// build does not, so on such a CPU only the one-ulp bound above holds.
TEST(FusedAdamW, IsTorchAdamWWithACorrectlyRoundedSqrt) {
  if (at::get_cpu_capability() == "DEFAULT")
    GTEST_SKIP() << "ATen runs its scalar kernels here (no FMA): see OneStepMatchesTorchAdamW";
  const double lr = 2e-3, wd = 0.1, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  auto params = make_params(7), ref = clone_all(params);
  std::vector<torch::Tensor> m, v;
  for (auto& r : ref) {
    m.push_back(torch::zeros_like(r));
    v.push_back(torch::zeros_like(r));
  }
  FusedAdamW fused(params, torch::optim::AdamWOptions(lr).weight_decay(wd).betas({b1, b2}));
  for (int step = 1; step <= 3; ++step) {
    set_grads(params, 50 + step);
    set_grads(ref, 50 + step);
    fused.step();
    const double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
    for (size_t i = 0; i < ref.size(); ++i) {
      const auto& g = ref[i].grad();
      ref[i].mul_(1 - lr * wd);
      m[i].mul_(b1).add_(g, 1 - b1);
      v[i].mul_(b2).addcmul_(g, g, 1 - b2);
      auto sq = v[i].to(torch::kDouble).sqrt().to(torch::kFloat);  // IEEE, once rounded
      auto denom = (sq / std::sqrt(bc2)).add_(eps);
      ref[i].addcdiv_(m[i], denom, -(lr / bc1));
    }
  }
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(bitwise_equal(params[i], ref[i]))
        << "param " << i << " of " << params[i].numel() << ": max diff "
        << (params[i] - ref[i]).abs().max().item<float>();
}

// Groups with their own options (the weight-decay exemption of norms and biases is one).
TEST(FusedAdamW, ParamGroupsTakeTheirOwnOptions) {
  auto params = make_params(2), ref = clone_all(params);
  auto split = [](std::vector<torch::Tensor>& v) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<torch::Tensor>(v.begin(), v.begin() + 3),
                        std::make_unique<torch::optim::AdamWOptions>(
                            torch::optim::AdamWOptions(1e-2).weight_decay(0.5)));
    groups.emplace_back(std::vector<torch::Tensor>(v.begin() + 3, v.end()),
                        std::make_unique<torch::optim::AdamWOptions>(
                            torch::optim::AdamWOptions(3e-3).weight_decay(0).betas({0.8, 0.99})));
    return groups;
  };
  FusedAdamW fused(split(params));
  torch::optim::AdamW torch_opt(split(ref));
  for (int step = 0; step < 4; ++step) {
    set_grads(params, 20 + step);
    set_grads(ref, 20 + step);
    // The first parameter has no gradient in step 2: it must not step (nor count the step).
    if (step == 2) {
      params[0].mutable_grad() = torch::Tensor();
      ref[0].mutable_grad() = torch::Tensor();
    }
    fused.step();
    torch_opt.step();
  }
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_LE(scaled_ulps(params[i], ref[i], 3e-3), 4) << "param " << i;
    int64_t step = 0;
    fused.get_state(params[i], &step);
    EXPECT_EQ(step, i == 0 ? 3 : 4);
  }
}

// --- SGD against torch::optim::SGD: no sqrt, so bitwise ----------------------------------

TEST(FusedSGD, MatchesTorchSGDBitwise) {
  struct Case {
    double momentum, dampening, wd;
    bool nesterov;
  };
  for (const auto& c : {Case{0, 0, 0, false}, Case{0.9, 0, 0, false}, Case{0.9, 0.1, 1e-2, false},
                        Case{0.9, 0, 1e-2, true}}) {
    auto params = make_params(4), ref = clone_all(params);
    auto opts = torch::optim::SGDOptions(0.05)
                    .momentum(c.momentum)
                    .dampening(c.dampening)
                    .weight_decay(c.wd)
                    .nesterov(c.nesterov);
    FusedSGD fused(params, opts);
    torch::optim::SGD torch_opt(ref, opts);
    for (int step = 0; step < 4; ++step) {
      set_grads(params, 30 + step);
      set_grads(ref, 30 + step);
      fused.step();
      torch_opt.step();
    }
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(params[i], ref[i]))
          << "momentum " << c.momentum << " nesterov " << c.nesterov << " param " << i
          << ": max ulps " << max_ulps(params[i], ref[i]);
      if (c.momentum != 0) {
        auto& st = static_cast<torch::optim::SGDParamState&>(
            *torch_opt.state()[ref[i].unsafeGetTensorImpl()]);
        EXPECT_TRUE(bitwise_equal(fused.get_state(params[i], nullptr)["momentum_buffer"],
                                  st.momentum_buffer()));
      }
    }
  }
}

// --- bf16 moments ------------------------------------------------------------------------

// With beta2 = 0.999 and zero gradients, v decays by 0.1% per step: under half a bf16 ulp, so
// round-to-nearest would keep v where it is for ever. Stochastic rounding keeps the mean.
TEST(FusedAdamW, Bf16MomentsRoundStochasticallyWithoutBias) {
  const int64_t n = 20000;
  auto p = torch::zeros({n});
  FusedAdamW opt(std::vector<torch::Tensor>{p}, torch::optim::AdamWOptions(0),
                 OptimizerStateOptions().moments_dtype(torch::kBFloat16));
  // Start from v = 1 everywhere.
  opt.set_state(p, {{"exp_avg_sq", torch::ones({n})}}, 1);
  p.mutable_grad() = torch::zeros({n});
  const int steps = 700;
  for (int i = 0; i < steps; ++i)
    opt.step();
  auto v = opt.get_state(p, nullptr)["exp_avg_sq"].to(torch::kFloat);
  const double exact = std::pow(0.999, steps);  // fp32 gives this to 1e-6
  const double mean = v.mean().item<double>();
  std::cout << "v after " << steps << " steps of decay: exact " << exact << ", bf16 mean " << mean
            << " (round-to-nearest would stay at 1)\n";
  EXPECT_NEAR(mean, exact, 0.01 * exact);
  EXPECT_EQ(opt.state_bytes(), 2 * 2 * ((n + 63) / 64 * 64));  // 2 moments, 2 bytes, padded
}

// --- Offload to a file ---------------------------------------------------------------------

struct Trained {
  std::vector<torch::Tensor> params;
  std::vector<std::map<std::string, torch::Tensor>> state;
  fsdp::OptimizerStepStats last;
};

template <class Opt, class Options>
Trained train(const Options& opts, OptimizerStateOptions state_options, int steps) {
  auto params = make_params(5);
  Opt opt(params, opts, state_options);
  for (int s = 0; s < steps; ++s) {
    set_grads(params, 40 + s);
    opt.step();
  }
  Trained out{params, {}, opt.last_step()};
  for (auto& p : params)
    out.state.push_back(opt.get_state(p, nullptr));
  return out;
}

void expect_same(const Trained& a, const Trained& b, const std::string& what) {
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(a.params[i], b.params[i])) << what << ": param " << i;
    ASSERT_EQ(a.state[i].size(), b.state[i].size());
    for (const auto& [name, t] : a.state[i])
      EXPECT_TRUE(bitwise_equal(t, b.state[i].at(name))) << what << ": " << name << " " << i;
  }
}

TEST(FusedOptimizerOffload, FileStateGivesBitwiseTheInMemoryResult) {
  fsdp::test::TempDir dir;
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    auto adamw = torch::optim::AdamWOptions(1e-3).weight_decay(0.1).amsgrad(true);
    auto mem = train<FusedAdamW>(adamw, OptimizerStateOptions().moments_dtype(dtype), 5);
    // 64 KiB chunks: many chunks, cut through parameters, both buffers in turn.
    auto file = train<FusedAdamW>(
        adamw,
        OptimizerStateOptions().moments_dtype(dtype).offload_dir(dir.path()).chunk_bytes(64 << 10),
        5);
    expect_same(mem, file, std::string("adamw ") + c10::toString(dtype));
    // Every byte of the state was read and written once in the last step.
    int64_t state_bytes = 0;
    for (const auto& p : make_params(5))
      state_bytes += (p.numel() + 63) / 64 * 64 * 3 * (dtype == torch::kBFloat16 ? 2 : 4);
    EXPECT_GE(file.last.bytes_read, state_bytes);
    EXPECT_LT(file.last.bytes_read, state_bytes + (3 * 64 << 10));
    EXPECT_EQ(file.last.bytes_read, file.last.bytes_written);
    auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
    expect_same(train<FusedSGD>(sgd, OptimizerStateOptions().moments_dtype(dtype), 4),
                train<FusedSGD>(sgd,
                                OptimizerStateOptions()
                                    .moments_dtype(dtype)
                                    .offload_dir(dir.path())
                                    .chunk_bytes(32 << 10),
                                4),
                "sgd");
  }
  // The state file is unlinked at once: nothing is left in the directory.
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

TEST(FusedOptimizerOffload, ResidentMemoryDropsByTheStateBytes) {
  fsdp::memory::install_tracking_allocator();
  auto params = make_params(6);
  for (auto& p : params)
    p.mutable_grad() = torch::randn_like(p);
  auto resident_after_step = [&](OptimizerStateOptions o) {
    const auto before = fsdp::memory::current_by_category()[fsdp::memory::Category::kOptimizer];
    FusedAdamW opt(params, torch::optim::AdamWOptions(1e-3), o);
    opt.step();
    const auto after = fsdp::memory::current_by_category()[fsdp::memory::Category::kOptimizer];
    EXPECT_EQ(opt.resident_state_bytes(), after - before);
    return std::make_pair(after - before, opt.state_bytes());
  };
  fsdp::test::TempDir dir;
  const auto [in_memory, state] = resident_after_step({});
  const auto [offloaded, state2] =
      resident_after_step(OptimizerStateOptions().offload_dir(dir.path()).chunk_bytes(64 << 10));
  EXPECT_EQ(in_memory, state);
  EXPECT_EQ(state, state2);
  // Two 64 KiB chunk buffers (plus alignment slack) instead of the whole state.
  EXPECT_LE(offloaded, 2 * ((64 << 10) + 4096));
  std::cout << "optimizer state resident: " << in_memory << " bytes in memory, " << offloaded
            << " offloaded (state " << state << " bytes)\n";
}

// --- Bad offload directories -------------------------------------------------------------

std::string construct_error(const std::string& dir) {
  auto p = torch::zeros({1000});
  try {
    FusedAdamW opt(std::vector<torch::Tensor>{p}, {}, OptimizerStateOptions().offload_dir(dir));
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(FusedOptimizerOffload, BadDirectoriesAreRefusedAtConstruction) {
  fsdp::test::TempDir dir;
  EXPECT_NE(construct_error(dir.path() + "/missing").find("does not exist"), std::string::npos);
  std::ofstream(dir.path() + "/file") << "x";
  EXPECT_NE(construct_error(dir.path() + "/file").find("is not a directory"), std::string::npos);
  // A read-only file system: /proc refuses new files even to root (permission bits do not).
  const auto ro = construct_error("/proc");
  EXPECT_NE(ro.find("cannot create"), std::string::npos) << ro;
}

// The disk fills: RLIMIT_FSIZE makes the kernel refuse to grow files past a size, the same
// refusal a full disk gives (EFBIG instead of ENOSPC), in a worker process of its own.
FSDP_WORKER(offload_disk_full_at_start) {
  signal(SIGXFSZ, SIG_IGN);
  struct rlimit limit {
    1 << 20, 1 << 20
  };
  setrlimit(RLIMIT_FSIZE, &limit);
  auto p = torch::zeros({1 << 20});  // 8 MiB of state
  try {
    FusedAdamW opt(std::vector<torch::Tensor>{p}, {},
                   OptimizerStateOptions().offload_dir(ctx.tmp_dir));
  } catch (const std::exception& e) {
    std::cout << "ERROR: " << e.what() << "\n";
    return 3;
  }
  return 0;
}

// After the file was reserved, a write past the limit fails mid-step: the error names the file
// and stops the step; it is never swallowed.
FSDP_WORKER(offload_disk_full_mid_run) {
  signal(SIGXFSZ, SIG_IGN);
  auto p = torch::zeros({1 << 20});
  FusedAdamW opt(std::vector<torch::Tensor>{p}, {},
                 OptimizerStateOptions().offload_dir(ctx.tmp_dir).chunk_bytes(1 << 20));
  p.mutable_grad() = torch::ones({1 << 20});
  opt.step();
  struct rlimit limit {
    1 << 20, 1 << 20
  };
  setrlimit(RLIMIT_FSIZE, &limit);
  try {
    opt.step();
  } catch (const std::exception& e) {
    std::cout << "ERROR: " << e.what() << "\n";
    return 3;
  }
  return 0;
}

TEST(FusedOptimizerOffload, AFullDiskIsAClearError) {
  auto start = fsdp::test::run_workers("offload_disk_full_at_start", 1);
  ASSERT_EQ(start.exit_codes[0], 3) << start.outputs[0];
  EXPECT_NE(start.outputs[0].find("cannot reserve 8388608 bytes"), std::string::npos)
      << start.outputs[0];
  EXPECT_NE(start.outputs[0].find("fsdp-optimizer-state."), std::string::npos);
  auto mid = fsdp::test::run_workers("offload_disk_full_mid_run", 1);
  ASSERT_EQ(mid.exit_codes[0], 3) << mid.outputs[0];
  EXPECT_NE(mid.outputs[0].find("optimizer offload file '"), std::string::npos) << mid.outputs[0];
  EXPECT_NE(mid.outputs[0].find("write of"), std::string::npos) << mid.outputs[0];
}

}  // namespace

// --- Checkpoints -------------------------------------------------------------------------

namespace ckpt {

// SmallNet's shapes (rows 2 ranks do not divide, a 0-d parameter in the root), with a forward.
struct NetImpl : fsdp::test::SmallNetImpl {
  torch::Tensor forward(const torch::Tensor& x) { return b(fsdp::forward(a, x)) * gain; }
};
TORCH_MODULE(Net);

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Net& net, const std::string& kind,
                                                        const std::string& offload_dir) {
  auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  if (kind == "torch")
    return std::make_unique<torch::optim::AdamW>(net->parameters(), adamw);
  auto o = OptimizerStateOptions().chunk_bytes(8 << 10);  // several chunks, even here
  if (kind.find("bf16") != std::string::npos)
    o.moments_dtype(torch::kBFloat16);
  if (kind.find("file") != std::string::npos)
    o.offload_dir(offload_dir);
  if (kind.rfind("sgd", 0) == 0)
    return std::make_unique<FusedSGD>(net->parameters(),
                                      torch::optim::SGDOptions(0.05).momentum(0.9), o);
  return std::make_unique<FusedAdamW>(net->parameters(), adamw, o);
}

}  // namespace ckpt

// Trains steps [FROM, TO) of a fixed run on a sharded SmallNet with the optimizer OPT,
// optionally loading LOAD first and saving SAVE and the consolidated parameters OUT after.
FSDP_WORKER(fused_ckpt) {
  auto pg = fsdp::init_process_group();
  torch::manual_seed(1);
  ckpt::Net net;
  fsdp::FullyShardOptions opts(pg);
  fsdp::fully_shard(net->a, opts);
  fsdp::fully_shard(net, opts);
  const auto offload = ctx.tmp_dir + "/offload-" + std::to_string(ctx.rank);
  fs::create_directories(offload);
  auto opt = ckpt::make_optimizer(net, ctx.env("OPT"), offload);
  if (!ctx.env("LOAD").empty())
    fsdp::load_sharded(ctx.env("LOAD"), *net, opt.get());
  for (int64_t step = ctx.env_int("FROM", 0); step < ctx.env_int("TO", 0); ++step) {
    torch::manual_seed(100 * step + ctx.rank);
    auto x = torch::randn({4, 7});
    fsdp::forward(net, x).square().mean().backward();
    opt->step();
    opt->zero_grad();
  }
  if (!ctx.env("SAVE").empty())
    fsdp::save_sharded(ctx.env("SAVE"), *net, opt.get(), *pg);
  if (!ctx.env("OUT").empty())
    fsdp::save_consolidated(ctx.env("OUT"), *net, *pg);
  return 0;
}

TEST(FusedOptimizerCheckpoint, ResumesBitwiseAndMovesToAndFromTorchAdamW) {
  fsdp::test::TempDir dir;
  auto run = [&](const std::string& opt, int from, int to, const std::string& load,
                 const std::string& save, const std::string& out) {
    EXPECT_WORKERS_OK(fsdp::test::run_workers("fused_ckpt", 2,
                                              fsdp::test::with_env({{"OPT", opt},
                                                                    {"FROM", std::to_string(from)},
                                                                    {"TO", std::to_string(to)},
                                                                    {"LOAD", load},
                                                                    {"SAVE", save},
                                                                    {"OUT", out}})));
  };
  const auto d = dir.path() + "/";
  for (const std::string opt : {"fused", "sgd"}) {
    for (const std::string dtype : {"", "_bf16"}) {
      // Uninterrupted, in memory; then stopped at step 3 with the state in a file, resumed
      // with it in memory: the same bytes (bf16: the rounding stream resumes too).
      const auto tag = opt + dtype;
      run(opt + dtype, 0, 6, "", "", d + "straight" + tag + ".safetensors");
      run(opt + "_file" + dtype, 0, 3, "", d + "at3" + tag, "");
      run(opt + dtype, 3, 6, d + "at3" + tag, "", d + "resumed" + tag + ".safetensors");
      const auto a = fsdp::test::file_bytes(d + "straight" + tag + ".safetensors");
      EXPECT_FALSE(a.empty());
      EXPECT_EQ(a, fsdp::test::file_bytes(d + "resumed" + tag + ".safetensors")) << tag;
    }
  }
  // fused -> torch::optim::AdamW -> fused in a file: the state survives bit for bit (the
  // rank files are byte-identical).
  run("fused", 0, 2, "", d + "from-fused", "");
  run("torch", 0, 0, d + "from-fused", d + "via-torch", "");
  run("fused_file", 0, 0, d + "via-torch", d + "back-to-fused", "");
  for (const char* f : {"rank-00000.safetensors", "rank-00001.safetensors"}) {
    const auto a = fsdp::test::file_bytes(d + "from-fused/" + f);
    EXPECT_FALSE(a.empty());
    EXPECT_EQ(a, fsdp::test::file_bytes(d + "via-torch/" + f)) << f;
    EXPECT_EQ(a, fsdp::test::file_bytes(d + "back-to-fused/" + f)) << f;
  }
}
