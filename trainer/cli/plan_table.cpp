// fsdp-plan CONFIG --world N [--hardware NAME]: each rank's predicted peak by category, with
// its moment; with a device, the step time its data sheet allows. See plan_commands.h.
#include "plan_commands.h"

#include <fmt/core.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <fsdp/core/memory.h>
#include <fsdp/plan/step_memory.h>
#include <fsdp/plan/step_time.h>

#include "train/auto_config.h"
#include "train/compute_dtype.h"
#include "train/matmul_speed.h"
#include "train/step_plan.h"

namespace fsdp_trainer {
namespace {

namespace mem = fsdp::memory;
namespace plan = fsdp::plan;

// precision.param_dtype resolved as fsdp-train resolves it, from this machine's matmul speeds.
std::string compute_dtype(const fsdp_trainer::Config& config) {
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

std::string describe_time(const plan::TimePrediction& t, double tokens) {
  std::string out = fmt::format(
      "step {:.4g} s ({:.0f} tokens/s): forward {:.4g} s, backward {:.4g} s (recompute {:.4g}), "
      "exposed all-gather {:.4g} s, exposed reduce {:.4g} s, optimizer {:.4g} s, offload I/O "
      "{:.4g} s",
      t.step_s, tokens / t.step_s, t.forward_s, t.backward_s, t.recompute_s, t.all_gather_exposed_s,
      t.reduce_exposed_s, t.optimizer_s, t.offload_s);
  if (t.tp_calls > 0)
    out += fmt::format(", tensor parallelism {:.4g} s", t.tp_s);
  out +=
      fmt::format("; per step all-gather {}, reduce-scatter {}, all-reduce {}",
                  mem::format_bytes(t.all_gather_bytes), mem::format_bytes(t.reduce_scatter_bytes),
                  mem::format_bytes(t.all_reduce_bytes));
  if (t.tp_calls > 0)
    out += fmt::format(" on the data-parallel axis, {} on the tensor-parallel one",
                       mem::format_bytes(t.tp_bytes));
  return out;
}

}  // namespace

void plan_progress(const std::string& line) {
  // --auto calibrates once per dtype and tensor-parallel degree: a note said once is enough.
  static std::set<std::string> notes;
  if (line.rfind("note:", 0) == 0 && !notes.insert(line).second)
    return;
  std::fprintf(stderr, "fsdp-plan: %s\n", line.c_str());
  std::fflush(stderr);
}

namespace {

// The table: a row per rank, each different row once (ranks differ only by the padding of the
// last shard), with its peak, moment and categories at the peak.
void print_rank_rows(const std::vector<fsdp::plan::MemoryPrediction>& predictions) {
  const int world = static_cast<int>(predictions.size());
  std::printf("%-6s %12s  %-20s", "rank", "peak", "moment");
  for (int c = 1; c <= mem::kNumCategories; ++c)
    std::printf(" %20s", mem::to_string(static_cast<mem::Category>(c % mem::kNumCategories)));
  std::printf("\n");
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
}

// Each rank's predicted step memory; on a GPU (`on_device`), CPU offload keeps the model states
// in host memory: the device's side. With tensor parallelism rank r is data-parallel rank
// r / tp of the 2-D mesh (fsdp::make_device_mesh), planned as the run's tensor-parallel rank.
std::vector<fsdp::plan::MemoryPrediction> predict_every_rank(const RunPlan& run, int world,
                                                             bool on_device) {
  std::vector<fsdp::plan::MemoryPrediction> predictions;
  const int tp = run.activations.tp_ways;
  for (int r = 0; r < world; ++r) {
    predictions.push_back(
        fsdp::plan::predict_step_memory(run.units, run.options, run.activations, r / tp));
    if (on_device && run.options.states.cpu_offload)
      predictions.back() = fsdp::plan::device_side(predictions.back());
  }
  return predictions;
}

// Whether the highest peak fits the budget, and if not, what would.
void print_budget_verdict(const RunPlan& run, const fsdp::plan::MemoryPrediction& worst,
                          int worst_rank, int64_t budget, const std::string& budget_key) {
  if (worst.peak > budget) {
    // The planner's rank is the data-parallel one (rank / tp of the 2-D mesh).
    std::printf("over budget: rank %d: %s\n", worst_rank,
                budget_warning(run, worst, budget, worst_rank / run.activations.tp_ways, budget_key)
                    .c_str());
  } else {
    std::printf("fits: the highest predicted peak, %s (rank %d), is %.0f%% of %s\n",
                mem::format_bytes(worst.peak).c_str(), worst_rank,
                100.0 * static_cast<double>(worst.peak) / static_cast<double>(budget),
                mem::format_bytes(budget).c_str());
  }
}

}  // namespace

int plan_table(const PlanRequest& request) {
  const auto& config = request.config;
  const auto& t = config.training;
  const int world = request.world, per_node = request.per_node;
  const bool finetune = request.finetune;
  const auto* device = request.device;
  const int64_t budget = request.budget;
  const auto& budget_key = request.budget_key;
  const auto& model_file = request.model_file;
  const int64_t other = request.other;
  const double efficiency = request.efficiency;
  const auto dtype = device
                         ? (config.precision.param_dtype == "auto" ? std::string("bf16")
                                                                   : config.precision.param_dtype)
                         : compute_dtype(config);
  auto run = plan_run(config, config.data.vocab_size, model_file, world, per_node, dtype, other,
                      false, nullptr, 1, plan_progress);
  if (device)
    run.options.gloo_staging = run.options.gloo_reduce_scatter = false;
  const auto predictions = predict_every_rank(run, world, device != nullptr);
  int worst_rank = 0;
  for (int r = 1; r < world; ++r)
    if (predictions[static_cast<size_t>(r)].peak >
        predictions[static_cast<size_t>(worst_rank)].peak)
      worst_rank = r;
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
  print_rank_rows(predictions);
  const int tp = run.activations.tp_ways;
  if (tp > 1) {
    // The traffic alone: predict_step_time counts it without any rates.
    plan::TimeInputs counts;
    counts.tp_traffic = run.activations.tp_traffic(run.options.batch_rows, run.options.seq_len);
    const auto traffic = plan::predict_step_time(run.units, run.options, counts, 0);
    const auto& c = traffic.tp_traffic;
    std::printf(
        "tensor parallelism: %d group(s) of %d consecutive ranks (rows above: each rank planned "
        "as tensor-parallel rank 0, which holds the most words of the vocabulary, the others the "
        "same or a few fewer), the units sharded over %d data-parallel rank(s); per step each "
        "rank issues on its group %lld all-reduces of %s, %lld all-gathers of %s, %lld "
        "reduce-scatters of %s (%s in all)\n",
        world / tp, tp, run.options.states.world_size, (long long)c.all_reduce.calls,
        mem::format_bytes(c.all_reduce.bytes).c_str(), (long long)c.all_gather.calls,
        mem::format_bytes(c.all_gather.bytes).c_str(), (long long)c.reduce_scatter.calls,
        mem::format_bytes(c.reduce_scatter.bytes).c_str(),
        mem::format_bytes(traffic.tp_bytes).c_str());
  }
  if (worst.peak_without_staging != worst.peak) {
    std::printf(
        "Gloo's staging buffers for a gather in flight are counted; without them rank "
        "%d's peak is %s.\n",
        worst_rank, mem::format_bytes(worst.peak_without_staging).c_str());
  }
  if (device) {
    const auto time = plan::predict_step_time(
        run.units, run.options,
        device_time(*device, efficiency, per_node, model_piece_flops(config))(run, run.options, {}),
        worst_rank / run.activations.tp_ways);
    const double tokens =
        static_cast<double>(run.options.states.world_size * t.batch_size * run.options.seq_len);
    std::printf("time on %s at %.0f%% of its matmul rate: %s\n", device->name.c_str(),
                100 * efficiency, describe_time(time, tokens).c_str());
  }
  if (budget > 0)
    print_budget_verdict(run, worst, worst_rank, budget, budget_key);
  return 0;
}

}  // namespace fsdp_trainer
