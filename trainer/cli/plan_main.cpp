// fsdp-plan: what an fsdp-train configuration will hold per rank and how fast it will run,
// before running it; and which configuration to run.
//
//   fsdp-plan [CONFIG.toml] --world N [--nproc-per-node M] [--finetune] [--budget 16GiB]
//             [--hardware NAME [--efficiency E]] [--section.key=value ...]
//   fsdp-plan [CONFIG.toml] --world N --auto --budget 16GiB --global-batch B [--top 5]
//             [--margin 0.05] [--space DIM=V1,V2 ...] [--json FILE] [--hardware NAME]
//   fsdp-plan --calibrate --world N
//
// Reads the configuration as fsdp-train does (the same keys, overrides and errors), builds the
// model on the meta device, calibrates its activations on a one-block model of the same widths
// (a second or two), and prints each rank's predicted peak by fsdp::memory category with its
// moment (docs/design.md, "Planning"). With a budget: exit 2 when even the model states do not
// fit, a warning naming a change that fits when the peak does not. --hardware predicts for a
// GPU of a built-in data-sheet profile (NCCL, memory bound by its size) and adds the step time
// that hardware allows. --auto searches the space of fsdp-train's knobs for the highest
// predicted tokens/s that fits the budget (docs/planner.md); on this machine its times stand on
// the machine profile (--calibrate; measured once and cached) and the pieces timed here.
//
// Exit codes: 0 done, 2 bad input (config, world size, budget, nothing fits), 1 anything else.
#include <fmt/core.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <fsdp/core/memory.h>

#include "config/config.h"
#include "data/finetune_data.h"
#include "plan_pieces.h"
#include "train/auto_config.h"
#include "train/compute_dtype.h"
#include "train/machine_calibration.h"
#include "train/matmul_speed.h"
#include "train/model_factory.h"
#include "train/optimizer_factory.h"
#include "train/step_plan.h"

namespace {

namespace mem = fsdp::memory;

std::string first_line(const std::string& s) {
  return s.substr(0, s.find('\n'));
}

// precision.param_dtype resolved as fsdp-train resolves it, from this machine's matmul speeds.
std::string compute_dtype(const fsdp_trainer::Config& config) {
  using namespace fsdp_trainer;
  const auto& requested = config.precision.param_dtype;
  DtypeSpeeds speeds;
  if (needs_dtype_speeds(requested, /*cuda=*/false)) {
    const MatmulShape shape{256, 512, 1024};
    speeds.shape = fmt::format("{}x{}x{}", shape.m, shape.k, shape.n);
    speeds.fp32 = measure_matmul_speed(torch::kFloat, shape).step();
    speeds.low = measure_matmul_speed(dtype_named(candidate_dtype(requested)), shape).step();
  }
  return choose_compute_dtype(requested, /*cuda=*/false, speeds).dtype;
}

namespace plan = fsdp::plan;
using fsdp_trainer::Config;
using fsdp_trainer::ConfigError;

// The FLOPs of a micro-batch through each piece of the configured model (data-sheet timing).
std::function<plan::PieceFlops(int64_t, int64_t)> model_flops(const Config& config) {
  if (config.finetuning)
    throw ConfigError("--hardware predicts pretraining runs (fsdp-train, not finetune)");
  if (config.model.arch == "gpt") {
    const auto cfg = fsdp_trainer::gpt_config(config, config.data.vocab_size);
    return [cfg](int64_t b, int64_t t) { return fsdp_models::piece_flops(cfg, b, t); };
  }
  const auto cfg = fsdp_trainer::llama_config(config, config.data.vocab_size);
  return [cfg](int64_t b, int64_t t) { return fsdp_models::piece_flops(cfg, b, t); };
}

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

std::string describe_time(const plan::TimePrediction& t, double tokens) {
  return fmt::format(
      "step {:.4g} s ({:.0f} tokens/s): forward {:.4g} s, backward {:.4g} s (recompute {:.4g}), "
      "exposed all-gather {:.4g} s, exposed reduce {:.4g} s, optimizer {:.4g} s, offload I/O "
      "{:.4g} s; per step all-gather {}, reduce-scatter {}, all-reduce {}",
      t.step_s, tokens / t.step_s, t.forward_s, t.backward_s, t.recompute_s, t.all_gather_exposed_s,
      t.reduce_exposed_s, t.optimizer_s, t.offload_s, mem::format_bytes(t.all_gather_bytes),
      mem::format_bytes(t.reduce_scatter_bytes), mem::format_bytes(t.all_reduce_bytes));
}

}  // namespace

