// The training loop of fsdp-train: build, train, report, sample, close.
//
// Like torchtitan's Trainer, the entry point only parses the config and calls these; each
// component (data, model, metrics, progress) has its own file.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fsdp/distributed/process_group.h>
#include <fsdp/grad_scaler.h>
#include <fsdp/observe/step_profiler.h>

#include "compute_dtype.h"
#include "config/config.h"
#include "data/data.h"
#include "data/finetune_data.h"
#include "model_factory.h"
#include "observe/metrics.h"
#include "observe/progress.h"
#include "observe/tensorboard.h"
#include "plan_check.h"
#include "step_plan.h"
#include "text/tokenizer.h"

namespace fsdp_trainer {

/// The device memory counters of a runtime the trainer library does not link: CUDA lives in
/// fsdp-train-cuda's main() only, so that CPU runs never load CUDA libraries. Empty: the CPU's
/// (fsdp::memory's tracking allocator).
struct DeviceMemory {
  std::function<void()> reset_peak;
  std::function<int64_t()> peak_bytes;
  /// CUDA: the caching allocator's peak reserved bytes (StepMetrics::peak_reserved_bytes).
  std::function<int64_t()> peak_reserved_bytes;
};

/// What the process is for: a training run owns the run directory (config.toml, metrics.jsonl,
/// sample.txt...); the other commands only read a saved model and never touch it.
enum class Purpose { kTrain, kUseSaved };

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
  std::string prepare_inputs(int rank, int world);
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
  double run_step(const StepParts& parts, const torch::Tensor& batch,
                  const InstructBatch& conversations, StepMetrics& m);
  double evaluate();
  /// logging.trace_steps: stops recording and writes this rank's trace of `steps`.
  void write_trace(std::pair<int64_t, int64_t> steps);
  double learning_rate(int64_t step) const;
  double mean_over_ranks(double v);
  int64_t max_over_ranks(int64_t v);
  /// Resolves precision.param_dtype ("auto", or a warning for a slow explicit one) from
  /// matmul speeds every rank measures at once, the highest taken: every rank decides alike.
  ComputeDtype resolve_compute_dtype();
  /// The step's cross-rank figures, in one collective: the mean loss (of `loss_sum`) and
  /// tokens (of `local_tokens`, finetune), the largest RSS and high-water mark, and peak_bytes
  /// with, on CPU, its breakdown by memory category on the rank with the highest peak.
  void reduce_step_metrics(StepMetrics& m, double loss_sum, double local_tokens);
  void write_outputs();
  /// finetune: rank 0's greedy answers to the first finetune.samples held-out questions (every
  /// rank runs the forwards).
  std::vector<std::string> answer_questions();
  /// finetune: answers.txt (questions, reference answers, answers before and after), the PEFT
  /// adapter and the merged export, as configured.
  void write_finetune_outputs(const std::vector<std::string>& before,
                              const std::vector<std::string>& after);
  /// The data stream's position, for checkpoints.
  SamplerState sampler_state() const;
  void load_sampler_state(const SamplerState& state);
  /// Saves a sharded checkpoint of the state after `step` (every rank calls it) and removes
  /// the oldest complete ones beyond checkpoint.keep.
  void save_checkpoint(int64_t step);
  /// Restores checkpoint.resume (model, AdamW, sampler, loss scale, random state); returns
  /// the step it was saved after.
  int64_t resume_from_checkpoint();
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
  DeviceMemory device_memory_;
  Purpose purpose_;
  torch::Device device_ = torch::kCPU;
  ComputeDtype compute_dtype_;  // precision.param_dtype resolved for this machine ("auto")
  std::shared_ptr<fsdp::ProcessGroup> pg_;
  std::shared_ptr<fsdp::ProcessGroup> metrics_pg_;  // every rank, for the trainer's reductions
  PreparedData data_;
  Tokenizer tokenizer_;
  // What a pretraining run's exports carry besides the weights (tokenizer_export_files): made
  // when the tokenizer loads, so that one that cannot be written fails before training.
  std::map<std::string, std::string> export_files_;
  std::unique_ptr<TokenFile> train_file_, val_file_;
  std::unique_ptr<DistributedSampler> sampler_;
  std::vector<torch::Tensor> eval_set_;
  std::unique_ptr<FinetuneData> finetune_;  // fsdp-train finetune: instead of the above
  TrainModel model_;
  std::unique_ptr<fsdp::StepProfiler> profiler_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;  // see make_optimizer in trainer.cpp
  std::unique_ptr<fsdp::ShardedGradScaler> scaler_;     // precision.loss_scaling
  std::vector<torch::Tensor> params_;
  double previous_grad_norm_ = std::numeric_limits<double>::quiet_NaN();  // none yet
  std::unique_ptr<MetricsWriter> metrics_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;  // rank 0 with logging.tensorboard
  std::unique_ptr<Progress> progress_;
  // This run's steps are not kept in memory (a long run would grow by ~0.3 KB a step): the
  // breakdown and the plot at the end read them back from metrics.jsonl.
  int64_t steps_run_ = 0;
  std::optional<double> last_eval_loss_;
  int64_t start_step_ = 0;  // the step a resumed run continues after
  double flops_per_token_ = 0;
  double peak_flops_per_rank_ = 0;
  std::optional<PlanCheck> plan_check_;  // plan_memory(): predicted, then measured
  std::optional<UnitOptions> units_;     // how the job's units are sharded
};

}  // namespace fsdp_trainer
