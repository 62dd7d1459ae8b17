// bench_collectives: the figures behind the collective choices in docs/design.md. It times
// fsdp-cpp's Gloo all-gather and reduce-scatter (fsdp/distributed/collectives.h) against the
// alternatives a CPU FSDP could use instead, on the same buffers in the same run, and records the
// temporary tensor memory each one needs. A benchmark, not a test: it checks each result once, so
// that a figure never belongs to a wrong answer, but it asserts nothing about speed.
//
//   OMP_NUM_THREADS=1 torchrun --standalone --no-python --nproc-per-node 2 bench_collectives
//
// Every process is one rank; rank 0 prints the table. bench/README.md explains the columns and
// keeps the figures measured on our machines.
#include <torch/torch.h>
#include <torch/version.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fsdp/core/memory.h>
#include <fsdp/distributed/process_group.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <fsdp/distributed/collectives.h>
#include "distributed/backend_calls.h"
#include "distributed/group_access.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr double kMiB = 1024.0 * 1024.0;

// Relative sizes of the parameters of one GPT block (qkv, its bias, out-proj, its bias, fc1,
// its bias, fc2, its bias): a unit mixes a few large matrices with tiny vectors, and the tiny
// ones are where per-parameter bookkeeping would show.
constexpr int64_t kBlockShape[] = {3072, 3, 1024, 1, 4096, 4, 4096, 1};

struct Method {
  std::string name;
  // Untimed, before every run (refilling a buffer that the method reduces in place).
  std::function<void()> prepare;
  // Untimed, before the checked run only: makes stale results from another method visible.
  std::function<void()> poison;
  std::function<void()> run;
  // After one run: is this rank's result what the collective promises?
  std::function<bool()> check;
};

struct Result {
  std::string name;
  int reps = 0;
  double median_s = 0;
  double min_s = 0;
  int64_t peak_bytes = 0;
  bool ok = false;
};

// Like CollectiveWork::wait(): Gloo's worker thread releases the work, and with it the work's
// temporary buffers, just after marking it complete. Waiting for that keeps the comparison fair
// (ours pays the same wait) and makes temporaries die inside the measured scope.
void wait_released(c10::intrusive_ptr<c10d::Work> work) {
  work->wait();
  const auto deadline = Clock::now() + std::chrono::milliseconds(5);
  while (work.use_count() > 1 && Clock::now() < deadline) {
    std::this_thread::yield();
  }
}

void all_reduce_max(fsdp::ProcessGroup& pg, torch::Tensor& t) {
  fsdp::all_reduce(pg, t, fsdp::ReduceOp::kMax)->wait();
}

// The group's raw c10d backend, for the alternatives measured against ours. Only this
// benchmark and src/distributed reach it: it measures the primitives the collectives layer is
// built on.
c10d::Backend& raw(fsdp::ProcessGroup& pg) {
  return fsdp::detail::GroupAccess::first_lane(pg);
}

