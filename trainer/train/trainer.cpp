// See trainer.h. Per-step timing comes from fsdp::StepProfiler: scopes around forward,
// backward and the optimizer; the waits are the time this thread blocked on the collectives of
// the model's process groups (the part of communication not hidden), and the byte counters
// cover every group the units use (hybrid_shard's subgroups included).
#include "trainer.h"

#include <torch/cuda.h>

#include <fmt/core.h>
#include <fmt/ranges.h>

#include <numeric>

#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/checkpoint/sharded_checkpoint.h>
#include <fsdp/clip_grad.h>
#include <fsdp/core/caching_allocator.h>
#include <fsdp/core/durable_file.h>
#include <fsdp/core/memory.h>
#include <fsdp/core/trace.h>
#include <fsdp/distributed/collectives.h>
#include <fsdp/distributed/flight_recorder.h>
#include <fsdp/fully_shard.h>
#include <fsdp/observe/chrome_trace.h>
#include <fsdp/observe/step_profiler.h>
#include <fsdp/optim/fused_optimizer.h>
#include <fsdp/optim/torch_fused_adamw.h>
#include <fsdp/unshard.h>

#include "checkpoint_meta.h"
#include "gradient_update.h"
#include "matmul_speed.h"
#include "observe/plot.h"
#include "optimizer_factory.h"
#include "text/utf8.h"

