// fsdp-plan --auto: every point of the search space predicted, the fastest that fit printed
// with a TOML snippet each (train/auto_config.h). See plan_commands.h.
#include "plan_commands.h"
#include "program_file.h"

#include <fmt/core.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <ATen/Parallel.h>
#include <cstdio>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <fsdp/core/memory.h>

#include "train/auto_config.h"
#include "train/machine_calibration.h"
#include "train/optimizer_factory.h"
#include "train/step_plan.h"

namespace fsdp_trainer {
namespace {

namespace mem = fsdp::memory;
namespace plan = fsdp::plan;

// Seconds of the configured optimizer's step (clipping aside) per byte of fp32 parameter shard,
// timed on 4M elements here.
double optimizer_seconds_per_byte(Config config) {
  config.optimizer.offload = "none";  // its file I/O is predicted from the disk's rates
  constexpr int64_t kElements = int64_t{1} << 22;
  auto p = torch::zeros({kElements}).requires_grad_();
  p.mutable_grad() = torch::full_like(p, 1e-3);
  auto opt = fsdp_trainer::make_optimizer(config, {p}, {});
  opt->step();
  const auto start = std::chrono::steady_clock::now();
  constexpr int kRuns = 3;
  for (int i = 0; i < kRuns; ++i)
    opt->step();
  const double s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / kRuns;
  return s / static_cast<double>(kElements * 4);
}

}  // namespace

// --json: every configuration considered, with its prediction by phase.
void write_candidates_json(const std::string& path, const std::vector<Candidate>& all) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& c : all) {
    j.push_back({{"overrides", c.overrides},
                 {"peak", c.peak},
                 {"moment", c.moment},
                 {"step_s", c.time.step_s},
                 {"phases",
                  {{"forward", c.time.forward_s},
                   {"backward", c.time.backward_s},
                   {"recompute", c.time.recompute_s},
                   {"all_gather_exposed", c.time.all_gather_exposed_s},
                   {"reduce_exposed", c.time.reduce_exposed_s},
                   {"optimizer", c.time.optimizer_s},
                   {"offload", c.time.offload_s},
                   {"overhead", c.time.overhead_s},
                   {"tensor_parallel", c.time.tp_s}}},
                 {"tp_bytes", c.time.tp_bytes},
                 {"tokens_per_s", c.tokens_per_s},
                 {"fits", c.fits}});
  }
  std::ofstream(path) << j.dump(1) << "\n";
}

// The search's answer: the fitting configurations, fastest first, each with its TOML.
void print_fitting(const PlanRequest& request, const Config& config, const RunPlans& runs,
                   size_t considered, const std::vector<const Candidate*>& fitting) {
  const auto* device = request.device;
  std::printf(
      "fsdp-plan --auto: %s on %d rank(s)%s, global batch %lld x %lld tokens, budget %s "
      "(predicted peak + %.0f%%), %zu configurations predicted%s\n",
      request.finetune ? config.finetune.model.c_str()
                       : (config.model.arch + " " + config.model.preset).c_str(),
      request.world, device ? (" of " + device->description).c_str() : " on this machine",
      (long long)request.global_batch, (long long)runs.begin()->second.options.seq_len,
      mem::format_bytes(request.budget).c_str(), 100 * request.margin, considered,
      device ? fmt::format(", time at {:.0f}% of the data sheet's matmul rate",
                           100 * request.efficiency)
                   .c_str()
             : "");
  std::printf("%-3s %12s %10s %12s  %-20s %s\n", "#", "tokens/s", "step s", "peak", "moment",
              "tp / strategy / AC / dtype / gather / offload / micro-batches");
  for (size_t i = 0; i < fitting.size(); ++i) {
    const auto& c = *fitting[i];
    const auto& k = c.knobs;
    const int64_t rows = request.global_batch / (request.world / k.tp);
    std::printf("%-3zu %12.0f %10.4f %12s  %-20s %lld / %s%s / %s%s / %s / %s / %s / %lld x %lld\n",
                i + 1, c.tokens_per_s, c.time.step_s, mem::format_bytes(c.peak).c_str(),
                c.moment.c_str(), (long long)k.tp, k.strategy.c_str(),
                k.reshard_size ? fmt::format("/{}", k.reshard_size).c_str() : "", k.ac.c_str(),
                k.ac_every > 1 ? fmt::format("/{}", k.ac_every).c_str() : "", k.dtype.c_str(),
                k.gather.c_str(), k.offload.c_str(), (long long)k.micro_batches,
                (long long)(rows / k.micro_batches));
  }
  for (size_t i = 0; i < fitting.size(); ++i) {
    std::printf("\n# %zu: %.0f tokens/s, peak %s per rank (predicted)\n%s", i + 1,
                fitting[i]->tokens_per_s, mem::format_bytes(fitting[i]->peak).c_str(),
                toml_snippet(*fitting[i]).c_str());
  }
}