// Methods are timed in interleaved rounds (rep i of every method, then rep i + 1), so a burst
// of load from other processes on a shared machine lands on all of them alike rather than on
// whichever method happened to run then.
std::vector<Result> measure(fsdp::ProcessGroup& pg, const std::vector<Method>& methods, int warmup,
                            int reps) {
  const auto num = static_cast<int64_t>(methods.size());
  // Per method: [time of rep 0 .. reps-1, peak bytes, failed]. One all-reduce MAX at the end
  // makes every figure the slowest (or hungriest, or failing) rank's, which is what a training
  // step waits for.
  const int64_t row = reps + 2;
  auto stats = torch::zeros({num * row}, torch::kDouble);
  auto* s = stats.data_ptr<double>();
  for (int64_t k = 0; k < num; ++k) {
    const auto& m = methods[k];
    if (m.poison) {
      m.poison();
    }
    if (m.prepare) {
      m.prepare();
    }
    m.run();
    s[k * row + reps + 1] = !m.check || m.check() ? 0 : 1;
    for (int i = 0; i < warmup; ++i) {
      if (m.prepare) {
        m.prepare();
      }
      m.run();
    }
  }
  for (int i = 0; i < reps; ++i) {
    for (int64_t k = 0; k < num; ++k) {
      const auto& m = methods[k];
      double* r = s + k * row;
      if (m.prepare) {
        m.prepare();
      }
      // Start together, so a rank's time is the collective's and not its wait for a late peer.
      pg.barrier();
      fsdp::memory::PeakScope scope;
      const auto t0 = Clock::now();
      m.run();
      r[i] = std::chrono::duration<double>(Clock::now() - t0).count();
      r[reps] = std::max(r[reps], static_cast<double>(scope.peak_above_baseline()));
    }
  }
  all_reduce_max(pg, stats);
  std::vector<Result> results;
  for (int64_t k = 0; k < num; ++k) {
    const double* r = s + k * row;
    std::vector<double> times(r, r + reps);
    std::sort(times.begin(), times.end());
    const double median =
        reps % 2 ? times[reps / 2] : 0.5 * (times[reps / 2 - 1] + times[reps / 2]);
    results.push_back({methods[k].name, reps, median, times.front(), static_cast<int64_t>(r[reps]),
                       r[reps + 1] == 0});
  }
  return results;
}

// Values exactly representable in fp32 that differ per rank, per parameter and per position,
// so a misplaced block or a shifted parameter shows.
torch::Tensor shard_values(int64_t numel, int rank, int param, int num_params) {
  return torch::arange(numel, torch::kInt64)
      .remainder_(4093)
      .add_(4096 * (static_cast<int64_t>(rank) * num_params + param))
      .to(torch::kFloat);
}

std::vector<int64_t> param_shard_sizes(int64_t shard_numel, int num_params) {
  std::vector<int64_t> weights;
  for (int i = 0; i < num_params; ++i) {
    weights.push_back(kBlockShape[i % std::size(kBlockShape)]);
  }
  int64_t total_weight = 0;
  for (auto w : weights) {
    total_weight += w;
  }
  std::vector<int64_t> sizes;
  int64_t assigned = 0;
  for (int i = 0; i + 1 < num_params; ++i) {
    sizes.push_back(std::max<int64_t>(1, shard_numel * weights[i] / total_weight));
    assigned += sizes.back();
  }
  sizes.push_back(shard_numel - assigned);
  TORCH_CHECK(sizes.back() > 0, "unit too small for ", num_params, " parameters");
  return sizes;
}

std::vector<Result> bench_all_gather(fsdp::ProcessGroup& pg, int64_t shard_numel, int num_params,
                                     const std::vector<double>& bucket_mib, int warmup, int reps) {
  const int n = pg.size(), rank = pg.rank();
  const auto sizes = param_shard_sizes(shard_numel, num_params);
  // The unit's unsharded buffers are allocated before the measured scope: both methods must
  // fill them, so the peak column shows only what a method needs on top of them.
  std::vector<torch::Tensor> shards, gathered;
  for (int i = 0; i < num_params; ++i) {
    shards.push_back(shard_values(sizes[i], rank, i, num_params));
    gathered.push_back(torch::empty({n * sizes[i]}, torch::kFloat));
  }
  auto poison = [&] {
    for (auto& g : gathered) {
      g.fill_(-1);
    }
  };
  auto check = [&] {
    for (int i = 0; i < num_params; ++i) {
      for (int r = 0; r < n; ++r) {
        auto expected = shard_values(sizes[i], r, i, num_params);
        if (!torch::equal(gathered[i].narrow(0, r * sizes[i], sizes[i]), expected)) {
          return false;
        }
      }
    }
    return true;
  };

  Method ours{"a) fsdp all_gather (allgather_coalesced)", nullptr, poison,
              [&] { fsdp::all_gather(pg, shards, gathered)->wait(); }, check};
  // FSDP2's foreach_all_gather: copy the shards into this rank's slot of one flat output (the
  // input is a view of the output, so no separate input buffer), gather, then copy each
  // parameter's columns out of the (N, shard) rows. Gloo does not gather in place: it receives
  // into a flat temporary of its own and copies that into flat_out, which the peak shows.
  Method flat{"b) all_gather_single + copy-out (FSDP2)", nullptr, poison,
              [&] {
                auto flat_out = torch::empty({n * shard_numel}, torch::kFloat);
                auto flat_in = flat_out.narrow(0, rank * shard_numel, shard_numel);
                torch::cat_out(flat_in, shards);
                wait_released(fsdp::detail::all_gather_single(raw(pg), flat_out, flat_in));
                auto rows = flat_out.view({n, shard_numel});
                int64_t offset = 0;
                for (int i = 0; i < num_params; ++i) {
                  gathered[i].view({n, sizes[i]}).copy_(rows.narrow(1, offset, sizes[i]));
                  offset += sizes[i];
                }
              },
              check};
  std::vector<Method> methods{ours, flat};
  // Ours cut into buckets: Gloo stages each bucket in flat buffers of its own, so the
  // temporaries shrink to a few buckets; whether the smaller transfers also run faster is what
  // this row shows.
  const char letter[] = {'c', 'd', 'e', 'f'};
  for (size_t k = 0; k < bucket_mib.size() && k < std::size(letter); ++k) {
    const auto bytes = static_cast<int64_t>(bucket_mib[k] * kMiB);
    methods.push_back(
        {fmt::format("{}) fsdp all_gather, {:g} MiB buckets", letter[k], bucket_mib[k]), nullptr,
         poison, [&, bytes] { fsdp::all_gather(pg, shards, gathered, bytes)->wait(); }, check});
  }
  return measure(pg, methods, warmup, reps);
}

