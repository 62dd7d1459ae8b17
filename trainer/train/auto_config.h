// fsdp-plan --auto (issue 26): the fsdp-train configuration with the highest predicted tokens/s
// whose predicted peak fits a memory budget. Every point of a search space (strategy, reshard
// size, activation checkpointing, compute dtype, gather format, offload, micro-batch size for a
// fixed global batch) is predicted by the planner: memory by predict_step_memory on the run's
// units and calibrated activations, time by predict_step_time on inputs from this machine
// (timed pieces, the cached machine profile) or from a GPU's data sheet (hardware.h). Nothing
// is run: the activations are calibrated once per compute dtype, the pieces timed once per
// (dtype, micro-batch).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <fsdp/plan/hardware.h>
#include <fsdp/plan/machine_profile.h>
#include <fsdp/plan/step_memory.h>
#include <fsdp/plan/step_time.h>

#include "config/config.h"
#include "train/step_plan.h"

namespace fsdp_trainer {

/// One point of the search, as fsdp-train keys.
struct Knobs {
  std::string strategy = "full_shard";
  int64_t reshard_size = 0;  // fsdp.reshard_after_forward_size
  std::string ac = "none";   // fsdp.activation_checkpointing
  int64_t ac_every = 1;
  std::string dtype = "fp32";  // precision.param_dtype
  std::string gather = "param_dtype";
  std::string offload = "none";  // none, cpu (fsdp.cpu_offload), file (optimizer.offload)
  int64_t micro_batches = 1;     // training.micro_batches (rows each: batch_size / this)
  int64_t tp = 1;                // parallel.tp (the rest shards over world / tp ranks)
};

/// The values each dimension takes. "ac" values: none, selective, full, full/2 (every second
/// block); "strategy": full_shard, full_shard/K (reshard_after_forward_size K), shard_grad_op,
/// no_shard, hybrid_shard; "tp": 1, 2, 4 (tensor parallelism inside a node).
struct SearchSpace {
  std::map<std::string, std::vector<std::string>> values;
};

/// Every choice that is valid for `world` ranks, `per_node` per node and a global batch of
/// `global_batch` rows: hybrid_shard only across several nodes, reshard sizes dividing the
/// world, bf16 gathers of fp32 compute, micro-batches dividing a data-parallel rank's rows,
/// tensor-parallel degrees (1, 2, 4) dividing the ranks per node. `gpu`: offload means
/// fsdp.cpu_offload (on a CPU the parameters already are in host memory, so it saves nothing)
/// and the dtypes are fp32 and bf16; on this machine offload means the optimizer state in a
/// file. A point whose dimensions do not go together (a reshard size or hybrid group that the
/// data-parallel ranks at its tp do not divide, micro-batches that its rows do not divide) is
/// skipped by search_configs.
SearchSpace default_space(int world, int per_node, int64_t global_batch, bool gpu,
                          bool fused_optimizer);

/// "dim=v1,v2": keeps only those values of a dimension (--space). ConfigError naming the
/// dimension or the value that is not in the space.
void restrict_space(SearchSpace& space, const std::string& spec);

struct Candidate {
  Knobs knobs;
  /// fsdp-train overrides ("fsdp.strategy=full_shard", ...) that make the base config this point.
  std::vector<std::string> overrides;
  int64_t peak = 0;  // the highest predicted peak of any rank
  int worst_rank = 0;
  std::string moment;
  fsdp::plan::TimePrediction time;
  double tokens_per_s = 0;
  bool fits = false;
};

/// What a candidate's step is timed with: its dtype's run, its step options and its knobs in.
using TimeInputsFor = std::function<fsdp::plan::TimeInputs(
    const RunPlan& run, const fsdp::plan::StepOptions& options, const Knobs& knobs)>;

/// The plans a search predicts from: plan_run of the base config for each dtype and
/// tensor-parallel degree of the space (a degree the model does not split over is absent).
using RunPlans = std::map<std::pair<std::string, int64_t>, RunPlan>;

/// Every point of `space`, predicted, the fastest first. A point fits when its peak times
/// (1 + margin) is within `budget`. `global_batch`: rows per step over all ranks.
/// `accelerator`: with CPU offload the states live in host memory and the peak is the
/// device's (fsdp::plan::device_side).
std::vector<Candidate> search_configs(const RunPlans& runs, const SearchSpace& space, int world,
                                      int per_node, int64_t global_batch, int64_t budget,
                                      double margin, const TimeInputsFor& time,
                                      bool accelerator = false);

/// The candidate as the lines of an fsdp-train TOML file, by section.
std::string toml_snippet(const Candidate& c);

/// Timing on this machine: the pieces timed at each micro-batch (needs runs made with
/// time_compute), Gloo from `profile` for the group sizes the candidate uses, the
/// tensor-parallel group's included (ConfigError if the profile lacks one: calibrate for that
/// world size), the optimizer at `optimizer_s_per_byte` of the rank's parameter shard, offload
/// at the profile's memcpy and disk rates.
TimeInputsFor machine_time(const fsdp::plan::MachineProfile& profile, int per_node,
                           double optimizer_s_per_byte);

/// The FLOPs of a micro-batch through each piece of the configured model (GPT or Llama) on one
/// rank of `tp` tensor-parallel ranks; a ConfigError for fine-tuning (the data-sheet model is of
/// pretraining).
using PieceFlopsOf = std::function<fsdp::plan::PieceFlops(int64_t b, int64_t t, int64_t tp)>;
PieceFlopsOf model_piece_flops(const Config& config);

/// Timing from a data sheet: FLOPs of `flops(b, t, tp)` at the device's rate for the dtype
/// times `efficiency`, NCCL ring collectives on its links (hybrid_shard's replicas and any
/// data-parallel group larger than a node's share cross InfiniBand; the tensor-parallel group
/// stays inside a node), FSDP's collectives overlapped with compute and tensor parallelism's
/// not, the optimizer at the memory bandwidth of where it runs, CPU offload over PCIe.
TimeInputsFor device_time(const fsdp::plan::DeviceProfile& device, double efficiency, int per_node,
                          PieceFlopsOf flops);

}  // namespace fsdp_trainer