int main(int argc, char** argv) {
  // A rank of --calibrate's Gloo measurement.
  if (argc == 3 && std::string(argv[1]) == "--calibration-rank")
    return fsdp_trainer::run_calibration_rank(argv[2]);
  mem::install_tracking_allocator();
  CLI::App app{
      "fsdp-plan: the per-rank memory and step time of an fsdp-train configuration, "
      "predicted; and the configuration that fits a budget fastest"};
  app.allow_extras();
  std::string config_path, budget_text, hardware, json_path, cache_dir;
  std::vector<std::string> space_specs;
  int world = 0, per_node = 0, top = 5;
  int64_t global_batch = 0;
  double margin = 0.05, efficiency = 1.0;
  bool finetune = false, automatic = false, calibrate = false;
  app.add_option("config", config_path, "TOML configuration file (defaults apply without one)");
  app.add_option("--world", world, "Ranks in the job")->required()->check(CLI::Range(1, 65536));
  app.add_option("--nproc-per-node", per_node,
                 "Ranks per node (hybrid_shard's default group); default: --world")
      ->check(CLI::Range(1, 65536));
  app.add_flag("--finetune", finetune, "The configuration is fsdp-train finetune's");
  app.add_option("--budget", budget_text,
                 "Memory each rank may use (e.g. 16GiB); default: training.memory_budget, or "
                 "the --hardware device's memory");
  app.add_option("--hardware", hardware,
                 "Predict for a GPU of a built-in data-sheet profile: a100-40gb, a100-80gb, "
                 "h100-80gb, l40s, rtx-4090");
  app.add_option("--efficiency", efficiency,
                 "With --hardware: the fraction of the data sheet's matmul rate reached (1: the "
                 "bound the hardware allows)")
      ->check(CLI::Range(0.01, 1.0));
  app.add_flag("--auto", automatic,
               "Search fsdp-train's knobs for the highest predicted tokens/s within --budget");
  app.add_option("--global-batch", global_batch,
                 "--auto: sequences per optimizer step over all ranks")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  app.add_option("--top", top, "--auto: how many configurations to print")
      ->check(CLI::Range(1, 1000));
  app.add_option("--margin", margin,
                 "--auto: predicted peak x (1 + margin) must fit the budget (default 0.05)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--space", space_specs,
                 "--auto: keep only these values of a dimension, e.g. ac=none,full (strategy, "
                 "ac, dtype, gather, offload, micro_batches)");
  app.add_option("--json", json_path, "--auto: write every configuration considered here");
  app.add_flag("--calibrate", calibrate,
               "Measure this machine again (matmuls, Gloo for 2..--world ranks, memcpy, disk) "
               "and cache the profile");
  app.add_option("--cache-dir", cache_dir,
                 "Where machine profiles are cached (default $FSDP_CACHE_DIR or "
                 "~/.cache/fsdp-cpp)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "fsdp-plan: %s\n", first_line(e.what()).c_str());
    return 2;
  }
  std::vector<std::string> overrides;
  for (const auto& extra : app.remaining()) {
    if (extra.rfind("--", 0) != 0) {
      std::fprintf(stderr, "fsdp-plan: unexpected argument '%s'\n", extra.c_str());
      return 2;
    }
    overrides.push_back(extra.substr(2));
  }
  if (per_node == 0)
    per_node = world;
  if (cache_dir.empty())
    cache_dir = fsdp_trainer::default_cache_dir();
  auto log = [](const std::string& line) { std::printf("%s\n", line.c_str()); };
  // --auto's notes wait until there is a result: a search that fails says one line.
  std::vector<std::string> notes;
  auto note = [&notes](const std::string& line) { notes.push_back(line); };
  try {
    using namespace fsdp_trainer;
    if (calibrate && !automatic) {
      machine_profile(cache_dir, std::min(world, per_node), "/proc/self/exe", true, log);
      return 0;
    }
    auto config = load_config(config_path, overrides, finetune);
    validate_world(config, world, per_node);
    const plan::DeviceProfile* device = nullptr;
    if (!hardware.empty()) {
      try {
        device = &plan::builtin_device(hardware);
      } catch (const std::exception& e) {
        throw ConfigError("--hardware: " + first_line(e.what()));
      }
    } else if (config.training.device != "cpu") {
      throw ConfigError(
          "fsdp-plan models CPU runs on this machine, or GPUs with --hardware; "
          "'training.device' = '" +
          config.training.device + "'");
    }
    if (device && world > per_node && device->inter_node_bytes_per_s <= 0)
      throw ConfigError("--hardware " + hardware +
                        ": the profile describes no multi-node system (--world > "
                        "--nproc-per-node)");
    std::string budget_key = budget_text.empty() ? "training.memory_budget" : "--budget";
    if (budget_text.empty())
      budget_text = config.training.memory_budget;
    int64_t budget = budget_text.empty() ? 0 : parse_bytes(budget_text, budget_key);
    if (budget == 0 && device) {
      budget = device->memory_bytes;
      budget_key = hardware + "'s memory";
    }
    if (automatic) {
      if (global_batch <= 0)
        throw ConfigError("--auto needs --global-batch (sequences per step over all ranks)");
      if (budget <= 0)
        throw ConfigError("--auto needs --budget (or training.memory_budget, or --hardware)");
      if (global_batch % world != 0)
        throw ConfigError(
            fmt::format("--global-batch {} is not a multiple of --world {}", global_batch, world));
    }
    const std::string gguf = finetune ? resolve_model_file(config.finetune.model) : "";
    const auto& t = config.training;
    // What fsdp-train keeps outside the model through a step: its held-out batches.
    const int64_t other = finetune ? 0 : t.eval_batches * t.batch_size * (t.seq_len + 1) * 8;
    at::set_num_threads(static_cast<int>(t.threads));

    if (automatic) {
      config.training.batch_size = global_batch / world;
      config.training.micro_batches = 1;
      auto space = default_space(world, per_node, config.training.batch_size, device != nullptr,
                                 config.optimizer.name != "adamw");
      for (const auto& spec : space_specs)
        restrict_space(space, spec);
      // Every dtype's run: its units, activations and (on this machine) its pieces to time.
      std::map<std::string, RunPlan> runs;
      for (const auto& dtype : space.values.at("dtype")) {
        auto c = config;
        c.precision.param_dtype = dtype;
        // Timed as the ranks of this machine run: as many at once as will share its cores.
        const int together =
            std::max(1, std::min(per_node, static_cast<int>(std::thread::hardware_concurrency())));
        runs[dtype] = plan_run(c, c.data.vocab_size, gguf, world, per_node, dtype, other,
                               /*time_compute=*/device == nullptr, nullptr, together);
        if (device)
          runs[dtype].options.gloo_staging = runs[dtype].options.gloo_reduce_scatter = false;
      }
      TimeInputsFor timing;
      if (device) {
        timing = device_time(*device, efficiency, per_node, model_flops(config));
      } else {
        const auto profile = machine_profile(cache_dir, std::min(world, per_node), "/proc/self/exe",
                                             calibrate, note);
        timing = machine_time(profile, per_node, optimizer_seconds_per_byte(config));
      }
      const auto all = search_configs(config, runs, space, world, per_node, budget, margin, timing,
                                      device != nullptr);
      if (!json_path.empty()) {
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
                         {"overhead", c.time.overhead_s}}},
                       {"tokens_per_s", c.tokens_per_s},
                       {"fits", c.fits}});
        }
        std::ofstream(json_path) << j.dump(1) << "\n";
      }
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
      std::printf(
          "fsdp-plan --auto: %s on %d rank(s)%s, global batch %lld x %lld tokens, budget %s "
          "(predicted peak + %.0f%%), %zu configurations predicted%s\n",
          finetune ? config.finetune.model.c_str()
                   : (config.model.arch + " " + config.model.preset).c_str(),
          world, device ? (" of " + device->description).c_str() : " on this machine",
          (long long)global_batch, (long long)runs.begin()->second.options.seq_len,
          mem::format_bytes(budget).c_str(), 100 * margin, all.size(),
          device
              ? fmt::format(", time at {:.0f}% of the data sheet's matmul rate", 100 * efficiency)
                    .c_str()
              : "");
      std::printf("%-3s %12s %10s %12s  %-20s %s\n", "#", "tokens/s", "step s", "peak", "moment",
                  "strategy / AC / dtype / gather / offload / micro-batches");
      for (size_t i = 0; i < fitting.size(); ++i) {
        const auto& c = *fitting[i];
        const auto& k = c.knobs;
        std::printf("%-3zu %12.0f %10.4f %12s  %-20s %s%s / %s%s / %s / %s / %s / %lld x %lld\n",
                    i + 1, c.tokens_per_s, c.time.step_s, mem::format_bytes(c.peak).c_str(),
                    c.moment.c_str(), k.strategy.c_str(),
                    k.reshard_size ? fmt::format("/{}", k.reshard_size).c_str() : "", k.ac.c_str(),
                    k.ac_every > 1 ? fmt::format("/{}", k.ac_every).c_str() : "", k.dtype.c_str(),
                    k.gather.c_str(), k.offload.c_str(), (long long)k.micro_batches,
                    (long long)(config.training.batch_size / k.micro_batches));
      }
      for (size_t i = 0; i < fitting.size(); ++i) {
        std::printf("\n# %zu: %.0f tokens/s, peak %s per rank (predicted)\n%s", i + 1,
                    fitting[i]->tokens_per_s, mem::format_bytes(fitting[i]->peak).c_str(),
                    toml_snippet(*fitting[i]).c_str());
      }
      return 0;
    }

    const auto dtype = device
                           ? (config.precision.param_dtype == "auto" ? std::string("bf16")
                                                                     : config.precision.param_dtype)
                           : compute_dtype(config);
    auto run = plan_run(config, config.data.vocab_size, gguf, world, per_node, dtype, other);
    if (device)
      run.options.gloo_staging = run.options.gloo_reduce_scatter = false;
    std::vector<fsdp::plan::MemoryPrediction> predictions;
    int worst_rank = 0;
    for (int r = 0; r < world; ++r) {
      predictions.push_back(
          fsdp::plan::predict_step_memory(run.units, run.options, run.activations, r));
      // On a GPU, CPU offload keeps the model states in host memory.
      if (device && run.options.states.cpu_offload)
        predictions.back() = fsdp::plan::device_side(predictions.back());
      if (predictions.back().peak > predictions[static_cast<size_t>(worst_rank)].peak)
        worst_rank = r;
    }
    const auto& worst = predictions[static_cast<size_t>(worst_rank)];
    const bool states_on_host = device && run.options.states.cpu_offload;
    if (states_on_host) {
      std::printf(
          "CPU offload: each rank's model states, %s, live in host memory; the table is "
          "the device's\n",
          mem::format_bytes(worst.states.total()).c_str());
    }
    if (budget > 0 && !states_on_host && budget < worst.states.total()) {
      std::fprintf(stderr,
                   "fsdp-plan: %s = %s is below rank %d's model states alone (%s: parameters "
                   "%s, gradients %s, optimizer state %s)\n",
                   budget_key.c_str(), mem::format_bytes(budget).c_str(), worst_rank,
                   mem::format_bytes(worst.states.total()).c_str(),
                   mem::format_bytes(worst.states.params).c_str(),
                   mem::format_bytes(worst.states.grads).c_str(),
                   mem::format_bytes(worst.states.optimizer).c_str());
      return 2;
    }
    std::printf(
        "fsdp-plan: %s on %d rank(s)%s, %s, compute %s, %lld x %lld tokens per micro-batch, "
        "%d micro-batch(es)%s\n",
        finetune ? config.finetune.model.c_str()
                 : (config.model.arch + " " + config.model.preset).c_str(),
        world, device ? (" of " + device->description).c_str() : "", config.fsdp.strategy.c_str(),
        dtype.c_str(), (long long)run.options.batch_rows, (long long)run.options.seq_len,
        run.options.micro_batches,
        finetune ? " (the longest conversation finetune.max_tokens allows)" : "");
    std::printf("%-6s %12s  %-20s", "rank", "peak", "moment");
    for (int c = 1; c <= mem::kNumCategories; ++c)
      std::printf(" %20s", mem::to_string(static_cast<mem::Category>(c % mem::kNumCategories)));
    std::printf("\n");
    // Ranks differ only by the padding of the last shard: print each different row once.
    std::map<std::vector<int64_t>, std::vector<int>> rows;
    for (int r = 0; r < world; ++r) {
      const auto& p = predictions[static_cast<size_t>(r)];
      std::vector<int64_t> key(p.at_peak.bytes.begin(), p.at_peak.bytes.end());
      key.push_back(p.peak);
      auto& ranks = rows[key];
      if (ranks.empty()) {
        std::printf("%-6d %12s  %-20s", r, mem::format_bytes(p.peak).c_str(),
                    fsdp::plan::moment_label(p.moment).c_str());
        for (int c = 1; c <= mem::kNumCategories; ++c)
          std::printf(" %20s", mem::format_bytes(p.at_peak.bytes[c % mem::kNumCategories]).c_str());
        std::printf("\n");
      }
      ranks.push_back(r);
    }
    if (rows.size() < static_cast<size_t>(world))
      std::printf("(the other ranks predict the same as the row above them)\n");
    if (worst.peak_without_staging != worst.peak) {
      std::printf(
          "Gloo's staging buffers for a gather in flight are counted; without them rank "
          "%d's peak is %s.\n",
          worst_rank, mem::format_bytes(worst.peak_without_staging).c_str());
    }
    if (device) {
      const auto time = plan::predict_step_time(
          run.units, run.options,
          device_time(*device, efficiency, per_node, model_flops(config))(run, run.options, {}),
          worst_rank);
      const double tokens = static_cast<double>(world * t.batch_size * run.options.seq_len);
      std::printf("time on %s at %.0f%% of its matmul rate: %s\n", hardware.c_str(),
                  100 * efficiency, describe_time(time, tokens).c_str());
    }
    if (budget > 0) {
      if (worst.peak > budget) {
        std::printf("over budget: rank %d: %s\n", worst_rank,
                    budget_warning(run, worst, budget, worst_rank, budget_key).c_str());
      } else {
        std::printf("fits: the highest predicted peak, %s (rank %d), is %.0f%% of %s\n",
                    mem::format_bytes(worst.peak).c_str(), worst_rank,
                    100.0 * static_cast<double>(worst.peak) / static_cast<double>(budget),
                    mem::format_bytes(budget).c_str());
      }
    }
    return 0;
  } catch (const fsdp_trainer::ConfigError& e) {
    std::fprintf(stderr, "fsdp-plan: config error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp-plan: %s\n", first_line(e.what()).c_str());
    return 1;
  }
}