// Gloo may lack a native reduce-scatter in some torch versions; find out once, on a tiny buffer,
// before any measured call depends on it. An unsupported call throws before communicating, on
// every rank alike; the verdict is still agreed on, since ranks that picked different methods
// would deadlock.
bool gloo_has_reduce_scatter(fsdp::ProcessGroup& pg) {
  auto in = torch::ones({pg.size()}, torch::kFloat);
  auto out = torch::empty({1}, torch::kFloat);
  bool works = false;
  try {
    wait_released(
        fsdp::detail::reduce_scatter_single(raw(pg), out, in, c10d::ReduceScatterOptions()));
    works = out.item<float>() == static_cast<float>(pg.size());
  } catch (const std::exception&) {
  }
  auto broken = torch::tensor({works ? 0.0 : 1.0}, torch::kDouble);
  all_reduce_max(pg, broken);
  return broken.item<double>() == 0;
}

std::vector<Result> bench_reduce_scatter(fsdp::ProcessGroup& pg, int64_t shard_numel,
                                         bool native_rs, int warmup, int reps) {
  const int n = pg.size(), rank = pg.rank();
  const int64_t total = n * shard_numel;
  // Integers small enough that any summation order gives the same fp32 result, so every
  // method can be held to torch::equal.
  auto input = torch::arange(total, torch::kInt64).remainder_(1021).add_(rank).to(torch::kFloat);
  auto expected = torch::arange(rank * shard_numel, (rank + 1) * shard_numel, torch::kInt64)
                      .remainder_(1021)
                      .mul_(n)
                      .add_(n * (n - 1) / 2)
                      .to(torch::kFloat);
  auto output = torch::empty({shard_numel}, torch::kFloat);
  auto whole = torch::empty_like(input);  // the all-reduce works in place, on a copy
  auto poison = [&] { output.fill_(-1); };
  auto check = [&] { return torch::equal(output, expected); };

  // Sums everywhere: FSDP averages, but Gloo has no AVG op, and ours would add a division the
  // others lack.
  Method ours{"a) fsdp reduce_scatter (all-to-all + sum)", nullptr, poison,
              [&] { fsdp::reduce_scatter(pg, input, output, fsdp::ReduceOp::kSum)->wait(); },
              check};
  Method gloo;
  if (native_rs) {
    gloo = {"b) gloo reduce_scatter_single", nullptr, poison,
            [&] {
              torch::Tensor in = input;
              wait_released(fsdp::detail::reduce_scatter_single(raw(pg), output, in,
                                                                c10d::ReduceScatterOptions()));
            },
            check};
  } else {
    gloo = {"b) allreduce + copy of own chunk", nullptr, poison,
            [&] {
              std::vector<torch::Tensor> t{input.clone()};
              wait_released(raw(pg).allreduce(t));
              output.copy_(t[0].narrow(0, rank * shard_numel, shard_numel));
            },
            check};
  }
  Method all_reduce{
      "c) allreduce of the whole buffer", [&] { whole.copy_(input); },
      nullptr,  // prepare overwrites the whole buffer anyway
      [&] {
        std::vector<torch::Tensor> t{whole};
        wait_released(raw(pg).allreduce(t));
      },
      [&] { return torch::equal(whole.narrow(0, rank * shard_numel, shard_numel), expected); }};
  return measure(pg, {ours, gloo, all_reduce}, warmup, reps);
}

