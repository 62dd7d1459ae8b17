// The training loop of fsdp-train: build, train, report, sample, close.
//
// Like torchtitan's Trainer, it is assembled from parts, each a class with its own file and
// tests: the data (TrainData), the model (model_factory.h), the optimizers (Optimizers), the
// figures and outputs of each step (MetricsProcessor) and the planner's check (PlanCheck); the
// Trainer holds them and runs the steps. The entry point only parses the config and calls it.
#pragma once

#include <torch/torch.h>

#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fsdp/checkpoint/sharded_checkpoint.h>
#include <fsdp/distributed/device_mesh.h>
#include <fsdp/distributed/process_group.h>
#include <fsdp/grad_scaler.h>
#include <fsdp/observe/step_profiler.h>

#include "compute_dtype.h"
#include "config/config.h"
#include "gradient_update.h"
#include "metrics_processor.h"
#include "model_factory.h"
#include "observe/kernel_profile.h"
#include "optimizers.h"
#include "plan_check.h"
#include "replica_membership.h"
#include "step_plan.h"
#include "train_data.h"

namespace fsdp_trainer {

/// What the process is for: a training run owns the run directory (config.toml, metrics.jsonl,
/// sample.txt...); the other commands only read a saved model and never touch it.
enum class Purpose { kTrain, kUseSaved };

/// A checkpoint's directory name under checkpoint.dir: "step-00000042".
std::string step_dir_name(int64_t step);

class Trainer {
 public:
  /// Joins the job, prepares the data (rank 0; the others wait), builds and shards the model
  /// on config.training.device (for cuda, the NCCL backend must be registered). For kTrain,
  /// also applies model.init_from or checkpoint.resume and opens the run directory.
  explicit Trainer(Config config, DeviceMemory device_memory = {},
                   Purpose purpose = Purpose::kTrain);
  ~Trainer();

  /// Runs config.training.steps steps, evaluating and logging as configured; writes the run
  /// directory's outputs at the end (rank 0).
  void train();
  /// Samples config.generate.tokens tokens after the prompt (all ranks take part; rank 0's text
  /// is returned, printed and, for kTrain, written to sample.txt).
  std::string generate();
  /// Loads parameters only (every rank calls it; each reads its rows) from a sharded checkpoint
  /// directory (index.json), "latest" (the newest one in checkpoint_dir), or a Hugging Face
  /// directory (config.json + model.safetensors). Returns the directory it read.
  std::string load_weights(const std::string& path);
  /// Writes the model as a Hugging Face directory (every rank calls it; rank 0 writes). An
  /// existing directory there is refused, or with `replace` moved aside and removed once the
  /// new one is complete.
  void export_hf(const std::string& dir, bool replace);

  int rank() const { return pg_->rank(); }

 private:
  void start_flight_recorder(const fsdp::LaunchEnv& env);
  void open_run_directory();
  void describe_run(int world);
  void measure_mfu_peak();
  StepMetrics train_step(int64_t step);
  /// What a training step runs on: the job's model, optimizer, trainable parameters, profiler
  /// and loss scaler (or a smaller model's, for the planner's timing).
  struct StepParts {
    TrainModel& model;
    torch::optim::Optimizer& optimizer;
    std::vector<torch::Tensor>& params;
    fsdp::StepProfiler& profiler;
    fsdp::ShardedGradScaler* scaler;
    // training.grad_clip_mode = previous_step: the previous step's norm, updated by the step.
    double& previous_grad_norm;
  };
  /// The micro-batches' forward and backward and the optimizer phase of one step (between the
  /// profiler's begin_step and end_step); returns the sum of the micro-batch losses.
  double run_step(const StepParts& parts, const Batch& batch, StepMetrics& m);
  /// The micro-batches' forward and backward passes (the gradients zeroed before by the
  /// caller); returns the sum of their losses.
  double backward_passes(const StepParts& parts, const Batch& batch, UpdateInBackward* in_backward);
  /// A step's start: its learning rate, the peak and the profiler's step begun; returns its
  /// batch.
  Batch begin_step(int64_t step, StepMetrics& m);
  /// After the update: the profiler's step and its figures into `m` (not yet reduced).
  void end_step(int64_t step, const Batch& batch, StepMetrics& m);
  /// Micro-batch `i`'s loss of `batch` (forward), scaled so that the micro-batches' losses sum
  /// to the batch's mean.
  torch::Tensor micro_batch_loss(TrainModel& model, const Batch& batch, int64_t i);
  /// The step's update after the backward passes: unscaling, clipping (by this step's norm or
  /// the previous one's, `clip`), the optimizer step, or with `in_backward` (the units have
  /// stepped) only the norm; fills m's grad_norm, loss_scale and skipped_steps.
  void optimizer_phase(const StepParts& parts, UpdateInBackward* in_backward,
                       const PreviousNormClip& clip, StepMetrics& m);
  double evaluate();

