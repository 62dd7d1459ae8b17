// fsdp-plan: what an fsdp-train configuration will hold per rank, before running it.
//
//   fsdp-plan [CONFIG.toml] --world N [--nproc-per-node M] [--finetune] [--budget 16GiB]
//             [--section.key=value ...]
//
// Reads the configuration as fsdp-train does (the same keys, overrides and errors), builds the
// model on the meta device, calibrates its activations on a one-block model of the same widths
// (a second or two), and prints each rank's predicted peak by fsdp::memory category with its
// moment (docs/design.md, "Planning"). With a budget: exit 2 when even the model states do not
// fit, a warning naming a change that fits when the peak does not.
//
// Exit codes: 0 done, 2 bad input (config, world size, budget), 1 anything else.
#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <fsdp/core/memory.h>

#include "config/config.h"
#include "data/finetune_data.h"
#include "train/compute_dtype.h"
#include "train/matmul_speed.h"
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

}  // namespace

int main(int argc, char** argv) {
  mem::install_tracking_allocator();
  CLI::App app{"fsdp-plan: the per-rank memory of an fsdp-train configuration, predicted"};
  app.allow_extras();
  std::string config_path, budget_text;
  int world = 0, per_node = 0;
  bool finetune = false;
  app.add_option("config", config_path, "TOML configuration file (defaults apply without one)");
  app.add_option("--world", world, "Ranks in the job")->required()->check(CLI::Range(1, 65536));
  app.add_option("--nproc-per-node", per_node,
                 "Ranks per node (hybrid_shard's default group); default: --world")
      ->check(CLI::Range(1, 65536));
  app.add_flag("--finetune", finetune, "The configuration is fsdp-train finetune's");
  app.add_option("--budget", budget_text,
                 "Memory each rank may use (e.g. 16GiB); default: training.memory_budget");
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
  try {
    using namespace fsdp_trainer;
    const auto config = load_config(config_path, overrides, finetune);
    validate_world(config, world, per_node);
    if (config.training.device != "cpu")
      throw ConfigError(
          "fsdp-plan models CPU runs (Gloo, the tracking allocator); "
          "'training.device' = '" +
          config.training.device + "'");
    const std::string budget_key = budget_text.empty() ? "training.memory_budget" : "--budget";
    if (budget_text.empty())
      budget_text = config.training.memory_budget;
    const int64_t budget = budget_text.empty() ? 0 : parse_bytes(budget_text, budget_key);
    const std::string gguf = finetune ? resolve_model_file(config.finetune.model) : "";
    const auto dtype = compute_dtype(config);
    const auto& t = config.training;
    // What fsdp-train keeps outside the model through a step: its held-out batches.
    const int64_t other = finetune ? 0 : t.eval_batches * t.batch_size * (t.seq_len + 1) * 8;
    const auto run = plan_run(config, config.data.vocab_size, gguf, world, per_node, dtype, other);

    std::vector<fsdp::plan::MemoryPrediction> predictions;
    int worst_rank = 0;
    for (int r = 0; r < world; ++r) {
      predictions.push_back(
          fsdp::plan::predict_step_memory(run.units, run.options, run.activations, r));
      if (predictions.back().peak > predictions[static_cast<size_t>(worst_rank)].peak)
        worst_rank = r;
    }
    const auto& worst = predictions[static_cast<size_t>(worst_rank)];
    if (budget > 0 && budget < worst.states.total()) {
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
        "fsdp-plan: %s on %d rank(s), %s, compute %s, %lld x %lld tokens per micro-batch, "
        "%d micro-batch(es)%s\n",
        finetune ? config.finetune.model.c_str()
                 : (config.model.arch + " " + config.model.preset).c_str(),
        world, config.fsdp.strategy.c_str(), dtype.c_str(), (long long)run.options.batch_rows,
        (long long)run.options.seq_len, run.options.micro_batches,
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