constexpr const char* kRowFormat =
    "{:<14} {:>8}  {:<42} {:>4}  {:>9}  {:>8}  {:>6}  {:>6}  {:>8}  {:>5}  {}\n";

void print_header() {
  fmt::print(fmt::runtime(kRowFormat), "op", "S_total", "method", "reps", "median ms", "min ms",
             "GB/s", "vs b", "peak MiB", "x S", "check");
}

void print_rows(const std::string& op, double size_mib, int64_t unit_bytes,
                const std::vector<Result>& results) {
  const double baseline_s = results.at(1).median_s;
  for (const auto& r : results) {
    fmt::print(fmt::runtime(kRowFormat), op, fmt::format("{:g} MiB", size_mib), r.name, r.reps,
               fmt::format("{:.2f}", r.median_s * 1e3), fmt::format("{:.2f}", r.min_s * 1e3),
               fmt::format("{:.2f}", unit_bytes / r.median_s / 1e9),
               fmt::format("{:.2f}x", baseline_s / r.median_s),
               fmt::format("{:.1f}", r.peak_bytes / kMiB),
               fmt::format("{:.2f}", static_cast<double>(r.peak_bytes) / unit_bytes),
               r.ok ? "ok" : "WRONG");
  }
}

// Other processes' load is the main source of noise on a shared machine; the figures are only
// comparable to others measured under similar load, so the report states it.
std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string one, five, fifteen;
  if (!(in >> one >> five >> fifteen)) {
    return "unknown";
  }
  return one + " " + five + " " + fifteen;
}

// ---- Replay: a training step's collectives alone ----------------------------------------------
//
// bench/bounds.py turns the flight-recorder dumps of a real fsdp-train run into one plan per
// rank (<dir>/rank<R>.plan) and runs this with --replay <dir>: the steps' collectives, issued in
// the recorded order with the recorded sizes, on groups with the same members and Gloo lanes,
// and nothing else: the communication-only step. A collective is waited for just before the
// first collective that the real run issued after that wait (the recorded times say which), so
// what was in flight together in the real step is in flight together here.
//
// Plan format, one item per line ('#' starts a comment):
//   group <name> <global ranks...>      every subgroup of the run, in creation order ("world/0")
//   step                                a new step
//   op <group> <kind> <bytes> <dtype> <reduce op or -> <root or -1> <waits...>
// kind: all-gather (bytes: the output), reduce-scatter (bytes: the input), all-reduce,
// broadcast, barrier; waits: the indices, within the step, of the collectives to wait for first.

struct ReplayOp {
  std::string group, kind, dtype, reduce;
  int64_t bytes = 0;
  int root = -1;
  std::vector<int> waits;
};

struct ReplayPlan {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  std::vector<std::vector<ReplayOp>> steps;
};

