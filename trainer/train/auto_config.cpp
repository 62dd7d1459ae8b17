// See auto_config.h.
#include "auto_config.h"

#include <fmt/core.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include <fsdp/plan/model_states.h>

#include "plan_pieces.h"
#include "train/compute_dtype.h"
#include "train/model_factory.h"

namespace fsdp_trainer {
namespace {

namespace plan = fsdp::plan;

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, sep))
    out.push_back(item);
  return out;
}

// The ranks a unit's parameters are sharded over: the world, hybrid_shard's group, or one.
int shard_ranks(const plan::StateOptions& s) {
  return s.strategy == fsdp::ShardingStrategy::kNoShard ? 1
         : s.hybrid_shard_size > 0                      ? s.hybrid_shard_size
                                                        : s.world_size;
}

// The step options of `knobs` on top of its dtype's and tp's run (made from the base config):
// `dp_per_node` data-parallel ranks per node (hybrid_shard's group), `batch_size` rows per
// data-parallel rank.
plan::StepOptions options_of(const RunPlan& run, const Knobs& k, int dp_per_node,
                             int64_t batch_size) {
  auto o = run.options;
  auto& s = o.states;
  s.strategy = fsdp::from_string<fsdp::ShardingStrategy>(k.strategy);
  s.hybrid_shard_size = s.strategy == fsdp::ShardingStrategy::kHybridShard ? dp_per_node : 0;
  const bool resharding = s.strategy == fsdp::ShardingStrategy::kFullShard ||
                          s.strategy == fsdp::ShardingStrategy::kHybridShard;
  o.reshard_after_forward = resharding ? std::optional<bool>(true) : std::nullopt;
  o.reshard_after_forward_size = resharding ? static_cast<int>(k.reshard_size) : 0;
  const auto mode = fsdp::from_string<fsdp::CheckpointMode>(k.ac);
  for (size_t i = 0; i < o.checkpoint.size(); ++i)
    o.checkpoint[i] =
        static_cast<int64_t>(i) % k.ac_every == 0 ? mode : fsdp::CheckpointMode::kNone;
  o.gather_format = fsdp::from_string<fsdp::GatherFormat>(k.gather);
  s.cpu_offload = k.offload == "cpu";
  s.optimizer_in_file = k.offload == "file";
  o.micro_batches = static_cast<int>(k.micro_batches);
  o.batch_rows = batch_size / k.micro_batches;
  return o;
}

std::vector<std::string> overrides_of(const Knobs& k, int dp_per_node, int64_t batch_size) {
  std::vector<std::string> out{
      fmt::format("parallel.tp={}", k.tp),
      "fsdp.strategy=" + k.strategy,
      fmt::format("fsdp.reshard_after_forward_size={}", k.reshard_size),
      "fsdp.activation_checkpointing=" + k.ac,
      fmt::format("fsdp.ac_every={}", k.ac_every),
      "precision.param_dtype=" + k.dtype,
      "precision.gather_format=" + k.gather,
      fmt::format("fsdp.cpu_offload={}", k.offload == "cpu" ? "true" : "false"),
      fmt::format("optimizer.offload={}", k.offload == "file" ? "file" : "none"),
      fmt::format("training.batch_size={}", batch_size),
      fmt::format("training.micro_batches={}", k.micro_batches),
  };
  if (k.strategy == "hybrid_shard")
    out.push_back(fmt::format("fsdp.hybrid_shard_size={}", dp_per_node));
  return out;
}

// Whether the knobs go together at `dp` data-parallel ranks of which `dp_per_node` per node,
// with `rows` per data-parallel rank (default_space lists each dimension's values for any tp).
bool valid_at(const Knobs& k, int dp, int dp_per_node, int64_t rows) {
  if (rows < 1 || rows % k.micro_batches != 0)
    return false;
  if (k.reshard_size > 0 && (k.reshard_size >= dp || dp % k.reshard_size != 0))
    return false;
  if (k.strategy == "hybrid_shard" && (dp_per_node < 2 || dp_per_node >= dp || dp % dp_per_node))
    return false;
  // One data-parallel rank: the strategies are all the same run, full_shard's.
  return dp > 1 || k.strategy == "full_shard";
}

}  // namespace

