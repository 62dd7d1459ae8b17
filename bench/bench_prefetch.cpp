// bench_prefetch: how much all-gather time prefetch hides, and what it does to tokens/s and
// peak memory. Trains the same GPT under several prefetch settings in one run, in interleaved
// rounds (a burst of load from other processes hits every setting alike), and prints, per
// setting, the exposed (not hidden) communication, the step time, tokens/s and peak tensor
// memory, each as a ratio to the no-prefetch baseline of the same run.
//
//   OMP_NUM_THREADS=1 torchrun --standalone --no-python --nproc-per-node 2 bench_prefetch
//
// A benchmark, not a test: it checks once that every setting computed the same losses as the
// baseline (prefetch must not change the math), and asserts nothing about speed.
#include <torch/torch.h>
#include <torch/version.h>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <fsdp/fsdp.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "gpt.h"

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

struct Setting {
  std::string name;
  bool forward_prefetch;
  fsdp::BackwardPrefetch backward_prefetch;
  fsdp::ShardingStrategy strategy = fsdp::ShardingStrategy::kFullShard;
  int64_t all_gather_bucket_bytes = fsdp::FullyShardOptions(nullptr).all_gather_bucket_bytes();
};

struct Run {
  Setting setting;
  fsdp_models::GPT model{nullptr};
  std::unique_ptr<torch::optim::AdamW> opt;
  std::unique_ptr<fsdp::StepProfiler> prof;
  std::vector<fsdp::StepBreakdown> steps;
  std::vector<double> slowest_step_s;  // max over ranks, per timed step
  std::vector<double> losses;
  int64_t peak_bytes = 0;
};