ReplayPlan read_plan(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    throw std::runtime_error("cannot read the replay plan " + path);
  ReplayPlan plan;
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (auto hash = line.find('#'); hash != std::string::npos)
      line.resize(hash);
    std::istringstream words(line);
    std::string head;
    if (!(words >> head))
      continue;
    auto bad = [&] {
      return std::runtime_error(fmt::format("{}:{}: cannot read '{}'", path, number, line));
    };
    if (head == "group") {
      std::pair<std::string, std::vector<int>> g;
      if (!(words >> g.first))
        throw bad();
      for (int r; words >> r;)
        g.second.push_back(r);
      if (g.second.empty())
        throw bad();
      plan.groups.push_back(std::move(g));
    } else if (head == "step") {
      plan.steps.emplace_back();
    } else if (head == "op") {
      ReplayOp op;
      if (plan.steps.empty() ||
          !(words >> op.group >> op.kind >> op.bytes >> op.dtype >> op.reduce >> op.root))
        throw bad();
      for (int w; words >> w;) {
        if (w < 0 || w >= static_cast<int>(plan.steps.back().size()))
          throw bad();
        op.waits.push_back(w);
      }
      plan.steps.back().push_back(std::move(op));
    } else {
      throw bad();
    }
  }
  return plan;
}

torch::ScalarType dtype_named(const std::string& name) {
  static const std::map<std::string, torch::ScalarType> names = {
      {"Float", torch::kFloat}, {"Double", torch::kDouble}, {"BFloat16", torch::kBFloat16},
      {"Half", torch::kHalf},   {"Long", torch::kLong},     {"Int", torch::kInt},
      {"Byte", torch::kByte},   {"Char", torch::kChar}};
  auto it = names.find(name);
  if (it == names.end())
    throw std::runtime_error("replay: unknown dtype " + name);
  return it->second;
}

fsdp::ReduceOp reduce_named(const std::string& name) {
  if (name == "sum")
    return fsdp::ReduceOp::kSum;
  if (name == "avg")
    return fsdp::ReduceOp::kAvg;
  if (name == "max")
    return fsdp::ReduceOp::kMax;
  if (name == "min")
    return fsdp::ReduceOp::kMin;
  throw std::runtime_error("replay: unknown reduce op " + name);
}