SearchSpace default_space(int world, int per_node, int64_t global_batch, bool gpu,
                          bool fused_optimizer) {
  SearchSpace space;
  auto& v = space.values;
  for (int tp : {1, 2, 4}) {
    if (world % tp == 0 && per_node % tp == 0)
      v["tp"].push_back(std::to_string(tp));
  }
  v["strategy"] = {"full_shard"};
  if (world > 1) {
    for (int k = 2; k < world; ++k) {
      if (world % k == 0)
        v["strategy"].push_back(fmt::format("full_shard/{}", k));
    }
    v["strategy"].push_back("shard_grad_op");
    v["strategy"].push_back("no_shard");
    if (per_node < world && world % per_node == 0 && per_node > 1)
      v["strategy"].push_back("hybrid_shard");
  }
  v["ac"] = {"none", "selective", "full", "full/2"};
  v["dtype"] = {"fp32", "bf16"};
  v["gather"] = {"param_dtype", "bf16", "int8"};
  v["offload"] = {"none"};
  if (gpu)
    v["offload"].push_back("cpu");
  else if (fused_optimizer)
    v["offload"].push_back("file");
  // A data-parallel rank's rows at the largest tp; smaller tps have fewer (valid_at).
  const int64_t most_rows = global_batch / (world / std::stoi(v["tp"].back()));
  for (int64_t m = 1; m <= most_rows; ++m) {
    if (most_rows % m == 0)
      v["micro_batches"].push_back(std::to_string(m));
  }
  return space;
}

void restrict_space(SearchSpace& space, const std::string& spec) {
  const auto eq = spec.find('=');
  if (eq == std::string::npos)
    throw ConfigError("--space '" + spec + "': expected DIMENSION=VALUE[,VALUE...]");
  const std::string dim = spec.substr(0, eq);
  auto it = space.values.find(dim);
  if (it == space.values.end()) {
    std::string dims;
    for (const auto& [name, values] : space.values)
      dims += (dims.empty() ? "" : ", ") + name;
    throw ConfigError("--space: unknown dimension '" + dim + "' (known: " + dims + ")");
  }
  std::vector<std::string> kept;
  for (const auto& value : split(spec.substr(eq + 1), ',')) {
    if (std::find(it->second.begin(), it->second.end(), value) == it->second.end()) {
      std::string known;
      for (const auto& v : it->second)
        known += (known.empty() ? "" : ", ") + v;
      throw ConfigError("--space: '" + value + "' is not a choice of " + dim +
                        " for this job (choices: " + known + ")");
    }
    kept.push_back(value);
  }
  if (kept.empty())
    throw ConfigError("--space '" + spec + "': no values");
  it->second = kept;
}

std::vector<Candidate> search_configs(const RunPlans& runs, const SearchSpace& space, int world,
                                      int per_node, int64_t global_batch, int64_t budget,
                                      double margin, const TimeInputsFor& time, bool accelerator) {
  const auto& v = space.values;
  const int64_t seq_len = runs.begin()->second.options.seq_len;
  std::vector<Candidate> out;
  for (const auto& tp_value : v.at("tp"))
    for (const auto& strategy : v.at("strategy"))
      for (const auto& ac : v.at("ac"))
        for (const auto& dtype : v.at("dtype"))
          for (const auto& gather : v.at("gather"))
            for (const auto& offload : v.at("offload"))
              for (const auto& micro : v.at("micro_batches")) {
                Knobs k;
                k.tp = std::stoll(tp_value);
                const auto s = split(strategy, '/');
                k.strategy = s[0];
                k.reshard_size = s.size() > 1 ? std::stoll(s[1]) : 0;
                const auto a = split(ac, '/');
                k.ac = a[0];
                k.ac_every = a.size() > 1 ? std::stoll(a[1]) : 1;
                k.dtype = dtype;
                k.gather = gather;
                k.offload = offload;
                k.micro_batches = std::stoll(micro);
                // A bf16 gather of bf16 compute is the default gather: one point, not two.
                if (gather == "bf16" && dtype != "fp32")
                  continue;
                // no_shard gathers nothing: its gather format is no choice.
                if (k.strategy == "no_shard" && gather != "param_dtype")
                  continue;
                const auto found = runs.find({dtype, k.tp});
                if (found == runs.end())  // the model does not split over this many ranks
                  continue;
                const auto& run = found->second;
                const int dp = world / static_cast<int>(k.tp);
                const int dp_per_node = per_node / static_cast<int>(k.tp);
                const int64_t batch_size = global_batch / dp;
                if (!valid_at(k, dp, dp_per_node, batch_size))
                  continue;
                const auto o = options_of(run, k, dp_per_node, batch_size);
                Candidate c;
                c.knobs = k;
                c.overrides = overrides_of(k, dp_per_node, batch_size);
                // Ranks differ by the padding of the last shard: the first and the last rank of
                // the data-parallel axis and of a shard group bound them.
                const int n = shard_ranks(o.states);
                for (int r : std::set<int>{0, n - 1, dp - 1}) {
                  auto p = plan::predict_step_memory(run.units, o, run.activations, r);
                  if (accelerator && o.states.cpu_offload)
                    p = plan::device_side(p);
                  if (p.peak > c.peak) {
                    c.peak = p.peak;
                    c.worst_rank = r;
                    c.moment = plan::moment_label(p.moment);
                  }
                }
                c.time = plan::predict_step_time(run.units, o, time(run, o, k), c.worst_rank);
                c.tokens_per_s = c.time.step_s > 0
                                     ? static_cast<double>(global_batch * seq_len) / c.time.step_s
                                     : 0;
                c.fits = budget <= 0 ||
                         static_cast<double>(c.peak) * (1 + margin) <= static_cast<double>(budget);
                out.push_back(std::move(c));
              }
  std::stable_sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) {
    return a.tokens_per_s > b.tokens_per_s;
  });
  return out;
}