int plan_auto(PlanRequest request) {
  auto& config = request.config;
  const int world = request.world, per_node = request.per_node;
  const auto* device = request.device;
  const int64_t budget = request.budget, global_batch = request.global_batch;
  const auto& budget_key = request.budget_key;
  const auto& model_file = request.model_file;
  const int64_t other = request.other;
  const double margin = request.margin, efficiency = request.efficiency;
  const int top = request.top;
  const auto& json_path = request.json_path;
  auto log = [](const std::string& line) { std::printf("%s\n", line.c_str()); };
  // The notes wait until there is a result: a search that fails says one line.
  std::vector<std::string> notes;
  auto note = [&notes](const std::string& line) { notes.push_back(line); };
  config.training.micro_batches = 1;
  auto space = default_space(world, per_node, global_batch, device != nullptr,
                             config.optimizer.name != "adamw");
  for (const auto& spec : request.space)
    restrict_space(space, spec);
  // Every dtype's and tensor-parallel degree's run: its units, activations and (on this
  // machine) its pieces to time, at the rows a data-parallel rank takes there.
  RunPlans runs;
  for (const auto& tp_value : space.values.at("tp")) {
    const int tp = std::stoi(tp_value);
    for (const auto& dtype : space.values.at("dtype")) {
      auto c = config;
      c.precision.param_dtype = dtype;
      c.parallel.tp = tp;
      c.training.batch_size = global_batch / (world / tp);
      // Timed as the ranks of this machine run: as many at once as will share its cores.
      const int together =
          std::max(1, std::min(per_node, static_cast<int>(std::thread::hardware_concurrency())));
      try {
        validate(c);
        validate_world(c, world, per_node);
        auto run = plan_run(c, c.data.vocab_size, model_file, world, per_node, dtype, other,
                            /*time_compute=*/device == nullptr, nullptr, together, plan_progress);
        if (device)
          run.options.gloo_staging = run.options.gloo_reduce_scatter = false;
        runs.emplace(std::make_pair(dtype, int64_t{tp}), std::move(run));
      } catch (const std::exception& e) {
        if (tp == 1)
          throw;
        // A degree the model (or the config) does not go with: searched without it.
        const std::string why = e.what();
        note(fmt::format("parallel.tp = {} left out: {}", tp, why.substr(0, why.find('\n'))));
      }
    }
  }
  if (runs.empty()) {
    throw ConfigError("no tensor-parallel degree of the search space goes with this job: " +
                      (notes.empty() ? std::string("none left") : notes.front()));
  }
  TimeInputsFor timing;
  if (device) {
    timing = device_time(*device, efficiency, per_node, model_piece_flops(config));
  } else {
    const auto profile = machine_profile(request.cache_dir, std::min(world, per_node),
                                         program_file(), request.recalibrate, note);
    timing = machine_time(profile, per_node, optimizer_seconds_per_byte(config));
  }
  const auto all = search_configs(runs, space, world, per_node, global_batch, budget, margin,
                                  timing, device != nullptr);
  if (all.empty()) {
    throw ConfigError(fmt::format(
        "no point of the search space is valid for {} rank(s), {} per node, global batch {} (a "
        "strategy, reshard size or micro-batch count that the data-parallel ranks do not allow "
        "at every tp searched: widen --space)",
        world, per_node, global_batch));
  }
  if (!json_path.empty())
    write_candidates_json(json_path, all);
  std::vector<const Candidate*> fitting;
  const Candidate* smallest = &all.front();
  for (const auto& c : all) {
    if (c.fits && static_cast<int>(fitting.size()) < top)
      fitting.push_back(&c);
    if (c.peak < smallest->peak)
      smallest = &c;
  }
  if (fitting.empty()) {
    std::fprintf(stderr,
                 "fsdp-plan: no configuration fits %s = %s: the smallest predicted peak is %s "
                 "(%s)\n",
                 budget_key.c_str(), mem::format_bytes(budget).c_str(),
                 mem::format_bytes(smallest->peak).c_str(),
                 fmt::format("{}", fmt::join(smallest->overrides, " ")).c_str());
    return 2;
  }
  for (const auto& line : notes)
    log(line);
  print_fitting(request, config, runs, all.size(), fitting);
  return 0;
}

}  // namespace fsdp_trainer