namespace fsdp_trainer {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace

// The flight recorder (fsdp/distributed/flight_recorder.h) dumps into the run directory, so
// that `fsdp-train fr-analyze <run_dir>/flight_recorder` finds a failed job's dumps; an earlier
// run's dump of this rank is removed first, so none is mistaken for this run's.
void Trainer::start_flight_recorder(const fsdp::LaunchEnv& env) {
  auto& recorder = fsdp::FlightRecorder::global();
  recorder.set_capacity(static_cast<size_t>(config_.logging.flight_recorder));
  if (config_.logging.flight_recorder == 0)
    return;
  if (std::getenv("FSDP_FLIGHT_RECORDER_DIR") == nullptr) {
    const auto dir = std::filesystem::path(config_.logging.run_dir) / "flight_recorder";
    recorder.set_dump_dir(dir.string());
    std::error_code ec;
    std::filesystem::remove(dir / ("rank" + std::to_string(env.rank) + ".json"), ec);
  }
  recorder.dump_on_signal(SIGUSR1);
}

Trainer::Trainer(Config config, DeviceMemory device_memory, Purpose purpose)
    : config_(std::move(config)), purpose_(purpose) {
  const auto& t = config_.training;
  torch::set_num_threads(static_cast<int>(t.threads));
  if (fsdp::memory::caching_installed()) {
    auto cache = fsdp::memory::caching_options();
    cache.enabled = t.cpu_cache;
    fsdp::memory::set_caching_options(cache);
  }
  const fsdp::LaunchEnv env = fsdp::launch_env_from_environment();
  const bool cuda = t.device == "cuda";
  if (cuda)
    device_ = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
  start_flight_recorder(env);
  pg_ = fsdp::init_process_group(
      fsdp::ProcessGroupOptions()
          .backend(cuda ? "nccl" : "gloo")
          .timeout(std::chrono::milliseconds(static_cast<int64_t>(config_.fsdp.timeout_s * 1000)))
          .gloo_lanes(static_cast<int>(config_.fsdp.gloo_lanes))
          .check_collectives(static_cast<int>(config_.fsdp.check_collectives))
          .bench_local_collectives(config_.fsdp.bench_local_collectives));
  const int rank = pg_->rank(), world = pg_->size();
  const int local_world = env.local_world_size;
  validate_world(config_, world, local_world);  // main() checked already; never hang on it
  if (config_.parallel.tp > 1)
    mesh_ = fsdp::make_device_mesh(*pg_, static_cast<int>(config_.parallel.tp));
  if (config_.fsdp.fault_tolerant && purpose_ == Purpose::kTrain) {
    // The replicas' groups come from the quorum; the trainer's reductions go over the ranks
    // training now (none yet in a restarted replica, until it is admitted).
    membership_ = std::make_unique<ReplicaMembership>(
        config_, pg_, env.incarnation,
        ReplicaMembership::Hooks{[this](int64_t step) { on_membership_change(step); },
                                 [this](bool joining) { sync_replica_state(joining); },
                                 [this] {
                                   if (metrics_->has_outputs())
                                     metrics_->close_outputs();
                                 }});
    metrics_pg_ = membership_->quorum().live_group();
  } else {
    // The trainer's own reductions (losses, memory figures, the dtype choice, the random
    // states of checkpoints) get a group of their own (see MetricsProcessor).
    std::vector<int> everyone(static_cast<size_t>(world));
    std::iota(everyone.begin(), everyone.end(), 0);
    metrics_pg_ = pg_->new_group(everyone);
  }
  metrics_ = std::make_unique<MetricsProcessor>(metrics_pg_, device_, std::move(device_memory));
  const bool restarted = membership_ && membership_->restarted();

  if (purpose_ == Purpose::kTrain)
    check_saved_inputs();
  // A restarted replica finds the data prepared, and no one to wait for.
  // Each data-parallel rank reads its part of the batch; a tensor-parallel group reads one.
  data_ = std::make_unique<TrainData>(config_, dp_rank(), dp_size(), device_, [this, restarted] {
    if (!restarted)
      pg_->barrier();
  });
  const std::string& model_file = data_->model_file();

  compute_dtype_ = resolve_compute_dtype();
  UnitOptions units =
      unit_options(config_, membership_ ? membership_->quorum().replica_group() : dp_group(),
                   compute_dtype_.dtype, local_world);
  if (membership_) {
    for (auto* o : {&units.blocks, &units.root})
      o->replicate_group(membership_->quorum().replicate_group());
  }
  {
    // Building draws every weight on the host (counter-based draws: the values do not depend
    // on the thread count), and with training.threads = 1 a 1.5B-parameter model took about a
    // minute on a GPU machine whose 16 cores sat idle (docs/gpu.md). For building alone, this
    // rank takes its share of the machine's cores.
    const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    const int share = std::max(1, cores / std::max(1, env.local_world_size));
    torch::set_num_threads(std::max(static_cast<int>(t.threads), share));
    model_ = data_->finetune() ? build_finetune(model_file, units)
                               : build_model(config_, data_->prepared().vocab_size, units, device_,
                                             mesh_ ? mesh_->tp : nullptr);
    torch::set_num_threads(static_cast<int>(t.threads));
  }
  units_ = units;
  profiler_ = std::make_unique<fsdp::StepProfiler>(model_.module);

  // Its group is the loss scaler's (with fault tolerance the replica's, which each change of
  // membership makes anew: on_membership_change).
  optimizers_ = std::make_unique<Optimizers>(
      config_, *model_.module, membership_ ? membership_->quorum().replica_group() : pg_);
  if (config_.checkpoint.async)
    async_saves_ = std::make_unique<fsdp::AsyncCheckpointer>(pg_);

  if (purpose_ != Purpose::kTrain)
    return;
  // A replica joining a fault-tolerant job copies its state from a live one, not from disk.
  if (!config_.checkpoint.resume.empty() && !(membership_ && membership_->joining()))
    start_step_ = resume_from_checkpoint();
  if (start_step_ == 0 && !config_.model.init_from.empty() &&
      !(membership_ && membership_->joining())) {
    const auto from = load_weights(config_.model.init_from);
    if (rank == 0)
      std::printf("fsdp-train: parameters from %s\n", from.c_str());
  }

  measure_mfu_peak();

  if (rank == 0 && !restarted) {
    open_run_directory();
    describe_run(world);
  }
  plan_memory(model_file);
}

// MFU's two sides: the model's FLOPs per token, and the peak it is relative to.
void Trainer::measure_mfu_peak() {
  const auto& t = config_.training;
  const bool finetune = data_->finetune() != nullptr;
  double flops_per_token = 0;
  if (finetune) {
    // Adapters leave out the weight gradients: forward 2N and input gradients 2N of 6N.
    flops_per_token = gpt_flops_per_token(model_.num_params, model_.n_layer, model_.n_embd,
                                          config_.finetune.max_tokens / 2) *
                      (config_.finetune.method == "full" ? 1.0 : 2.0 / 3.0);
  } else {
    flops_per_token =
        gpt_flops_per_token(model_.num_params, model_.n_layer, model_.n_embd, t.seq_len);
  }
  // MFU's peak: the model's own Linear shapes in the compute dtype (matmul_speed.h), with the
  // rows of one micro-batch (capped: larger ones run no faster and take longer to time). Every
  // rank measures at once (after a barrier, so none is busy computing while another measures)
  // and all use the highest: one peak for the whole job.
  const int64_t rows = std::min<int64_t>(
      512, finetune ? t.batch_size * config_.finetune.max_tokens : t.batch_size * t.seq_len);
  const std::vector<MatmulShape> shapes{{rows, model_.n_embd, model_.n_embd},
                                        {rows, model_.n_embd, model_.n_hidden}};
  // Fault tolerance: over the replica (a restarted one cannot measure with the others).
  auto& group = membership_ ? *membership_->quorum().replica_group() : *pg_;
  group.barrier();
  const int64_t mine =
      std::llround(peak_matmul_flops(dtype_named(compute_dtype_.dtype), shapes, device_));
  auto peak = torch::tensor({mine}, torch::TensorOptions(torch::kLong).device(device_));
  fsdp::all_reduce(group, peak, fsdp::ReduceOp::kMax, "max of a metric")->wait();
  metrics_->set_mfu_basis(flops_per_token, static_cast<double>(peak.item<int64_t>()));
}

// Rank 0: the run directory with the resolved config, metrics.jsonl (replaced by a fresh run,
// continued by a resumed one) and the TensorBoard events.
void Trainer::open_run_directory() {
  std::filesystem::create_directories(config_.logging.run_dir);
  fsdp::write_file_atomic((std::filesystem::path(config_.logging.run_dir) / "config.toml").string(),
                          to_toml(config_));
  metrics_->open_outputs(config_.logging, config_.training.steps, start_step_);
}

// Rank 0: the progress display and the lines that say what runs (data, sharding, precision,
// optimizer, MFU's peak) before step 1.
void Trainer::describe_run(int world) {
  const auto& t = config_.training;
  const auto& f = config_.fsdp;
  const auto& prec = config_.precision;
  metrics_->message(data_->describe(model_.description, world));
  if (mesh_) {
    metrics_->message(fmt::format(
        "mesh: dp {} x tp {} (tensor parallelism inside each group of {} consecutive ranks, which "
        "read one part of the batch: \"per rank\" above is per tp group; FSDP over the dp axis)",
        mesh_->dp->size(), mesh_->tp->size(), mesh_->tp->size()));
  }
  std::string sharding = f.strategy;
  if (f.strategy == "hybrid_shard") {
    const int hybrid_size = units_->blocks.hybrid_shard_size();
    sharding += fmt::format(" (sharded in groups of {} ranks, replicated {}x)", hybrid_size,
                            dp_size() / hybrid_size);
  } else if (f.strategy == "full_shard" && !f.reshard_after_forward) {
    sharding += " (reshard_after_forward off)";
  }
  if (f.reshard_after_forward_size > 1 && f.reshard_after_forward &&
      (f.strategy == "full_shard" || f.strategy == "hybrid_shard")) {
    sharding +=
        fmt::format(", resharded over {} ranks after forward", f.reshard_after_forward_size);
  }
  metrics_->message(fmt::format(
      "fsdp: {} | prefetch: forward {}, backward {}, at most {} all-gathers in flight", sharding,
      f.forward_prefetch ? "on" : "off", f.backward_prefetch, f.max_inflight_all_gathers));
  std::string ac = f.activation_checkpointing;
  if (f.activation_checkpointing != "none" && f.ac_every > 1)
    ac += fmt::format(" (every {} blocks)", f.ac_every);
  metrics_->message(fmt::format(
      "precision: compute {}{}, gather {}, reduce {}{} | activation checkpointing: {}",
      compute_dtype_.dtype, prec.root_fp32 && compute_dtype_.dtype != "fp32" ? " (root fp32)" : "",
      prec.gather_format == "int8" ? fmt::format("int8 (blocks of {})", prec.int8_block)
                                   : prec.gather_format,
      prec.reduce_format == "int8" ? fmt::format("int8 (blocks of {}{})", prec.int8_block,
                                                 prec.error_feedback ? ", error feedback" : "")
                                   : prec.reduce_dtype,
      optimizers_->scaler() ? ", dynamic loss scaling" : "", ac));
  metrics_->message("optimizer: " + optimizers_->describe());
  metrics_->message(fmt::format(
      "MFU is relative to {:.1f} GFLOP/s per rank: the fastest {} matmul of the model's shapes, "
      "{} thread(s), measured on every rank at once (the highest)",
      metrics_->peak_flops_per_rank() / 1e9, compute_dtype_.dtype, t.threads));
}

Trainer::~Trainer() = default;

fsdp::plan::TimePrediction Trainer::predict_time(const RunPlan& run) {
  fsdp::plan::TimeInputs in;
  in.compute = *run.compute;
  // The links: the engine's own groups (fully_shard's resolve_groups makes the same blocks).
  // With tensor parallelism the units' groups are on the dp axis, and the tp group's collectives
  // are timed on the tp group itself.
  const auto& s = run.options.states;
  const auto dp = dp_group();
  const int world = dp->size();
  const int n = s.strategy == fsdp::ShardingStrategy::kNoShard       ? 1
                : s.strategy == fsdp::ShardingStrategy::kHybridShard ? s.hybrid_shard_size
                                                                     : world;
  if (n > 1)
    in.shard = fsdp::plan::measure_link(*dp->block_group(n));
  if (world / n > 1)
    in.replicate = fsdp::plan::measure_link(*dp->strided_group(n));
  if (mesh_) {
    in.tp = fsdp::plan::measure_link(*mesh_->tp);
    in.tp_traffic = run.activations.tp_traffic(run.options.batch_rows, run.options.seq_len);
  }
  // The optimizer phase as train_step runs it (gradient clipping, its all-reduce, the step),
  // on copies of this rank's trainable shards with zero gradients, timed after the step that
  // creates the state. Above 16M elements, on one flat tensor of 16M, scaled linearly.
  int64_t elements = 0;
  const auto& params = optimizers_->params();
  for (const auto& p : params)
    elements += p.numel();
  constexpr int64_t kMostTimed = int64_t{1} << 24;
  std::vector<torch::Tensor> copies;
  if (elements <= kMostTimed) {
    for (const auto& p : params)
      copies.push_back(torch::zeros_like(p).requires_grad_());
  } else {
    copies.push_back(torch::zeros({kMostTimed}, params.front().options()).requires_grad_());
  }
  int64_t timed = 0;
  for (auto& c : copies) {
    c.mutable_grad() = torch::full_like(c, 1e-3);
    timed += c.numel();
  }
  {
    auto opt = make_optimizer(config_, copies, {});
    auto phase = [&] {
      if (config_.training.grad_clip > 0)
        fsdp::clip_grad_norm_(copies, config_.training.grad_clip, *pg_);
      opt->step();
    };
    phase();
    double total = 0;
    constexpr int kRuns = 3;
    for (int i = 0; i < kRuns; ++i) {
      const auto start = Clock::now();
      phase();
      total += seconds_since(start);
    }
    in.optimizer_s = total / kRuns * static_cast<double>(elements) /
                     static_cast<double>(std::max<int64_t>(1, timed));
  }
  // What the collectives cost while a block computes, from the first block's traffic.
  if (n > 1) {
    const auto& c = in.compute.block[0];
    in.comm_factor = fsdp::plan::measure_comm_factor(
        *dp->block_group(n), *run.pieces, run.options.batch_rows, run.options.seq_len,
        fsdp::plan::unit_traffic(run.units.front(), run.options, dp_rank()), in.shard,
        c.forward + c.backward);
  }
  if (pg_->rank() == 0) {
    auto link = [](const fsdp::plan::LinkCost& c) {
      return fmt::format("{:.0f} us + {:.2f} GB/s", c.latency_s * 1e6, c.bytes_per_s / 1e9);
    };
    metrics_->message(fmt::format(
        "planner's measurements: all-gather {}, reduce-scatter {}, all-reduce {} (shard group "
        "of {}); optimizer step {:.4f} s; a block's forward {:.4f} s, backward {:.4f} s; "
        "collectives under compute cost {:.2f}x their time alone",
        link(in.shard.all_gather), link(in.shard.reduce_scatter), link(in.replicate.all_reduce), n,
        in.optimizer_s, in.compute.block[0].forward, in.compute.block[0].backward, in.comm_factor));
  }
  return fsdp::plan::predict_step_time(run.units, run.options, in, dp_rank());
}

// How --plan predicts the step time (time_by_blocks), as the outputs name it.
constexpr const char* kStepTimeMethod = "the job with 1 and 3 blocks";

void Trainer::plan_memory(const std::string& model_file) {
  const auto& t = config_.training;
  if (!config_.logging.plan && t.memory_budget.empty())
    return;
  if (!device_.is_cpu() || !fsdp::memory::tracking_installed()) {
    if (pg_->rank() == 0) {
      std::fprintf(stderr,
                   "fsdp-train: the memory planner models CPU runs (Gloo, the tracking "
                   "allocator); no prediction for training.device = '%s'\n",
                   t.device.c_str());
    }
    return;
  }
  // The plan is made as the job starts, every rank timing its pieces at once: a restarted
  // replica of a fault-tolerant job has no world group to time with, and goes without.
  if (membership_ && membership_->restarted()) {
    std::printf(
        "fsdp-train: [rank %d] no memory plan in a restarted replica (made at the "
        "job's start)\n",
        pg_->rank());
    return;
  }
  // Timing the pieces (--plan) happens on every rank at once, as the step will.
  const bool timed = config_.logging.plan;
  const FinetuneData* finetune = data_->finetune();
  auto run = plan_run(
      config_, finetune ? 0 : data_->prepared().vocab_size, model_file, pg_->size(),
      fsdp::launch_env_from_environment().local_world_size, compute_dtype_.dtype,
      /*other_bytes=*/0, timed, [this] { pg_->barrier(); }, /*timing_copies=*/1,
      /*progress=*/nullptr, mesh_ ? mesh_->tp_rank() : 0);
  if (finetune)  // batches are padded to their longest conversation
    run.options.seq_len = std::min(run.options.seq_len, finetune->longest_train_input());
  std::optional<fsdp::plan::TimePrediction> time_prediction;
  std::optional<MeasuredTime> step_time;
  if (timed) {
    time_prediction = predict_time(run);
    step_time = time_by_blocks(model_file);
  }
  run.pieces.reset();  // the one-block model goes
  run.timing_pieces.clear();
  // The timing models' units go with them: listing units drops those of dead models.
  fsdp::comm_stats(*model_.module);
  // What is tracked outside the model when step 1 starts (the data, and what the timing runs
  // leave behind: Gloo keeps buffers for the groups they used), after all of the above.
  run.options.other_bytes += fsdp::memory::current_by_category()[fsdp::memory::Category::kOther];
  auto prediction =
      fsdp::plan::predict_step_memory(run.units, run.options, run.activations, dp_rank());
  plan_check_.emplace(run, std::move(prediction), std::move(time_prediction), std::move(step_time),
                      kStepTimeMethod);
  const auto& predicted = plan_check_->prediction();
  if (config_.logging.plan && pg_->rank() == 0) {
    metrics_->message(describe_prediction(predicted));
    if (plan_check_->step_time()) {
      const auto& p = *plan_check_->step_time();
      const auto& lib = *plan_check_->time_prediction();
      metrics_->message(fmt::format(
          "predicted step {:.4f} s (the job with 1 and 3 blocks): forward {:.4f}, backward "
          "{:.4f}, all-gather wait {:.4f}, reduce wait {:.4f}, optimizer {:.4f}; timed pieces and "
          "links say {:.4f} s; per step all-gather {}, reduce-scatter {}, all-reduce {}{}",
          p.step, p.forward, p.backward, p.all_gather_wait, p.reduce_wait, p.optimizer, lib.step_s,
          fsdp::memory::format_bytes(lib.all_gather_bytes),
          fsdp::memory::format_bytes(lib.reduce_scatter_bytes),
          fsdp::memory::format_bytes(lib.all_reduce_bytes),
          lib.tp_calls > 0
              ? fmt::format(", tensor-parallel group {} ({} calls, {:.4f} s)",
                            fsdp::memory::format_bytes(lib.tp_bytes), lib.tp_calls, lib.tp_s)
              : std::string()));
    }
  }
  if (!t.memory_budget.empty()) {
    const int64_t budget = parse_bytes(t.memory_budget, "training.memory_budget");
    const int64_t highest = start_max(predicted.peak);
    // Every rank takes part in the reduction; the rank with the highest peak explains it.
    const int64_t mine = highest == predicted.peak ? pg_->rank() : pg_->size();
    const int64_t who = -start_max(-mine);
    if (highest > budget && pg_->rank() == who) {
      std::fprintf(stderr, "fsdp-train: warning: rank %d: %s\n", pg_->rank(),
                   budget_warning(run, predicted, budget, dp_rank()).c_str());
      std::fflush(stderr);
    }
  }
}

int64_t Trainer::start_max(int64_t v) {
  if (!membership_)
    return metrics_->max(v);
  // With fault tolerance, every rank at the start (a spare too, which the live group leaves
  // out); a restarted replica has no world group to take part in.
  TORCH_CHECK(!membership_->restarted(), "start_max: in a restarted replica");
  auto t = torch::tensor({v}, torch::kLong);
  fsdp::all_reduce(*pg_, t, fsdp::ReduceOp::kMax, "max of a metric")->wait();
  return t.item<int64_t>();
}

ComputeDtype Trainer::resolve_compute_dtype() {
  const auto& requested = config_.precision.param_dtype;
  const bool cuda = device_.is_cuda();
  // Fault tolerance: a restarted replica takes the choice the job made at its start.
  if (membership_ && membership_->restarted()) {
    const auto dtype = membership_->quorum().published("compute_dtype");
    ComputeDtype choice = choose_compute_dtype(dtype, cuda, DtypeSpeeds{});
    if (requested == "auto") {
      std::printf("fsdp-train: [rank %d] compute dtype %s, as the job chose at its start\n",
                  pg_->rank(), choice.dtype.c_str());
    }
    return choice;
  }
  DtypeSpeeds speeds;
  if (needs_dtype_speeds(requested, cuda)) {
    // A transformer layer's size, whatever the model: the ratio between the dtypes is what
    // decides, and this shape costs ~1 s where bf16 crawls and milliseconds elsewhere.
    const MatmulShape shape{256, 512, 1024};
    speeds.shape = fmt::format("{}x{}x{}", shape.m, shape.k, shape.n);
    pg_->barrier();
    speeds.fp32 = static_cast<double>(
        start_max(std::llround(measure_matmul_speed(torch::kFloat, shape).step())));
    speeds.low = static_cast<double>(start_max(
        std::llround(measure_matmul_speed(dtype_named(candidate_dtype(requested)), shape).step())));
  }
  ComputeDtype choice = choose_compute_dtype(requested, cuda, speeds);
  if (membership_)
    membership_->quorum().publish("compute_dtype", choice.dtype);
  if (pg_->rank() == 0) {
    if (requested == "auto")  // an explicit dtype shows in the "precision:" line already
      std::printf("fsdp-train: %s\n", choice.reason.c_str());
    if (!choice.warning.empty())
      std::fprintf(stderr, "fsdp-train: %s\n", choice.warning.c_str());
    std::fflush(stdout);
    std::fflush(stderr);
  }
  return choice;
}

double Trainer::evaluate() {
  torch::NoGradGuard no_grad;
  const int64_t loss_chunk = config_.training.loss_chunk;
  if (const auto* finetune = data_->finetune()) {
    // The mean over every held-out answer token of every rank.
    double sum = 0, count = 0;
    for (const auto& b : finetune->eval_batches()) {
      sum += model_
                 .loss(b.inputs.to(device_), b.labels.to(device_),
                       b.mask.to(device_, torch::kFloat), 1.0, loss_chunk)
                 .item<double>();
      count += static_cast<double>(b.targets);
    }
    const double world = pg_->size();
    return metrics_->mean(sum) * world / std::max(1.0, metrics_->mean(count) * world);
  }
  double total = 0;
  const auto& eval_set = data_->eval_set();
  for (const auto& batch : eval_set) {
    const auto t = batch.size(1) - 1;
    total += model_
                 .loss(batch.narrow(1, 0, t), batch.narrow(1, 1, t), {},
                       static_cast<double>(batch.size(0) * t), loss_chunk)
                 .item<double>();
  }
  return metrics_->mean(total / static_cast<double>(eval_set.size()));
}

namespace {

// Each phase's median over `runs` (without the step's total).
MeasuredTime median_phases(const std::vector<fsdp::StepBreakdown>& runs) {
  auto median = [&](double fsdp::StepBreakdown::*f) {
    std::vector<double> v;
    for (const auto& b : runs)
      v.push_back(b.*f);
    std::sort(v.begin(), v.end());
    return (v[v.size() / 2] + v[(v.size() - 1) / 2]) / 2;
  };
  MeasuredTime m;
  m.forward = median(&fsdp::StepBreakdown::forward_s);
  m.backward = median(&fsdp::StepBreakdown::backward_s);
  m.all_gather_wait = median(&fsdp::StepBreakdown::all_gather_wait_s);
  m.reduce_wait = median(&fsdp::StepBreakdown::reduce_wait_s);
  m.optimizer = median(&fsdp::StepBreakdown::optimizer_s);
  m.other = median(&fsdp::StepBreakdown::other_s);
  return m;
}

}  // namespace

MeasuredTime Trainer::time_by_blocks(const std::string& model_file) {
  // The job with 1 and then 3 blocks (2 if it has fewer), on the job's ranks with the job's
  // options and batch shape (random tokens), timed by its own profiler, the median of 4 steps
  // after 2 warm-up steps per phase; each phase is the root's part plus a part per block, which
  // the two sizes give (3 rather than 2: the noise of the difference is multiplied by the blocks
  // it is extrapolated to).
  const auto& t = config_.training;
  const FinetuneData* finetune = data_->finetune();
  const std::array<int64_t, 2> sizes{1, std::min<int64_t>(3, std::max<int64_t>(2, model_.n_layer))};
  std::array<MeasuredTime, 2> at;
  for (size_t k = 0; k < sizes.size(); ++k) {
    Config small = config_;
    small.model.n_layer = sizes[k];
    const auto tp = mesh_ ? mesh_->tp : nullptr;
    TrainModel model =
        finetune ? build_finetune_model(config_, model_file, *units_, device_, sizes[k], tp,
                                        /*read_weights=*/false)
                 : build_model(small, data_->prepared().vocab_size, *units_, device_, tp);
    // Steps without loss scaling, and from no previous norm.
    Optimizers optimizers(small, *model.module, pg_);
    fsdp::StepProfiler profiler(model.module);
    constexpr int kWarmup = 2, kTimed = 4;
    std::vector<fsdp::StepBreakdown> runs;
    for (int step = 0; step < kWarmup + kTimed; ++step) {
      // Random tokens of the job's batch shape; for conversations, a typical padded length and
      // ids below 256 (byte tokens, in every vocabulary).
      Batch batch;
      const auto ids = torch::TensorOptions().dtype(torch::kLong);
      if (finetune) {
        const int64_t length = finetune->typical_batch_input(t.batch_size);
        auto& c = batch.conversations;
        c.inputs = torch::randint(256, {t.batch_size, length}, ids);
        c.labels = torch::randint(256, {t.batch_size, length}, ids);
        c.mask = torch::ones({t.batch_size, length});
        c.targets = t.batch_size * length;
      } else {
        batch.tokens =
            torch::randint(data_->prepared().vocab_size, {t.batch_size, t.seq_len + 1}, ids)
                .to(device_);
      }
      StepMetrics unused;
      pg_->barrier();
      profiler.begin_step();
      run_step(StepParts{model, optimizers.optimizer(), optimizers.params(), profiler, nullptr,
                         optimizers.previous_grad_norm()},
               batch, unused);
      const auto b = profiler.end_step();
      if (step >= kWarmup)
        runs.push_back(b);
    }
    at[k] = median_phases(runs);
  }
  const double n = static_cast<double>(model_.n_layer);
  const double apart = static_cast<double>(sizes[1] - sizes[0]);
  auto scale = [&](double MeasuredTime::*f) {
    const double block = (at[1].*f - at[0].*f) / apart;
    return std::max(0.0, at[0].*f + (n - 1) * block);
  };
  MeasuredTime out;
  for (auto f : {&MeasuredTime::forward, &MeasuredTime::backward, &MeasuredTime::all_gather_wait,
                 &MeasuredTime::reduce_wait, &MeasuredTime::optimizer, &MeasuredTime::other})
    out.*f = scale(f);
  out.step = out.forward + out.backward + out.all_gather_wait + out.reduce_wait + out.optimizer +
             out.other;
  out.steps = 2 * 4;
  return out;
}

torch::Tensor Trainer::micro_batch_loss(TrainModel& model, const Batch& batch, int64_t i) {
  // Gradient accumulation: micro-batch losses are scaled so that their sum is the batch mean
  // (for conversations: the mean over the batch's answer tokens).
  const auto& t = config_.training;
  const int64_t micro = t.micro_batches, rows = t.batch_size / micro;
  if (data_->finetune()) {
    const auto& conversations = batch.conversations;
    auto inputs = conversations.inputs.narrow(0, i * rows, rows).to(device_);
    auto labels = conversations.labels.narrow(0, i * rows, rows).to(device_);
    auto mask = conversations.mask.narrow(0, i * rows, rows).to(device_);
    const double answers = static_cast<double>(std::max<int64_t>(1, conversations.targets));
    return model.loss(inputs, labels, mask.to(torch::kFloat), answers, t.loss_chunk);
  }
  // cross_entropy's mean over the micro-batch's positions, divided by the micro-batches.
  auto mb = batch.tokens.narrow(0, i * rows, rows);
  return model.loss(mb.narrow(1, 0, t.seq_len), mb.narrow(1, 1, t.seq_len), {},
                    static_cast<double>(rows * t.seq_len * micro), t.loss_chunk);
}

void Trainer::optimizer_phase(const StepParts& parts, UpdateInBackward* in_backward,
                              const PreviousNormClip& clip, StepMetrics& m) {
  const auto& t = config_.training;
  const bool previous_clip = clip.max_norm > 0;
  auto scope = parts.profiler.optimizer();
  fsdp::trace::Span span("optimizer_phase", "optimizer phase");
  fsdp::memory::CategoryScope optimizer_state(fsdp::memory::Category::kOptimizer);
  static const int optimizer_moment = fsdp::memory::moment_id("optimizer");
  fsdp::memory::set_moment(optimizer_moment);
  // With loss scaling the grads are unscaled before clipping, and a step whose grads
  // overflowed on any rank is skipped on every rank.
  if (in_backward) {
    // The units have stepped; only the norm of the gradients they saw is left to reduce.
    in_backward->arm(false);
    if (previous_clip)
      m.grad_norm = in_backward->norm();
  } else {
    if (parts.scaler)
      parts.scaler->unscale_(parts.optimizer);
    if (t.grad_clip > 0 && !previous_clip)
      m.grad_norm =
          fsdp::clip_grad_norm_(parts.params, t.grad_clip, norm_group(), parts.model.tp_params);
    if (previous_clip) {
      fsdp::GradNormSum norm(norm_group(), parts.model.tp_params);
      norm.add(parts.params);
      m.grad_norm = norm.reduce();
      if (clip.factor() != 1.0)
        scale_grads(parts.params, clip.factor());
    }
    if (parts.scaler) {
      m.loss_scale = parts.scaler->get_scale();  // the scale this step's loss was multiplied by
      parts.scaler->step(parts.optimizer);
      parts.scaler->update();
      m.skipped_steps = parts.scaler->skipped_steps();
    } else {
      parts.optimizer.step();
    }
  }
  if (previous_clip)
    parts.previous_grad_norm = *m.grad_norm;
}

double Trainer::run_step(const StepParts& parts, const Batch& batch, StepMetrics& m) {
  const auto& t = config_.training;
  parts.optimizer.zero_grad();
  const bool previous_clip = t.grad_clip > 0 && t.grad_clip_mode == "previous_step";
  const PreviousNormClip clip{previous_clip ? t.grad_clip : 0.0, parts.previous_grad_norm};
  // fsdp.optimizer_in_backward: the last micro-batch's backward steps the units (the config
  // allows only fused optimizers, no loss scaling, no clipping by this step's norm).
  std::optional<UpdateInBackward> in_backward;
  if (config_.fsdp.optimizer_in_backward) {
    in_backward.emplace(*parts.model.module, dynamic_cast<fsdp::FusedOptimizer&>(parts.optimizer),
                        *pg_, clip.factor(), previous_clip, parts.model.tp_params);
  }
  const double loss_sum = backward_passes(parts, batch, in_backward ? &*in_backward : nullptr);
  optimizer_phase(parts, in_backward ? &*in_backward : nullptr, clip, m);
  return loss_sum;
}

double Trainer::backward_passes(const StepParts& parts, const Batch& batch,
                                UpdateInBackward* in_backward) {
  const auto& t = config_.training;
  const int64_t micro = t.micro_batches;
  double loss_sum = 0;
  for (int64_t i = 0; i < micro; ++i) {
    if (micro > 1 && !config_.fsdp.sync_every_micro_batch) {
      fsdp::set_requires_gradient_sync(*parts.model.module, i == micro - 1);
    }
    torch::Tensor loss;
    // What forward and backward allocate is activations, unless the engine tags it as its own
    // (gathered parameters, gradients).
    fsdp::memory::CategoryScope activations(fsdp::memory::Category::kActivations);
    {
      auto scope = parts.profiler.forward();
      fsdp::trace::Span span("forward_pass", "forward pass");
      loss = micro_batch_loss(parts.model, batch, i);
    }
    {
      auto scope = parts.profiler.backward();
      fsdp::trace::Span span("backward_pass", "backward pass");
      if (in_backward)
        in_backward->arm(i == micro - 1);
      (parts.scaler ? parts.scaler->scale(loss) : loss).backward();
    }
    loss_sum += loss.item<double>();
  }
  return loss_sum;
}

Batch Trainer::begin_step(int64_t step, StepMetrics& m) {
  m.step = step;
  m.lr = optimizers_->set_lr(step);
  metrics_->reset_peak();
  if (mesh_)
    tp_at_step_start_ = mesh_->tp->comm_stats();
  profiler_->begin_step();
  fsdp::trace::Span span("data", "data");
  return data_->next();
}

StepMetrics Trainer::train_step(int64_t step) {
  StepMetrics m;
  const Batch batch = begin_step(step, m);
  auto& o = *optimizers_;
  const double loss_sum = run_step(
      StepParts{model_, o.optimizer(), o.params(), *profiler_, o.scaler(), o.previous_grad_norm()},
      batch, m);
  end_step(step, batch, m);
  fsdp::trace::Span span("metrics", "metrics");
  std::optional<double> local_tokens;
  if (data_->finetune())  // batches padded to their own longest conversation: counted
    local_tokens = static_cast<double>(data_->tokens_in(batch));
  else
    m.tokens = data_->tokens_in(batch) * dp_size();
  metrics_->reduce(m, loss_sum, local_tokens);
  return m;
}

void Trainer::end_step(int64_t step, const Batch& batch, StepMetrics& m) {
  auto& o = *optimizers_;
  // A step ends when the device is done with it: CUDA runs behind the host, and without this
  // the optimizer's kernels would finish inside the metrics' all-reduce, outside the step time.
  if (device_.is_cuda())
    torch::cuda::synchronize(device_.index());
  const fsdp::StepBreakdown b = profiler_->end_step();

  // StepMetrics' phase times include the waits inside them (Note [Waits inside phases] in
  // metrics.h); the profiler's exclude them. A gradient-reduction wait inside forward
  // (normally none) is counted in backward: the breakdown subtracts the same total from the
  // two phases, so its rows stay disjoint and sum to the step time.
  m.step_time_s = b.step_s;
  m.time_forward_s = b.forward_s + b.all_gather_wait_forward_s;
  m.time_backward_s =
      b.backward_s + (b.all_gather_wait_s - b.all_gather_wait_forward_s) + b.reduce_wait_s;
  m.time_allgather_wait_s = b.all_gather_wait_s;
  m.time_allgather_wait_forward_s = b.all_gather_wait_forward_s;
  m.time_reducescatter_wait_s = b.reduce_wait_s;
  m.time_optimizer_s = b.optimizer_s;
  o.record_offload(m);
  m.allgather_bytes = b.comm.all_gather.bytes;
  m.reducescatter_bytes = b.comm.reduce_scatter.bytes;
  m.allreduce_bytes = b.comm.all_reduce.bytes;
  if (mesh_) {  // the units' groups are the dp axis: the tp group's traffic is counted apart
    const auto tp = mesh_->tp->comm_stats() - tp_at_step_start_;
    m.tp_bytes = tp.all_reduce.bytes + tp.all_gather.bytes + tp.reduce_scatter.bytes;
  }
  // This rank's own measurements, for the planner's comparison: steady steps only (the first
  // one creates the optimizer state, which the prediction already counts).
  if (plan_check_ && step > start_step_ + 1)
    plan_check_->record_step(data_->length_of(batch), b);
}

void Trainer::write_trace(std::pair<int64_t, int64_t> steps) {
  fsdp::trace::stop();
  fsdp::trace::set_step(-1);
  const auto dir = std::filesystem::path(config_.logging.run_dir) / "trace";
  const auto path = dir / fmt::format("rank{}.json", pg_->rank());
  try {
    fsdp::write_chrome_trace(path.string(), fsdp::trace::collect(), pg_->rank(), pg_->size());
    if (kernel_profile_) {
      const auto kernels = dir / fmt::format("rank{}.kernels.json", pg_->rank());
      metrics_->message(kernel_profile_->stop_and_write(
          kernels.string(), static_cast<int>(steps.second - steps.first + 1)));
      kernel_profile_.reset();
    }
  } catch (const std::exception& e) {
    // A diagnostics file that cannot be written (a full disk) must not end the run: the other
    // ranks would wait for this one in their next collective.
    std::fprintf(stderr, "fsdp-train: warning: no trace written: %s\n", e.what());
    return;
  }
  metrics_->message(fmt::format("trace of step{} {}: {}/rank*.json (ui.perfetto.dev)",
                                steps.first == steps.second ? "" : "s", config_.logging.trace_steps,
                                dir.string()));
}

void Trainer::train() {
  if (membership_)
    return train_fault_tolerant();
  const auto& t = config_.training;
  std::vector<std::string> answers_before;
  if (data_->finetune())
    answers_before = answer_questions();
  const double initial_eval = evaluate();
  metrics_->message(fmt::format("step {}: held-out loss {:.4f}", start_step_, initial_eval));
  int64_t steps_run = 0;
  std::optional<double> last_eval_loss;
  const auto start = Clock::now();
  const int64_t every = config_.checkpoint.every;
  const auto traced = trace_step_range(config_);
  for (int64_t step = start_step_ + 1; step <= t.steps; ++step) {
    // logging.trace_steps: recording covers the traced steps, from the learning rate to the
    // metrics line (and an evaluation due after the step), and a checkpoint saved after a traced
    // step but the last (its collectives, tagged with that step).
    const bool tracing = traced && step >= traced->first && step <= traced->second;
    if (tracing && !fsdp::trace::enabled()) {
      fsdp::trace::set_thread_name("main");
      fsdp::trace::start();
      if (device_.is_cuda())
        kernel_profile_ = KernelProfile::start();
    }
    fsdp::trace::set_step(tracing ? step : -1);
    auto step_span = fsdp::trace::begin();
    auto m = train_step(step);
    const bool eval_now = step == t.steps || (t.eval_every > 0 && step % t.eval_every == 0);
    if (eval_now) {
      fsdp::trace::Span span("eval", "evaluation");
      m.eval_loss = evaluate();
    }
    ++steps_run;
    if (m.eval_loss)
      last_eval_loss = m.eval_loss;
    // The step is logged before the checkpoint that contains it: a job killed after the
    // checkpoint resumes after this step and must find its metrics line written.
    if (pg_->rank() == 0) {
      fsdp::trace::Span span("metrics", "metrics log");
      const double elapsed = seconds_since(start);
      metrics_->log(m, elapsed / static_cast<double>(step - start_step_) *
                           static_cast<double>(t.steps - step));
      if (eval_now) {
        metrics_->message(fmt::format("step {}: held-out loss {:.4f} (train {:.4f})", step,
                                      *m.eval_loss, m.loss));
      }
    }
    // Kineto's name for a step, which Holistic Trace Analysis looks for.
    fsdp::trace::end(step_span, "step", "ProfilerStep#" + std::to_string(step));
    if (tracing && step == traced->second)
      write_trace(*traced);
    // Every rank sees the same (averaged) loss, so all stop together.
    if (!std::isfinite(m.loss))
      throw std::runtime_error(fmt::format("loss is {} at step {}", m.loss, step));
    if (every > 0 && (step % every == 0 || step == t.steps))
      save_checkpoint(step);
  }
  finish_async_save();
  report_plan();
  if (config_.checkpoint.export_hf)
    export_hf(export_dir(config_), /*replace=*/true);
  if (data_->finetune())
    write_finetune_outputs(answers_before, answer_questions());
  if (pg_->rank() == 0) {
    metrics_->finish();
    if (steps_run == 0) {
      std::printf("nothing to train: the checkpoint is at step %lld of %lld\n",
                  static_cast<long long>(start_step_), static_cast<long long>(t.steps));
      return;
    }
    std::printf("held-out loss: %.4f -> %.4f\n", initial_eval, *last_eval_loss);
    write_outputs();
  }
}

void Trainer::report_plan() {
  if (!config_.logging.plan || !speaks())
    return;
  if (!plan_check_) {  // none made (CUDA, no tracking allocator), or not by this rank
    if (membership_ && membership_->restarted()) {
      metrics_->message("no comparison with the memory plan: the rank writing (" +
                        std::to_string(pg_->rank()) + ") was restarted since the job began");
    }
    return;
  }
  if (plan_check_->measured().steps == 0)
    return;
  std::string json;
  for (const auto& line : plan_check_->compare(&json))
    metrics_->message(line);
  fsdp::write_file_atomic((std::filesystem::path(config_.logging.run_dir) / "plan.json").string(),
                          json);
}

std::string step_dir_name(int64_t step) {
  return fmt::format("step-{:08d}", step);
}

namespace {

// Complete checkpoints (their index written last) under `root`, oldest first.
std::vector<std::filesystem::path> complete_checkpoints(const std::filesystem::path& root) {
  std::vector<std::filesystem::path> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(root, ec)) {
    const auto name = e.path().filename().string();
    if (name.size() == 13 && name.rfind("step-", 0) == 0 &&
        std::filesystem::exists(e.path() / "index.json"))
      out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The newest complete checkpoint under checkpoint_dir, if any.
std::optional<std::filesystem::path> latest_checkpoint(const Config& config) {
  auto done = complete_checkpoints(checkpoint_dir(config));
  if (done.empty())
    return std::nullopt;
  return done.back();
}

// A directory about to be written again (a checkpoint of the same step from an abandoned run,
// an earlier export) is moved here first, and removed once the new one is complete: a crash in
// between loses neither.
std::filesystem::path aside_path(const std::filesystem::path& dir) {
  return dir.string() + ".replaced";
}

void move_aside(const std::filesystem::path& dir) {
  if (!std::filesystem::exists(dir))
    return;
  std::filesystem::remove_all(aside_path(dir));
  std::filesystem::rename(dir, aside_path(dir));
}

std::string to_hex(const torch::Tensor& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  const auto* p = bytes.data_ptr<uint8_t>();
  for (int64_t i = 0; i < bytes.numel(); ++i) {
    out.push_back(digits[p[i] >> 4]);
    out.push_back(digits[p[i] & 15]);
  }
  return out;
}

torch::Tensor from_hex(const std::string& text, const std::string& what) {
  if (text.size() % 2 != 0 || text.find_first_not_of("0123456789abcdef") != std::string::npos)
    throw fsdp::safetensors::FormatError(what + " is not hex");
  auto out = torch::empty({static_cast<int64_t>(text.size() / 2)}, torch::kUInt8);
  auto* p = out.data_ptr<uint8_t>();
  for (size_t i = 0; i < text.size() / 2; ++i)
    p[i] = static_cast<uint8_t>(std::stoi(text.substr(2 * i, 2), nullptr, 16));
  return out;
}

// What a directory of saved weights holds (model.init_from, `fsdp-train export/generate
// --checkpoint`): a sharded checkpoint (index.json) or a Hugging Face directory (config.json);
// a ConfigError, after `what`, for neither.
enum class SavedModel { kShardedCheckpoint, kHuggingFace };

SavedModel saved_model_in(const std::filesystem::path& dir, const std::string& what = "") {
  if (std::filesystem::exists(dir / "index.json"))
    return SavedModel::kShardedCheckpoint;
  if (std::filesystem::exists(dir / "config.json"))
    return SavedModel::kHuggingFace;
  throw ConfigError(what + "'" + dir.string() +
                    "' is neither a sharded checkpoint (index.json) nor a Hugging Face "
                    "directory (config.json)");
}

// The bytes of the files in `dir`.
uint64_t directory_bytes(const std::filesystem::path& dir) {
  uint64_t bytes = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    bytes += e.is_regular_file() ? e.file_size() : 0;
  return bytes;
}

}  // namespace

void Trainer::save_checkpoint(int64_t step) {
  namespace fs = std::filesystem;
  finish_async_save();  // at most one in flight
  const fs::path dir = fs::path(checkpoint_dir(config_)) / step_dir_name(step);
  // The ranks training now save (the first of them writes the files, as the first holder of
  // every row: fsdp::param_shards).
  const auto& group = training_group();
  const int rank = group->rank();
  // Every rank's random state, gathered, so that rank 0 writes them all.
  torch::Tensor rng;
  {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng = gen.get_state();
  }
  const auto rngs = fsdp::all_gather_bytes(*group, to_hex(rng), "random states");
  // A checkpoint of this step from an abandoned run (resumed from an earlier one).
  if (rank == 0)
    move_aside(dir);
  group->barrier();
  const auto sampler = data_->state();
  std::map<std::string, std::string> meta = {{"step", std::to_string(step)},
                                             {"world_size", std::to_string(pg_->size())},
                                             {"sampler.epoch", std::to_string(sampler.epoch)},
                                             {"sampler.position", std::to_string(sampler.position)},
                                             {"sampler.seed", std::to_string(sampler.seed)},
                                             {"config", to_toml(config_)}};
  optimizers_->save_meta(meta);
  const auto& ranks = group->global_ranks();
  if (membership_)
    meta["live_ranks"] = fmt::format("{}", fmt::join(ranks, ","));
  if (rank == 0) {
    for (size_t i = 0; i < ranks.size(); ++i)
      meta["rng." + std::to_string(ranks[i])] = rngs[i];
  }
  if (async_saves_) {  // checkpoint.async: finished by the next save or the end of training
    async_removed_.clear();
    async_saves_->set_group(group);
    async_saves_->start(
        dir.string(), *model_.module, &optimizers_->optimizer(), meta, model_.tp_layout,
        [this, dir, keep = config_.checkpoint.keep] { async_removed_ = after_save(dir, keep); });
    async_step_ = step;
    async_reports_ = rank == 0;  // its writer commits
    return;
  }
  const auto save_start = Clock::now();
  fsdp::save_sharded(dir.string(), *model_.module, &optimizers_->optimizer(), *group, meta,
                     model_.tp_layout);
  const double save_seconds = seconds_since(save_start);
  if (rank == 0) {
    for (const auto& line : after_save(dir, config_.checkpoint.keep))
      metrics_->message(line);
    const uint64_t bytes = directory_bytes(dir);
    metrics_->message(fmt::format("step {}: checkpoint {} ({:.1f} MB in {:.2f} s, {:.0f} MB/s)",
                                  step, dir.string(), bytes / 1e6, save_seconds,
                                  bytes / 1e6 / std::max(save_seconds, 1e-9)));
  }
}

void Trainer::finish_async_save() {
  if (!async_saves_)
    return;
  std::optional<fsdp::AsyncSaveResult> done;
  try {
    done = async_saves_->wait();
  } catch (const std::exception& e) {
    if (!membership_)
      throw;
    // A rank of the save's group died before it wrote its file (its rank 0 waited for it a
    // timeout), or a write failed: no collective ran on this thread, so the groups are sound.
    std::fprintf(stderr,
                 "fsdp-train: [rank %d] the checkpoint of step %lld was not completed (the "
                 "previous one stays the latest): %s\n",
                 pg_->rank(), static_cast<long long>(async_step_), first_line(e).c_str());
    return;
  }
  if (!done || !async_reports_)
    return;
  const std::filesystem::path dir = done->dir;
  // Its rank 0 may no longer write the run's lines (fault tolerance: a lower replica came back
  // since): it says them itself.
  const auto say = [this](const std::string& line) {
    if (metrics_->has_outputs()) {
      metrics_->message(line);
    } else {
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    }
  };
  for (const auto& line : async_removed_)
    say(line);
  say(fmt::format(
      "step {}: checkpoint {} ({:.1f} MB, training stalled {:.2f} s; written and committed in "
      "the background in {:.2f} s)",
      async_step_, dir.string(), directory_bytes(dir) / 1e6, done->stall_seconds, done->seconds));
}

std::vector<std::string> Trainer::after_save(const std::filesystem::path& dir, int64_t keep_n) {
  namespace fs = std::filesystem;
  std::vector<std::string> removed;
  fs::remove_all(aside_path(dir));
  // Checkpoints of later steps belong to a run this one replaced (a fresh start in the same
  // directory, or a resume from an earlier checkpoint): removed, so that "latest" is this run's
  // and checkpoint.keep counts this run's own (names sort by step).
  std::vector<fs::path> done;
  for (auto& p : complete_checkpoints(dir.parent_path())) {
    if (p.filename().string() > dir.filename().string()) {
      fs::remove_all(p);
      removed.push_back("removed " + p.string() + ", a checkpoint of the run this one replaced");
    } else {
      done.push_back(std::move(p));
    }
  }
  const auto keep = static_cast<size_t>(keep_n);
  for (size_t i = 0; i + keep < done.size(); ++i)
    fs::remove_all(done[i]);
  return removed;
}

std::optional<std::filesystem::path> Trainer::resume_dir() const {
  const auto& resume = config_.checkpoint.resume;
  if (resume.empty())
    return std::nullopt;
  if (resume != "latest" && resume != "auto")
    return std::filesystem::path(resume);
  const auto latest = latest_checkpoint(config_);
  if (!latest && resume == "auto")
    return std::nullopt;  // the first start of a job its launcher may restart
  if (!latest)
    throw std::runtime_error("checkpoint.resume = latest: no complete checkpoint in " +
                             checkpoint_dir(config_));
  return *latest;
}

void Trainer::check_saved_inputs() const {
  // The checkpoint's index (and model.init_from's, when it is a checkpoint): a bad one is
  // refused here in a fraction of a second, not after the model is built and measured (seconds
  // for a pretrained one).
  if (const auto dir = resume_dir()) {
    fsdp::read_checkpoint_metadata(dir->string());
    return;  // a resumed run does not read model.init_from
  }
  const auto& from = config_.model.init_from;
  if (from.empty() || from == "latest")
    return;
  if (saved_model_in(from, "model.init_from: ") == SavedModel::kShardedCheckpoint)
    fsdp::read_checkpoint_metadata(from);
}

int64_t Trainer::resume_from_checkpoint() {
  const auto resumed = resume_dir();
  if (!resumed)
    return 0;
  const std::filesystem::path dir = *resumed;
  const CheckpointMeta meta(
      fsdp::load_sharded(dir.string(), *model_.module, &optimizers_->optimizer(), model_.tp_layout),
      (dir / "index.json").string());
  const int64_t step = meta.count("step");
  const int64_t saved_world = meta.count("world_size");
  meta.check_random_states(saved_world);
  try {
    data_->load_state({meta.count("sampler.epoch"), meta.count("sampler.position"),
                       static_cast<uint64_t>(meta.count("sampler.seed"))});
  } catch (const fsdp::safetensors::FormatError&) {
    throw;
  } catch (const std::exception& e) {
    throw meta.bad("sampler.*", std::string("does not fit this run: ") + e.what());
  }
  optimizers_->load_meta(meta);
  // Ranks that existed when it was saved get their random state back; others keep theirs.
  if (const auto rng = meta.rng_state(pg_->rank())) {
    const std::string key = "rng." + std::to_string(pg_->rank());
    at::Generator gen = at::detail::getDefaultCPUGenerator();  // a handle to the global one
    std::lock_guard<std::mutex> lock(gen.mutex());
    const auto state = from_hex(*rng, meta.index() + ": metadata '" + key + "'");
    try {
      gen.set_state(state);
    } catch (const c10::Error& e) {
      throw meta.bad(key, "is not a random state: " + e.msg());
    }
  }
  if (pg_->rank() == 0) {
    const std::string by =
        meta.has("live_ranks")  // a fault-tolerant job's live replicas
            ? "by ranks " + meta.text("live_ranks") + " of " + meta.text("world_size")
            : "on " + meta.text("world_size") + " rank(s)";
    std::printf("resumed from %s (step %lld, saved %s)\n", dir.c_str(),
                static_cast<long long>(step), by.c_str());
  }
  return step;
}

std::string Trainer::load_weights(const std::string& path) {
  namespace fs = std::filesystem;
  fs::path dir = path;
  if (path == "latest") {
    const auto latest = latest_checkpoint(config_);
    if (!latest)
      throw std::runtime_error("no complete checkpoint in " + checkpoint_dir(config_));
    dir = *latest;
  }
  if (saved_model_in(dir) == SavedModel::kShardedCheckpoint) {
    fsdp::load_sharded(dir.string(), *model_.module, nullptr, model_.tp_layout);
  } else {
    if (model_.tp)
      throw ConfigError(dir.string() +
                        ": a Hugging Face directory does not load into a model split with "
                        "parallel.tp > 1 yet; start from a sharded checkpoint");
    model_.load_hf(dir.string());
  }
  return dir.string();
}

void Trainer::export_hf(const std::string& dir, bool replace) {
  namespace fs = std::filesystem;
  // The ranks training now (the first of them holds the rows the file gets).
  fsdp::ProcessGroup& group = *training_group();
  if (replace && group.rank() == 0)
    move_aside(dir);
  group.barrier();
  const auto start = Clock::now();
  fsdp_models::ExportOptions options;
  options.dtype = dtype_named(config_.checkpoint.export_dtype);
  options.shard_bytes = std::llround(config_.checkpoint.export_shard_mb * (1 << 20));
  options.files = data_->export_files();  // fine-tuning: none here, the model adds its own
  if (model_.tp)
    whole_model(dir + ".tp-staging").save_hf(dir, *pg_, options);
  else
    model_.save_hf(dir, group, options);
  const double seconds = seconds_since(start);
  if (group.rank() != 0)
    return;
  fs::remove_all(aside_path(dir));
  uintmax_t bytes = 0;  // every weights file, sharded or not
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".safetensors")
      bytes += e.file_size();
  const auto text = fmt::format("Hugging Face directory {} ({:.1f} MB in {:.2f} s, {:.0f} MB/s)",
                                dir, bytes / 1e6, seconds, bytes / 1e6 / std::max(seconds, 1e-9));
  if (metrics_->has_outputs())
    metrics_->message(text);
  else
    std::printf("%s\n", text.c_str());
}

namespace {

// Moves `from`'s values into `to` through a sharded checkpoint at `staging` (whole tensors by
// design, whatever either model's split; removed after): every rank of `world` calls it.
void move_through_checkpoint(const std::string& staging, TrainModel& from, TrainModel& to,
                             fsdp::ProcessGroup& world) {
  namespace fs = std::filesystem;
  if (world.rank() == 0)
    fs::remove_all(staging);  // left by a job that died
  world.barrier();
  fsdp::save_sharded(staging, *from.module, nullptr, world, {}, from.tp_layout);
  fsdp::load_sharded(staging, *to.module, nullptr, to.tp_layout);
  world.barrier();  // every rank has read it
  if (world.rank() == 0)
    fs::remove_all(staging);
}

}  // namespace

TrainModel Trainer::whole_model(const std::string& staging) {
  Config whole = config_;
  whole.parallel.tp = 1;
  whole.parallel.sequence_parallel = false;
  const int local_world = fsdp::launch_env_from_environment().local_world_size;
  const UnitOptions units = unit_options(whole, pg_, compute_dtype_.dtype, local_world);
  TrainModel out = data_->finetune()
                       ? build_finetune_model(whole, data_->model_file(), units, device_,
                                              /*only_blocks=*/0, nullptr, /*read_weights=*/false)
                       : build_model(whole, data_->prepared().vocab_size, units, device_);
  move_through_checkpoint(staging, model_, out, *pg_);
  return out;
}

TrainModel Trainer::build_finetune(const std::string& model_file, const UnitOptions& units) {
  if (!mesh_)
    return build_finetune_model(config_, model_file, units, device_);
  // The pretrained file's loaders read whole layers: the model is read whole (sharded over the
  // world), then moved into its split self through a sharded checkpoint.
  const int local_world = fsdp::launch_env_from_environment().local_world_size;
  Config whole_config = config_;
  whole_config.parallel.tp = 1;
  TrainModel split = build_finetune_model(config_, model_file, units, device_, /*only_blocks=*/0,
                                          mesh_->tp, /*read_weights=*/false);
  TrainModel whole = build_finetune_model(
      whole_config, model_file, unit_options(whole_config, pg_, compute_dtype_.dtype, local_world),
      device_);
  move_through_checkpoint(
      (std::filesystem::path(checkpoint_dir(config_)) / ".pretrained-tp-staging").string(), whole,
      split, *pg_);
  return split;
}

void Trainer::write_outputs() {
  const std::filesystem::path dir(config_.logging.run_dir);
  // This run's steps, as logged (a resumed run's file also holds the steps before it).
  std::vector<StepMetrics> history = read_metrics(metrics_->metrics_path());
  std::erase_if(history, [&](const StepMetrics& s) { return s.step <= start_step_; });
  const std::string table = breakdown_table(history);
  std::printf("\n%s\n", table.c_str());
  fsdp::write_file_atomic((dir / "breakdown.txt").string(), table);
  if (config_.logging.plot) {
    write_plot(history, (dir / "plot.png").string(),
               fmt::format("fsdp-train: {} on {} rank(s)", model_.description, pg_->size()));
  }
  std::printf("run directory: %s (metrics.jsonl, breakdown.txt%s%s, config.toml)\n", dir.c_str(),
              config_.logging.plot ? ", plot.png" : "",
              metrics_->writes_tensorboard() ? ", tensorboard/" : "");
}

std::vector<std::string> Trainer::answer_questions() {
  const auto& finetune = *data_->finetune();
  const auto questions = finetune.questions(config_.finetune.samples);
  std::vector<std::string> answers;
  if (questions.empty())
    return answers;
  torch::NoGradGuard no_grad;
  // Greedy, so every rank computes the same tokens and runs the same forwards; gathered once
  // for all of them (the model is small next to what training holds).
  fsdp::UnshardGuard gathered(*model_.module);
  const auto& tok = finetune.tokenizer();
  for (const auto& [prompt, reference] : questions) {
    std::vector<int64_t> ids = prompt, answer;
    for (int64_t i = 0; i < config_.finetune.answer_tokens; ++i) {
      const int64_t n = std::min<int64_t>(config_.finetune.max_tokens, ids.size());
      auto input = torch::tensor(std::vector<int64_t>(ids.end() - n, ids.end())).unsqueeze(0);
      const int64_t next =
          model_.next_logits(input.to(device_)).squeeze(0).argmax().item<int64_t>();
      if (next == finetune.end_of_turn_id() || next == tok.eos_id())
        break;
      ids.push_back(next);
      answer.push_back(next);
    }
    // Valid UTF-8 to show (a byte-level answer may end inside a character).
    answers.push_back(printable_utf8(tok.decode(answer)));
  }
  return answers;
}

void Trainer::write_finetune_outputs(const std::vector<std::string>& before,
                                     const std::vector<std::string>& after) {
  namespace fs = std::filesystem;
  const fs::path dir(config_.logging.run_dir);
  const auto& f = config_.finetune;
  fsdp::ProcessGroup& group = *training_group();
  if (model_.save_adapter && f.save_adapter) {
    const auto adapter = (dir / "adapter").string();
    if (group.rank() == 0)
      move_aside(adapter);
    group.barrier();
    if (model_.tp)  // PEFT's files hold whole adapters: written from the whole model
      whole_model(adapter + ".tp-staging").save_adapter(adapter, *pg_);
    else
      model_.save_adapter(adapter, group);
    if (group.rank() == 0) {
      fs::remove_all(aside_path(adapter));
      metrics_->message("LoRA adapter in PEFT's layout: " + adapter);
    }
  }
  if (f.export_merged)
    export_hf((dir / "merged").string(), /*replace=*/true);
  if (group.rank() != 0 || before.empty())
    return;
  const auto& finetune = *data_->finetune();
  const auto questions = finetune.questions(f.samples);
  std::string text;
  for (size_t i = 0; i < questions.size() && i < before.size() && i < after.size(); ++i) {
    // The question is the prompt's last user turn.
    const auto prompt = finetune.tokenizer().decode(questions[i].first);
    const auto question = finetune.chat_template().last_user_message(prompt);
    text += fmt::format("Q: {}\n   reference: {}\n   before:    {}\n   after:     {}\n\n", question,
                        questions[i].second, before[i], after[i]);
  }
  fsdp::write_file_atomic((dir / "answers.txt").string(), text);
  std::printf("\nheld-out questions, greedy answers before and after fine-tuning:\n\n%s",
              text.c_str());
}

std::string Trainer::generate() {
  const auto& g = config_.generate;
  if (g.tokens == 0)
    return "";
  torch::NoGradGuard no_grad;
  // Every rank samples with the same generator, so all run the same forwards (they must: each
  // forward gathers parameters from all of them, unless the model is gathered once for the
  // whole sample).
  std::optional<fsdp::UnshardGuard> gathered;
  if (g.unshard)
    gathered.emplace(*model_.module);
  auto gen =
      at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(config_.training.seed) + 1);
  const Tokenizer& tokenizer = data_->tokenizer();
  std::vector<int> ids = tokenizer.encode(g.prompt);
  if (ids.empty())
    ids.push_back(tokenizer.bos_id() >= 0 ? tokenizer.bos_id() : 0);
  const size_t prompt_len = ids.size();
  const int64_t ctx = config_.training.seq_len;
  for (int64_t i = 0; i < g.tokens; ++i) {
    const int64_t n = std::min<int64_t>(ctx, static_cast<int64_t>(ids.size()));
    auto input =
        torch::tensor(std::vector<int64_t>(ids.end() - n, ids.end()), torch::kLong).unsqueeze(0);
    auto logits = model_.next_logits(input.to(device_)).squeeze(0).cpu() / g.temperature;
    if (g.top_k > 0 && g.top_k < logits.size(0)) {
      auto kth = std::get<0>(logits.topk(g.top_k)).min();
      logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
    }
    auto probs = torch::softmax(logits, 0);
    ids.push_back(static_cast<int>(probs.multinomial(1, false, gen).item<int64_t>()));
  }
  // Shown and written as transformers shows it (the sample may end inside a character).
  const std::string text = tokenizer.decode_for_display(std::vector<int>(ids.begin(), ids.end()));
  if (speaks()) {
    if (purpose_ == Purpose::kTrain)
      fsdp::write_file_atomic(
          (std::filesystem::path(config_.logging.run_dir) / "sample.txt").string(), text + "\n");
    std::printf(
        "\nsample (%lld tokens after a %zu-token prompt, temperature %.2f, top-k %lld):\n%s\n",
        static_cast<long long>(g.tokens), prompt_len, g.temperature,
        static_cast<long long>(g.top_k), text.c_str());
  }
  return text;
}

}  // namespace fsdp_trainer