std::string toml_snippet(const Candidate& c) {
  std::map<std::string, std::vector<std::string>> sections;
  for (const auto& o : c.overrides) {
    const auto dot = o.find('.'), eq = o.find('=');
    const std::string section = o.substr(0, dot), key = o.substr(dot + 1, eq - dot - 1),
                      value = o.substr(eq + 1);
    const bool bare = value == "true" || value == "false" ||
                      value.find_first_not_of("0123456789") == std::string::npos;
    sections[section].push_back(key + " = " + (bare ? value : "\"" + value + "\""));
  }
  std::string out;
  for (const char* section : {"training", "parallel", "fsdp", "precision", "optimizer"}) {
    auto it = sections.find(section);
    if (it == sections.end())
      continue;
    out += fmt::format("[{}]\n", section);
    for (const auto& line : it->second)
      out += line + "\n";
  }
  return out;
}

TimeInputsFor machine_time(const plan::MachineProfile& profile, int per_node,
                           double optimizer_s_per_byte) {
  auto cache =
      std::make_shared<std::map<std::tuple<const RunPlan*, int64_t>, plan::ComputeTimes>>();
  return [profile, per_node, optimizer_s_per_byte, cache](
             const RunPlan& run, const plan::StepOptions& o, const Knobs& k) {
    TORCH_CHECK(!run.timing_pieces.empty(), "machine_time needs runs planned with time_compute");
    plan::TimeInputs in;
    auto key = std::make_tuple(&run, o.batch_rows);
    auto it = cache->find(key);
    if (it == cache->end())
      it =
          cache
              ->emplace(key, plan::time_pieces_together(run.timing_pieces, o.batch_rows, o.seq_len))
              .first;
    in.compute = it->second;
    const int world = o.states.world_size;
    const int n = shard_ranks(o.states);
    auto link = [&](int ranks) {
      // Gloo between ranks on one machine; across machines it is not this profile's link.
      if (ranks > per_node)
        throw ConfigError(fmt::format(
            "the machine profile describes ranks on one machine; a group of {} spans nodes "
            "of {} (use a GPU --hardware profile, or --nproc-per-node {})",
            ranks, per_node, world));
      auto found = profile.gloo.find(ranks);
      if (found == profile.gloo.end())
        throw ConfigError(fmt::format(
            "the machine profile has no Gloo figures for {} ranks: run fsdp-plan --calibrate "
            "--world {}",
            ranks, ranks));
      return found->second;
    };
    if (n > 1)
      in.shard = link(n);
    if (world / n > 1)
      in.replicate = link(world / n);
    // The engine's cost per unit includes its collectives' calls: their latency is in it.
    for (auto* c :
         {&in.shard.all_gather, &in.shard.reduce_scatter, &in.shard.all_reduce,
          &in.replicate.all_gather, &in.replicate.reduce_scatter, &in.replicate.all_reduce})
      c->latency_s = 0;
    // Tensor parallelism's collectives are the layers', not the engine's: latency and all.
    if (k.tp > 1) {
      in.tp = link(static_cast<int>(k.tp));
      in.tp_traffic = run.activations.tp_traffic(o.batch_rows, o.seq_len);
    }
    // Measured for full_shard, shard_grad_op and no_shard; hybrid_shard's units do what
    // full_shard's do.
    const std::string kind =
        (k.strategy == "hybrid_shard" ? std::string("full_shard") : k.strategy) + "/" + k.dtype;
    // Measured per size of the units' group (the data-parallel axis): most of it is the
    // collectives' calls among those ranks.
    const int unit_ranks = std::min(world, per_node);
    const auto ranks = profile.unit_overhead.find(unit_ranks);
    if (ranks == profile.unit_overhead.end() || !ranks->second.count(kind))
      throw ConfigError(fmt::format(
          "the machine profile has no unit overhead for {} ranks: run fsdp-plan --calibrate "
          "--world {}",
          unit_ranks, unit_ranks));
    in.overhead = ranks->second.at(kind);
    auto resident = o.states;
    resident.optimizer_in_file = false;
    in.optimizer_s = optimizer_s_per_byte *
                     static_cast<double>(plan::model_states(run.units, resident, 0).params);
    in.comm_factor = 1;  // Gloo's copies compete with compute for the same cores
    in.host_bytes_per_s = 0;
    in.disk_read_bytes_per_s = profile.disk.read_bytes_per_s;
    in.disk_write_bytes_per_s = profile.disk.write_bytes_per_s;
    return in;
  };
}