  // ---- fsdp.fault_tolerant (trainer_ft.cpp) ----
  /// train() with replicas that drop out and come back (ReplicaMembership).
  void train_fault_tolerant();
  /// One step through the quorum's vote; throws LeftTheJob when this rank's replica leaves.
  StepMetrics fault_tolerant_step(int64_t step);
  /// ReplicaMembership's hooks: the units' cross-replica group and the figures' group follow
  /// the live replicas, and the rank that writes the outputs with them; a joining replica's
  /// state (shards, optimizer, data position) comes from one that stayed.
  void on_membership_change(int64_t step);
  void sync_replica_state(bool joining);
  /// Whether this rank prints and writes the run's outputs: rank 0, or with fault tolerance the
  /// lowest rank training now.
  bool speaks() const;
  /// The ranks training now: every rank, or with fault tolerance the live replicas' (the first
  /// of them holds the first copy of every row, and writes the files).
  const std::shared_ptr<fsdp::ProcessGroup>& training_group() const {
    return membership_ ? metrics_pg_ : pg_;
  }
  /// The group the gradient norm is summed over: the world, or with fault tolerance this
  /// replica's ranks (its gradients are the average over the live replicas already, and the
  /// norm then needs no rank of another replica).
  fsdp::ProcessGroup& norm_group();
  /// The data-parallel axis: the units' group and the ranks that split the batch (the world,
  /// or with parallel.tp > 1 the mesh's dp group; its ranks' tp groups read the same data).
  std::shared_ptr<fsdp::ProcessGroup> dp_group() const { return mesh_ ? mesh_->dp : pg_; }
  int dp_rank() const { return dp_group()->rank(); }
  int dp_size() const { return dp_group()->size(); }
  /// parallel.tp > 1: the model built whole (no tensor parallelism) over the world, holding
  /// this job's values, which it gets through a sharded checkpoint in `staging` (whole tensors
  /// by design; removed after). What a Hugging Face export of a split model writes from.
  TrainModel whole_model(const std::string& staging);
  /// The fine-tuned model of `model_file` sharded with `units`; with parallel.tp > 1 split too,
  /// its weights read whole and moved into it through a sharded checkpoint.
  TrainModel build_finetune(const std::string& model_file, const UnitOptions& units);
  /// logging.trace_steps: stops recording and writes this rank's trace of `steps`.
  void write_trace(std::pair<int64_t, int64_t> steps);
  /// Resolves precision.param_dtype ("auto", or a warning for a slow explicit one) from
  /// matmul speeds every rank measures at once, the highest taken: every rank decides alike.
  /// With fault tolerance the ranks that start the job decide and publish the choice, which a
  /// restarted replica reads.
  ComputeDtype resolve_compute_dtype();
  /// The highest `v` over the ranks that start the job (collective over them).
  int64_t start_max(int64_t v);
  /// --plan: the writer compares the plan with what its rank measured (plan.json).
  void report_plan();
  void write_outputs();
  /// finetune: rank 0's greedy answers to the first finetune.samples held-out questions (every
  /// rank runs the forwards).
  std::vector<std::string> answer_questions();
  /// finetune: answers.txt (questions, reference answers, answers before and after), the PEFT
  /// adapter and the merged export, as configured; written by every rank training now (with
  /// fault tolerance, the live replicas').
  void write_finetune_outputs(const std::vector<std::string>& before,
                              const std::vector<std::string>& after);
  /// Saves a sharded checkpoint of the state after `step` (every rank calls it; with fault
  /// tolerance, every live rank) and removes the oldest complete ones beyond checkpoint.keep.
  void save_checkpoint(int64_t step);
  /// fsdp.fault_tolerant: save_checkpoint, and a save that fails (a rank died in it, or a
  /// write failed) leaves the previous checkpoint the latest and training going: this rank's
  /// groups are then suspect, so its next step's attempt fails and the live replicas reform.
  void save_checkpoint_fault_tolerant(int64_t step);
  /// checkpoint.async: waits for the save in flight, if any (its rank 0: until committed; its
  /// writer thread has already tidied after it as after a synchronous save) and reports it.
  /// With fault tolerance a failed save is reported, not thrown (the previous checkpoint stays
  /// the latest).
  void finish_async_save();
  /// Rank 0, once the checkpoint `dir` is complete: removes what it replaced (the same step's
  /// from an abandoned run, later steps' of a replaced run) and the oldest beyond `keep`, and
  /// returns a line for each replaced run's checkpoint removed. Files only (an asynchronous
  /// save's writer thread runs it: removing a 1 GB checkpoint took 0.13 s, which the training
  /// thread would add to the saving step).
  static std::vector<std::string> after_save(const std::filesystem::path& dir, int64_t keep);
  /// Restores checkpoint.resume (model, AdamW, sampler, loss scale, random state); returns
  /// the step it was saved after.
  int64_t resume_from_checkpoint();
  /// The checkpoint checkpoint.resume names ("latest" and "auto" resolved), or nullopt for none
  /// (also "auto" before the first checkpoint).
  std::optional<std::filesystem::path> resume_dir() const;
  /// Checks the checkpoint to resume from and model.init_from before anything is built.
  void check_saved_inputs() const;
  /// --plan and training.memory_budget: predicts this rank's peak (fsdp::plan) before step 1,
  /// prints it (rank 0) and warns if any rank's exceeds the budget.
  void plan_memory(const std::string& model_file);
  /// --plan: the step time of `run` (its pieces timed), with this job's links and optimizer
  /// timed here (every rank calls it).
  fsdp::plan::TimePrediction predict_time(const RunPlan& run);
  /// --plan: the step time by phase, from the same job with 1 and 3 blocks run on these ranks
  /// (each phase is the root's part plus a part per block; fine-tuning: the blocks' weights not
  /// read, batches of a typical padded length).
  MeasuredTime time_by_blocks(const std::string& model_file);