int replay(const std::string& dir, int lanes, double bucket_mib, int rounds,
           const std::string& out_path) {
  torch::set_num_threads(1);
  auto world = fsdp::init_process_group(fsdp::ProcessGroupOptions().gloo_lanes(lanes));
  const int me = world->rank();
  const ReplayPlan plan = read_plan(fmt::format("{}/rank{}.plan", dir, me));
  // The run's subgroups, created as the run created them: every member of a parent creates
  // each of the parent's subgroups, in order (new_group gives non-members nullptr).
  std::map<std::string, std::shared_ptr<fsdp::ProcessGroup>> groups{{"world", world}};
  for (const auto& [name, members] : plan.groups) {
    const auto slash = name.rfind('/');
    if (slash == std::string::npos)
      throw std::runtime_error("replay: group " + name + " has no parent");
    auto parent = groups.find(name.substr(0, slash));
    if (parent == groups.end())
      throw std::runtime_error("replay: the parent of group " + name +
                               " comes later or is missing");
    if (!parent->second)
      continue;  // not a member of the parent: not part of its new_group calls
    std::vector<int> ranks;
    const auto& globals = parent->second->global_ranks();
    for (int g : members) {
      auto pos = std::find(globals.begin(), globals.end(), g);
      if (pos == globals.end())
        throw std::runtime_error("replay: group " + name + " is not inside its parent");
      ranks.push_back(static_cast<int>(pos - globals.begin()));
    }
    std::sort(ranks.begin(), ranks.end());
    groups[name] = parent->second->new_group(ranks);
  }
  const int64_t bucket_bytes = std::llround(bucket_mib * kMiB);
  // Buffers, allocated and touched once: the k-th collective of a kind and size in a step uses
  // the same ones in every step (the trainer's caching allocator hands its buffers back too).
  std::map<std::string, std::vector<torch::Tensor>> buffers;
  auto buffers_for = [&](const ReplayOp& op, fsdp::ProcessGroup& g, int occurrence) {
    const std::string key =
        fmt::format("{} {} {} {} {}", op.group, op.kind, op.bytes, op.dtype, occurrence);
    auto& b = buffers[key];
    if (!b.empty())
      return b;
    const int n = g.size();
    if (op.kind == "all-gather") {
      b = {torch::zeros({op.bytes / n}, torch::kUInt8), torch::zeros({op.bytes}, torch::kUInt8)};
    } else if (op.kind == "reduce-scatter") {
      const auto dtype = dtype_named(op.dtype);
      const int64_t numel = op.bytes / c10::elementSize(dtype);
      b = {torch::zeros({numel}, dtype), torch::zeros({numel / n}, dtype)};
    } else if (op.kind == "all-reduce" || op.kind == "broadcast") {
      const auto dtype = dtype_named(op.dtype);
      b = {torch::zeros({op.bytes / static_cast<int64_t>(c10::elementSize(dtype))}, dtype)};
    }
    return b;
  };
  auto issue = [&](const ReplayOp& op, int occurrence) -> std::unique_ptr<fsdp::CollectiveWork> {
    auto& g = *groups.at(op.group);
    auto b = buffers_for(op, g, occurrence);
    if (op.kind == "all-gather")
      return fsdp::all_gather(g, {b[0]}, {b[1]}, bucket_bytes, "replay");
    if (op.kind == "reduce-scatter")
      return fsdp::reduce_scatter(g, b[0], b[1], reduce_named(op.reduce), "replay");
    if (op.kind == "all-reduce")
      return fsdp::all_reduce(g, b[0], reduce_named(op.reduce), "replay");
    if (op.kind == "broadcast")
      return fsdp::broadcast(g, b[0], op.root, "replay");
    if (op.kind == "barrier")
      return fsdp::barrier(g, "replay");
    throw std::runtime_error("replay: unknown collective " + op.kind);
  };
  auto run_step = [&](const std::vector<ReplayOp>& ops) {
    std::vector<std::unique_ptr<fsdp::CollectiveWork>> works(ops.size());
    std::map<std::string, int> seen;
    world->barrier();
    const auto start = Clock::now();
    for (size_t i = 0; i < ops.size(); ++i) {
      for (int w : ops[i].waits) {
        if (works[w])
          works[w]->wait();
      }
      const auto& op = ops[i];
      const int occurrence =
          seen[fmt::format("{} {} {} {}", op.group, op.kind, op.bytes, op.dtype)]++;
      works[i] = issue(op, occurrence);
    }
    for (auto& w : works)
      w->wait();
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  if (plan.steps.empty())
    throw std::runtime_error("replay: the plan has no step");
  run_step(plan.steps.front());  // untimed: connections and buffers warm
  const auto num = static_cast<int64_t>(plan.steps.size()) * rounds;
  auto times = torch::zeros({num}, torch::kDouble);
  int64_t k = 0;
  for (int r = 0; r < rounds; ++r) {
    for (const auto& ops : plan.steps)
      times[k++] = run_step(ops);
  }
  // A step lasts as long as its slowest rank's.
  all_reduce_max(*world, times);
  if (me == 0) {
    std::vector<double> v(times.data_ptr<double>(), times.data_ptr<double>() + num);
    std::vector<double> sorted = v;
    std::sort(sorted.begin(), sorted.end());
    const double median = sorted[sorted.size() / 2];
    size_t ops_per_step = 0;
    for (const auto& s : plan.steps)
      ops_per_step += s.size();
    std::string json = fmt::format(
        "{{\"ranks\": {}, \"steps\": {}, \"rounds\": {}, \"collectives_per_step\": {:.1f}, "
        "\"median_s\": {:.6f}, \"min_s\": {:.6f}, \"step_s\": [{:.6f}]}}\n",
        world->size(), plan.steps.size(), rounds,
        static_cast<double>(ops_per_step) / static_cast<double>(plan.steps.size()), median,
        sorted.front(), fmt::join(v, ", "));
    fmt::print("{}", json);
    if (!out_path.empty()) {
      std::ofstream(out_path) << json;
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Time fsdp-cpp's collectives against the alternatives (one rank; use torchrun)"};
  std::vector<double> sizes_mib{1, 4, 16, 64};
  std::vector<double> bucket_mib{1, 4};
  int reps = 0, warmup = 2, num_params = 8;
  double rep_budget_mib = 1024;
  std::string ops = "all";
  app.add_option("--sizes-mib", sizes_mib, "unsharded unit sizes S_total, MiB of fp32");
  app.add_option("--reps", reps, "timed repetitions per method; 0: rep-budget / size, in [5, 40]");
  app.add_option("--rep-budget-mib", rep_budget_mib, "MiB per method that sets reps when --reps 0");
  app.add_option("--bucket-mib", bucket_mib, "all-gather bucket sizes to compare (up to 4)");
  app.add_option("--warmup", warmup, "untimed repetitions before timing");
  app.add_option("--params", num_params, "parameters per unit (all-gather)")
      ->check(CLI::Range(1, 1000));
  app.add_option("--ops", ops, "all, all-gather or reduce-scatter")
      ->check(CLI::IsMember({"all", "all-gather", "reduce-scatter"}));
  std::string replay_dir, replay_out;
  int replay_lanes = 2, replay_rounds = 1;
  double replay_bucket_mib = 4;
  app.add_option("--replay", replay_dir,
                 "replay the plans <dir>/rank<R>.plan (bench/bounds.py writes them from a run's "
                 "flight recorder) and print the communication-only step time");
  app.add_option("--replay-lanes", replay_lanes, "replay: Gloo lanes (fsdp.gloo_lanes)");
  app.add_option("--replay-bucket-mib", replay_bucket_mib,
                 "replay: all-gather bucket size (fsdp.all_gather_bucket_mb)");
  app.add_option("--replay-rounds", replay_rounds, "replay: times every step is replayed")
      ->check(CLI::Range(1, 1000));
  app.add_option("--replay-out", replay_out, "replay: also write the result (JSON) here");
  CLI11_PARSE(app, argc, argv);
  if (!replay_dir.empty()) {
    try {
      return replay(replay_dir, replay_lanes, replay_bucket_mib, replay_rounds, replay_out);
    } catch (const std::exception& e) {
      fmt::print(stderr, "bench_collectives --replay: {}\n", e.what());
      return 1;
    }
  }

  try {
    fsdp::memory::install_tracking_allocator();
    torch::set_num_threads(1);  // one core per rank, as in training
    auto pg = fsdp::init_process_group();
    const int n = pg->size();
    const bool native_rs = gloo_has_reduce_scatter(*pg);
    if (pg->rank() == 0) {
      fmt::print(
          "fsdp-cpp collectives: {} ranks on {}, torch {}.{}.{}, fp32, {} parameters per unit, "
          "{} hardware threads\n",
          n, pg->backend_name(), TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH,
          num_params, std::thread::hardware_concurrency());
      fmt::print("gloo reduce_scatter_single: {}; load average at start: {}\n",
                 native_rs ? "supported" : "unsupported (b = allreduce + copy)", load_average());
      fmt::print(
          "times: slowest rank per rep, then median and min over reps; GB/s = S_total / median; "
          "vs b = median(b) / median; peak: tensor bytes above baseline, max over ranks\n\n");
      print_header();
    }
    for (double mib : sizes_mib) {
      const int64_t shard_numel =
          std::max<int64_t>(num_params, static_cast<int64_t>(mib * kMiB / 4) / n);
      const int64_t unit_bytes = shard_numel * n * 4;
      const int r =
          reps > 0 ? reps : std::clamp(static_cast<int>(std::lround(rep_budget_mib / mib)), 5, 40);
      if (ops != "reduce-scatter") {
        auto results = bench_all_gather(*pg, shard_numel, num_params, bucket_mib, warmup, r);
        if (pg->rank() == 0) {
          print_rows("all-gather", mib, unit_bytes, results);
        }
      }
      if (ops != "all-gather") {
        auto results = bench_reduce_scatter(*pg, shard_numel, native_rs, warmup, r);
        if (pg->rank() == 0) {
          print_rows("reduce-scatter", mib, unit_bytes, results);
        }
      }
    }
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_collectives: {}\n", e.what());
    return 1;
  }
}