PieceFlopsOf model_piece_flops(const Config& config) {
  if (config.finetuning)
    throw ConfigError("--hardware predicts pretraining runs (fsdp-train, not finetune)");
  if (config.model.arch == "gpt") {
    const auto cfg = gpt_config(config, config.data.vocab_size);
    return
        [cfg](int64_t b, int64_t t, int64_t tp) { return fsdp_models::piece_flops(cfg, b, t, tp); };
  }
  const auto cfg = llama_config(config, config.data.vocab_size);
  return
      [cfg](int64_t b, int64_t t, int64_t tp) { return fsdp_models::piece_flops(cfg, b, t, tp); };
}

TimeInputsFor device_time(const plan::DeviceProfile& device, double efficiency, int per_node,
                          PieceFlopsOf flops) {
  return [device, efficiency, per_node, flops](const RunPlan& run, const plan::StepOptions& o,
                                               const Knobs&) {
    plan::TimeInputs in;
    const auto dtype = o.states.param_dtype.value_or(torch::kFloat);
    const int tp = run.activations.tp_ways;
    in.compute = plan::flop_compute_times(flops(o.batch_rows, o.seq_len, tp),
                                          device.flops(dtype) * efficiency);
    // The units' groups are on the data-parallel axis: per_node / tp of its ranks per node.
    const int world = o.states.world_size, dp_per_node = per_node / tp;
    const int n = shard_ranks(o.states);
    in.shard = plan::device_link(device, n, n > dp_per_node);
    in.replicate = plan::device_link(device, world / n, world > dp_per_node);
    if (tp > 1) {
      in.tp = plan::device_link(device, tp, /*across_nodes=*/false);
      in.tp_traffic = run.activations.tp_traffic(o.batch_rows, o.seq_len);
    }
    in.overlap = true;
    // The optimizer streams the master shard, its gradient and the moments through memory:
    // AdamW reads 4 + 4 + 2m and writes 4 + 2m bytes per element (m: a moment's size), SGD
    // with momentum 4 + 4 + 4 and 4 + 4.
    const auto states = plan::model_states(run.units, o.states, 0);
    const double elements = static_cast<double>(states.params) / 4.0;
    const double moment = o.states.moments_dtype == torch::kFloat ? 4 : 2;
    const double per_element = o.states.optimizer == plan::Optimizer::kAdamW ? 12 + 4 * moment
                               : o.states.optimizer == plan::Optimizer::kSgdMomentum ? 20
                                                                                     : 12;
    const double bandwidth =
        o.states.cpu_offload ? device.host_memory_bytes_per_s : device.memory_bytes_per_s;
    in.optimizer_s = bandwidth > 0 ? elements * per_element / bandwidth : 0;
    in.host_bytes_per_s = device.host_bytes_per_s;
    return in;
  };
}

}  // namespace fsdp_trainer