double median(std::vector<double> v) {
  if (v.empty())
    return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

template <typename F>
double median_of(const std::vector<fsdp::StepBreakdown>& steps, F f) {
  std::vector<double> v;
  for (const auto& s : steps)
    v.push_back(f(s));
  return median(v);
}

double max_over_ranks(fsdp::ProcessGroup& pg, double x) {
  auto t = torch::tensor({x}, torch::kDouble);
  fsdp::all_reduce(pg, t, fsdp::ReduceOp::kMax)->wait();
  return t.item<double>();
}

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string one, five, fifteen;
  if (!(in >> one >> five >> fifteen))
    return "unknown";
  return one + " " + five + " " + fifteen;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Exposed communication and tokens/s with prefetch off vs on (use torchrun)"};
  int n_layer = 6, n_embd = 512, n_head = 8, vocab = 2048, seq = 128, batch = 1;
  int steps = 4, rounds = 5, warmup = 2;
  bool with_post = true, with_sgo = false, with_unbucketed = false;
  int gloo_lanes = fsdp::ProcessGroupOptions().gloo_lanes();
  app.add_option("--n-layer", n_layer, "transformer blocks (one FSDP unit each)");
  app.add_option("--n-embd", n_embd, "model width: sets the bytes of a unit (12 x width^2 x 4)");
  app.add_option("--n-head", n_head, "attention heads");
  app.add_option("--vocab", vocab, "vocabulary size (the root unit's embedding)");
  app.add_option("--seq", seq, "tokens per sequence: with --batch, sets compute per unit");
  app.add_option("--batch", batch, "sequences per rank per step");
  app.add_option("--steps", steps, "timed steps per setting per round");
  app.add_option("--rounds", rounds, "interleaved rounds over the settings");
  app.add_option("--warmup", warmup, "untimed steps per setting before the first round");
  app.add_option("--with-post", with_post, "include backward prefetch after the reduce-scatter");
  app.add_option("--with-sgo", with_sgo, "include shard_grad_op (no re-gather in backward)");
  app.add_option("--with-unbucketed", with_unbucketed,
                 "include prefetch with one all-gather call per unit (all_gather_bucket_bytes 0)");
  app.add_option("--gloo-lanes", gloo_lanes, "Gloo contexts (one worker thread each) per group");
  CLI11_PARSE(app, argc, argv);

  try {
    fsdp::memory::install_tracking_allocator();
    torch::set_num_threads(1);  // one core per rank, as in training
    auto pg = fsdp::init_process_group(fsdp::ProcessGroupOptions().gloo_lanes(gloo_lanes));
    const int rank = pg->rank(), n = pg->size();

    fsdp_models::GPTConfig cfg;
    cfg.vocab_size = vocab, cfg.block_size = seq, cfg.n_layer = n_layer, cfg.n_head = n_head,
    cfg.n_embd = n_embd;

    std::vector<Setting> settings{
        {"prefetch off", false, fsdp::BackwardPrefetch::kNone},
        {"fwd + bwd pre", true, fsdp::BackwardPrefetch::kBackwardPre},
    };
    if (with_post)
      settings.push_back({"fwd + bwd post", true, fsdp::BackwardPrefetch::kBackwardPost});
    if (with_sgo) {
      settings.push_back({"shard_grad_op + fwd", true, fsdp::BackwardPrefetch::kBackwardPre,
                          fsdp::ShardingStrategy::kShardGradOp});
    }
    if (with_unbucketed) {
      settings.push_back({"fwd + bwd pre, 1 call", true, fsdp::BackwardPrefetch::kBackwardPre,
                          fsdp::ShardingStrategy::kFullShard, 0});
    }
    std::vector<Run> runs;
    for (const auto& s : settings) {
      Run r;
      r.setting = s;
      torch::manual_seed(0);
      r.model = fsdp_models::GPT(cfg);
      fsdp::FullyShardOptions opts(pg);
      opts.strategy(s.strategy)
          .forward_prefetch(s.forward_prefetch)
          .backward_prefetch(s.backward_prefetch)
          .all_gather_bucket_bytes(s.all_gather_bucket_bytes);
      fsdp_models::parallelize_gpt(r.model, opts);
      r.opt = std::make_unique<torch::optim::AdamW>(r.model->parameters(),
                                                    torch::optim::AdamWOptions(1e-4));
      r.prof = std::make_unique<fsdp::StepProfiler>(r.model.ptr());
      runs.push_back(std::move(r));
    }
    const int64_t block_params = 12LL * n_embd * n_embd + 13LL * n_embd;
    if (rank == 0) {
      fmt::print(
          "fsdp-cpp prefetch: {} ranks on {}, torch {}.{}.{}, GPT {} blocks x width {} ({:.1f} "
          "MiB per block unsharded), {} x {} tokens per rank per step, {} hardware threads, {} "
          "Gloo lane(s); load average at start: {}\n",
          n, pg->backend_name(), TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH,
          n_layer, n_embd, block_params * 4 / kMiB, batch, seq, std::thread::hardware_concurrency(),
          gloo_lanes, load_average());
    }

    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + rank);
    auto one_step = [&](Run& r, const torch::Tensor& tokens, bool timed) {
      torch::Tensor loss;
      fsdp::memory::reset_peak();
      const int64_t before = fsdp::memory::current_bytes();
      r.prof->begin_step();
      {
        auto s = r.prof->forward();
        loss = fsdp_models::lm_loss(fsdp::forward(r.model, tokens.narrow(1, 0, seq)),
                                    tokens.narrow(1, 1, seq));
      }
      {
        auto s = r.prof->backward();
        loss.backward();
      }
      {
        auto s = r.prof->optimizer();
        r.opt->step();
        r.opt->zero_grad();
      }
      auto b = r.prof->end_step();
      r.losses.push_back(loss.item<double>());
      if (timed) {
        // Warm-up steps allocate the optimizer state: only steady steps say what a setting holds.
        r.peak_bytes = std::max(r.peak_bytes, fsdp::memory::peak_bytes() - before);
        r.slowest_step_s.push_back(max_over_ranks(*pg, b.step_s));
        r.steps.push_back(b);
      }
    };
    // The same batches for every setting: the losses must agree.
    std::vector<torch::Tensor> batches;
    for (int i = 0; i < warmup + rounds * steps; ++i) {
      batches.push_back(
          torch::randint(vocab, {batch, seq + 1}, gen, torch::TensorOptions().dtype(torch::kLong)));
    }
    for (auto& r : runs) {
      for (int i = 0; i < warmup; ++i)
        one_step(r, batches[i], false);
    }
    for (int round = 0; round < rounds; ++round) {
      for (auto& r : runs) {
        pg->barrier();
        for (int i = 0; i < steps; ++i)
          one_step(r, batches[warmup + round * steps + i], true);
      }
    }

    bool same_math = true;
    double worst = 0;
    for (const auto& r : runs) {
      for (size_t i = 0; i < r.losses.size(); ++i) {
        const double d = std::abs(r.losses[i] - runs[0].losses[i]);
        worst = std::max(worst, d);
        same_math = same_math && d <= 1e-5 * std::abs(runs[0].losses[i]);
      }
    }
    std::vector<double> peaks;
    for (const auto& r : runs)
      peaks.push_back(max_over_ranks(*pg, static_cast<double>(r.peak_bytes)));

    if (rank == 0) {
      const auto& base = runs[0];
      const double base_step = median(base.slowest_step_s);
      const double ag_calls = static_cast<double>(base.steps.front().comm.all_gather.calls);
      const double ag_per_unit =
          median_of(base.steps, [](auto& s) { return s.all_gather_wait_s; }) /
          std::max(1.0, ag_calls);
      const double fwd_per_unit =
          median_of(base.steps, [](auto& s) { return s.forward_s; }) / (n_layer + 1);
      fmt::print(
          "baseline (prefetch off): {:.0f} all-gathers per step, {:.2f} ms each exposed; "
          "forward compute {:.2f} ms per unit (backward about twice that)\n",
          ag_calls, ag_per_unit * 1e3, fwd_per_unit * 1e3);
      fmt::print(
          "medians over {} rounds x {} steps; step = slowest rank; waits, compute: rank 0; "
          "peak: tensor bytes above the step's start, max over steps and ranks\n\n",
          rounds, steps);
      fmt::print("{:<22} {:>9} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10} {:>9} {:>7}\n", "setting",
                 "step ms", "vs off", "tokens/s", "AG wait ms", "(fwd)", "RS wait ms", "compute ms",
                 "peak MiB", "vs off");
      for (size_t i = 0; i < runs.size(); ++i) {
        const auto& r = runs[i];
        const double step = median(r.slowest_step_s);
        const double tokens = static_cast<double>(batch) * seq * n;
        fmt::print(
            "{:<22} {:>9.2f} {:>7.2f}x {:>10.0f} {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f} "
            "{:>9.2f} {:>6.2f}x\n",
            r.setting.name, step * 1e3, base_step / step, tokens / step,
            median_of(r.steps, [](auto& s) { return s.all_gather_wait_s; }) * 1e3,
            median_of(r.steps, [](auto& s) { return s.all_gather_wait_forward_s; }) * 1e3,
            median_of(r.steps, [](auto& s) { return s.reduce_wait_s; }) * 1e3,
            median_of(r.steps, [](auto& s) { return s.forward_s + s.backward_s; }) * 1e3,
            peaks[i] / kMiB, peaks[i] / peaks[0]);
      }
      fmt::print("\nlosses: every setting {} the baseline's (max |diff| {:.2g})\n",
                 same_math ? "equals" : "DIFFERS FROM", worst);
    }
    return same_math ? 0 : 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_prefetch: {}\n", e.what());
    return 1;
  }
}
