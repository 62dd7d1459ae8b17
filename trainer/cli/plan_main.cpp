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
#include <ATen/Parallel.h>
#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include <fsdp/core/memory.h>
#include <fsdp/plan/hardware.h>

#include "config/config.h"
#include "data/finetune_data.h"
#include "plan_commands.h"
#include "plan_main.h"
#include "program_file.h"
#include "train/machine_calibration.h"

namespace {

std::string first_line(const std::string& s) {
  return s.substr(0, s.find('\n'));
}

}  // namespace

namespace {

// fsdp-plan's command line.
struct PlanCommandLine {
  std::string config_path, budget_text, hardware, json_path, cache_dir;
  std::vector<std::string> space_specs, overrides;  // overrides: section.key=value
  int world = 0, per_node = 0, top = 5;
  int64_t global_batch = 0;
  double margin = 0.05, efficiency = 1.0;
  bool finetune = false, automatic = false, calibrate = false;
};

// Parses the command line into `cl`; returns an exit code when there is nothing more to do
// (help, or bad usage: one line, exit 2).
std::optional<int> parse_command_line(int argc, char** argv, PlanCommandLine& cl) {
  CLI::App app{
      "fsdp-plan: the per-rank memory and step time of an fsdp-train configuration, "
      "predicted; and the configuration that fits a budget fastest"};
  app.allow_extras();
  app.add_option("config", cl.config_path, "TOML configuration file (defaults apply without one)");
  app.add_option("--world", cl.world, "Ranks in the job")->required()->check(CLI::Range(1, 65536));
  app.add_option("--nproc-per-node", cl.per_node,
                 "Ranks per node (hybrid_shard's default group); default: --world")
      ->check(CLI::Range(1, 65536));
  app.add_flag("--finetune", cl.finetune, "The configuration is fsdp-train finetune's");
  app.add_option("--budget", cl.budget_text,
                 "Memory each rank may use (e.g. 16GiB); default: training.memory_budget, or "
                 "the --hardware device's memory");
  app.add_option("--hardware", cl.hardware,
                 "Predict for a GPU of a built-in data-sheet profile: a100-40gb, a100-80gb, "
                 "h100-80gb, l40s, rtx-4090");
  app.add_option("--efficiency", cl.efficiency,
                 "With --hardware: the fraction of the data sheet's matmul rate reached (1: the "
                 "bound the hardware allows)")
      ->check(CLI::Range(0.01, 1.0));
  app.add_flag("--auto", cl.automatic,
               "Search fsdp-train's knobs for the highest predicted tokens/s within --budget");
  app.add_option("--global-batch", cl.global_batch,
                 "--auto: sequences per optimizer step over all ranks")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  app.add_option("--top", cl.top, "--auto: how many configurations to print")
      ->check(CLI::Range(1, 1000));
  app.add_option("--margin", cl.margin,
                 "--auto: predicted peak x (1 + margin) must fit the budget (default 0.05)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--space", cl.space_specs,
                 "--auto: keep only these values of a dimension, e.g. ac=none,full (strategy, "
                 "ac, dtype, gather, offload, micro_batches)");
  app.add_option("--json", cl.json_path, "--auto: write every configuration considered here");
  app.add_flag("--calibrate", cl.calibrate,
               "Measure this machine again (matmuls, Gloo for 2..--world ranks, memcpy, disk) "
               "and cache the profile");
  app.add_option("--cache-dir", cl.cache_dir,
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
  for (const auto& extra : app.remaining()) {
    if (extra.rfind("--", 0) != 0) {
      std::fprintf(stderr, "fsdp-plan: unexpected argument '%s'\n", extra.c_str());
      return 2;
    }
    cl.overrides.push_back(extra.substr(2));
  }
  if (cl.per_node == 0)
    cl.per_node = cl.world;
  if (cl.cache_dir.empty())
    cl.cache_dir = fsdp_trainer::default_cache_dir();
  return std::nullopt;
}

// The configuration and the command line's checks, as the planner's request (ConfigError on
// bad input).
fsdp_trainer::PlanRequest make_request(const PlanCommandLine& cl) {
  using namespace fsdp_trainer;
  namespace plan = fsdp::plan;
  auto config = load_config(cl.config_path, cl.overrides, cl.finetune);
  validate_world(config, cl.world, cl.per_node);
  const plan::DeviceProfile* device = nullptr;
  if (!cl.hardware.empty()) {
    try {
      device = &plan::builtin_device(cl.hardware);
    } catch (const std::exception& e) {
      throw ConfigError("--hardware: " + first_line(e.what()));
    }
  } else if (config.training.device != "cpu") {
    throw ConfigError(
        "fsdp-plan models CPU runs on this machine, or GPUs with --hardware; "
        "'training.device' = '" +
        config.training.device + "'");
  }
  if (device && cl.world > cl.per_node && device->inter_node_bytes_per_s <= 0)
    throw ConfigError("--hardware " + cl.hardware +
                      ": the profile describes no multi-node system (--world > "
                      "--nproc-per-node)");
  std::string budget_key = cl.budget_text.empty() ? "training.memory_budget" : "--budget";
  const std::string budget_text =
      cl.budget_text.empty() ? config.training.memory_budget : cl.budget_text;
  int64_t budget = budget_text.empty() ? 0 : parse_bytes(budget_text, budget_key);
  if (budget == 0 && device) {
    budget = device->memory_bytes;
    budget_key = cl.hardware + "'s memory";
  }
  if (cl.automatic) {
    if (cl.global_batch <= 0)
      throw ConfigError("--auto needs --global-batch (sequences per step over all ranks)");
    if (budget <= 0)
      throw ConfigError("--auto needs --budget (or training.memory_budget, or --hardware)");
    if (cl.global_batch % cl.world != 0)
      throw ConfigError(fmt::format("--global-batch {} is not a multiple of --world {}",
                                    cl.global_batch, cl.world));
  }
  PlanRequest r;
  r.model_file = cl.finetune ? resolve_model_file(config.finetune.model) : "";
  const auto& t = config.training;
  // What fsdp-train keeps outside the model through a step: its held-out batches.
  r.other = cl.finetune ? 0 : t.eval_batches * t.batch_size * (t.seq_len + 1) * 8;
  at::set_num_threads(static_cast<int>(t.threads));
  r.config = config;
  r.world = cl.world;
  r.per_node = cl.per_node;
  r.finetune = cl.finetune;
  r.budget = budget;
  r.budget_key = budget_key;
  r.device = device;
  r.efficiency = cl.efficiency;
  r.global_batch = cl.global_batch;
  r.top = cl.top;
  r.margin = cl.margin;
  r.space = cl.space_specs;
  r.json_path = cl.json_path;
  r.cache_dir = cl.cache_dir;
  r.recalibrate = cl.calibrate;
  return r;
}

}  // namespace

namespace fsdp_trainer {

int plan_main(int argc, char** argv) {
  // A rank of --calibrate's Gloo measurement.
  if (argc == 3 && std::string(argv[1]) == "--calibration-rank")
    return fsdp_trainer::run_calibration_rank(argv[2]);
  fsdp::memory::install_tracking_allocator();
  PlanCommandLine cl;
  if (const auto done = parse_command_line(argc, argv, cl))
    return *done;
  auto log = [](const std::string& line) { std::printf("%s\n", line.c_str()); };
  try {
    if (cl.calibrate && !cl.automatic) {
      fsdp_trainer::machine_profile(cl.cache_dir, std::min(cl.world, cl.per_node), program_file(),
                                    true, log);
      return 0;
    }
    const auto request = make_request(cl);
    return cl.automatic ? fsdp_trainer::plan_auto(request) : fsdp_trainer::plan_table(request);
  } catch (const fsdp_trainer::ConfigError& e) {
    std::fprintf(stderr, "fsdp-plan: config error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp-plan: %s\n", first_line(e.what()).c_str());
    return 1;
  }
}

}  // namespace fsdp_trainer