  Config config_;
  Purpose purpose_;
  torch::Device device_ = torch::kCPU;
  ComputeDtype compute_dtype_;  // precision.param_dtype resolved for this machine ("auto")
  std::shared_ptr<fsdp::ProcessGroup> pg_;
  std::shared_ptr<fsdp::ProcessGroup> metrics_pg_;  // every rank, for the trainer's reductions
  std::optional<fsdp::DeviceMesh2D> mesh_;          // parallel.tp > 1: dp x tp
  fsdp::CommStats tp_at_step_start_;                // the tp group's counters when a step began
  std::unique_ptr<MetricsProcessor> metrics_;
  std::unique_ptr<TrainData> data_;
  TrainModel model_;
  std::unique_ptr<fsdp::StepProfiler> profiler_;
  std::unique_ptr<Optimizers> optimizers_;
  std::unique_ptr<ReplicaMembership> membership_;  // fsdp.fault_tolerant
  // after_save's lines, written by rank 0's writer thread: declared before async_saves_, whose
  // destructor waits for that thread, so that it outlives the thread.
  std::vector<std::string> async_removed_;
  std::unique_ptr<fsdp::AsyncCheckpointer> async_saves_;  // checkpoint.async
  std::unique_ptr<KernelProfile> kernel_profile_;         // logging.trace_steps on CUDA
  int64_t async_step_ = 0;                                // the step of the save in flight
  // This rank is the save in flight's rank 0 (its writer commits), which reports it.
  bool async_reports_ = false;
  int64_t start_step_ = 0;               // the step a resumed run continues after
  std::optional<PlanCheck> plan_check_;  // plan_memory(): predicted, then measured
  std::optional<UnitOptions> units_;     // how the job's units are sharded
  // finetune with fsdp.fault_tolerant: the answers before training, which a joining replica
  // receives with its state (the writer at the end may be one that joined).
  std::vector<std::string> answers_before_;
};

}  // namespace fsdp_trainer
