// The trainer's per-step metrics: one record per optimizer step, a JSON-lines log of them, the
// step-time breakdown table, and the FLOP estimates behind MFU.
//
// Only rank 0 writes the log; every value in a StepMetrics is already combined over ranks
// (sums for tokens, max for memory, rank 0's timings). The JSON field names are a contract with
// the metrics schema and the plotting tools: rename nothing without changing both.
//
// Note [Waits inside phases]: the exposed (not hidden by prefetch or overlap) all-gather wait
// happens inside forward (gathering each unit before it runs) and inside backward (gathering it
// again), and the gradient-reduction wait (reduce-scatter, and the all-reduce of no_shard and
// hybrid_shard) inside backward. time_forward_s and time_backward_s are wall times of those
// phases, so they INCLUDE these waits. The trainer measures them with fsdp::StepProfiler, whose
// StepBreakdown excludes the waits, and adds them back. The breakdown subtracts them again,
// using time_allgather_wait_forward_s to split the all-gather wait between the two phases, so
// that its rows are disjoint and add up to the step time.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "tensorboard.h"

namespace fsdp_trainer {

// ---- One step ------------------------------------------------------------------------------

/// What the trainer measured in one optimizer step. Times are seconds of wall time on rank 0.
/// Non-finite doubles (a diverged loss) are written as JSON null and read back as NaN.
struct StepMetrics {
  int64_t step = 0;
  /// Training loss of this step, mean over ranks.
  double loss = 0;
  /// Learning rate used by this step's update.
  double lr = 0;
  /// Tokens processed this step over all ranks.
  int64_t tokens = 0;
  /// tokens / step_time_s.
  double tokens_per_second = 0;
  /// Model FLOP utilisation as a fraction (0.31, not 31): see model_flops_utilization().
  double mfu = 0;
  /// Whole step, data to optimizer update, wall time.
  double step_time_s = 0;
  /// Forward pass including the all-gather waits inside it (Note [Waits inside phases]).
  double time_forward_s = 0;
  /// Backward pass including the all-gather and gradient-reduction waits inside it.
  double time_backward_s = 0;
  /// All exposed all-gather wait of the step, in forward and in backward.
  double time_allgather_wait_s = 0;
  /// The part of time_allgather_wait_s spent inside forward (the comm_stats delta across the
  /// forward call); the rest was spent inside backward.
  double time_allgather_wait_forward_s = 0;
  /// Exposed gradient-reduction wait (StepBreakdown::reduce_wait_s): reduce-scatter, plus the
  /// gradient all-reduce of no_shard and hybrid_shard; all of it counted inside backward.
  double time_reducescatter_wait_s = 0;
  /// optimizer.step() (and gradient clipping if any).
  double time_optimizer_s = 0;
  /// Tracked tensor bytes at their high-water mark during the step, max over ranks.
  int64_t peak_bytes = 0;
  /// Collective buffer bytes this step (CollectiveCounter::bytes deltas) on rank 0, summed
  /// over every process group of the model's units (hybrid_shard's subgroups included).
  /// allreduce_bytes also counts gradient clipping's norm all-reduce.
  int64_t allgather_bytes = 0;
  int64_t reducescatter_bytes = 0;
  int64_t allreduce_bytes = 0;
  /// parallel.tp > 1: the bytes of tensor parallelism's collectives this step on rank 0's tp
  /// group (the all-reduces of each block's activations in forward and of their gradients in
  /// backward, and the loss's over the split vocabulary). They run inside the forward and
  /// backward computations, whose times include them.
  std::optional<int64_t> tp_bytes;
  /// Held-out loss; present only on steps where evaluation ran.
  std::optional<double> eval_loss;
  /// Total gradient norm before clipping, when the trainer computes it.
  std::optional<double> grad_norm;
  /// With loss scaling (precision.loss_scaling): the scale of this step's loss, and the steps
  /// skipped so far because some rank's gradients overflowed.
  std::optional<double> loss_scale;
  std::optional<int64_t> skipped_steps;
  /// What peak_bytes is made of (fsdp::memory categories on the rank with the highest peak, at
  /// the moment of its peak; they sum to peak_bytes). CPU runs only.
  std::optional<int64_t> mem_params_bytes, mem_grads_bytes, mem_optimizer_bytes, mem_gathered_bytes,
      mem_activations_bytes, mem_other_bytes;
  /// The step's high-water mark of gradient bytes alone (the kGrads category, whenever it
  /// peaked), max over ranks: a whole shard of gradients normally, about one unit's with
  /// fsdp.optimizer_in_backward. CPU runs only.
  std::optional<int64_t> grads_peak_bytes;
  /// Resident set size at the end of the step and the process's high-water mark so far, max
  /// over ranks (fsdp::memory::resident_bytes): what the OS charges beside the tracked tensors.
  std::optional<int64_t> rss_bytes, peak_rss_bytes;
  /// CUDA runs: the caching allocator's reserved bytes (what it holds from the driver, the
  /// allocated ones and its cached free blocks) at their high-water mark during the step, max
  /// over ranks; peak_bytes is then the allocator's allocated bytes.
  std::optional<int64_t> peak_reserved_bytes;
  /// With optimizer.offload = file, rank 0: state bytes its optimizer step read from and wrote
  /// to the file, and the time the update waited for the file (the rest of the I/O overlapped
  /// the update).
  std::optional<int64_t> offload_read_bytes, offload_written_bytes;
  std::optional<double> time_offload_wait_s;

  bool operator==(const StepMetrics&) const = default;
};

/// One JSON object, no newline. Fields in a fixed, readable order; optional fields only when set.
std::string to_json_line(const StepMetrics& m);

/// Every numeric field of `m` that is present, except the step, as TensorBoard scalars in the
/// JSON line's order, tagged "<group>/<name>": train/ (loss, lr, grad_norm, loss_scale,
/// skipped_steps), eval/loss, throughput/ (tokens, tokens_per_second, mfu), time/ (step_s and
/// the phases and waits, in seconds), memory/ (peak_bytes, the categories, rss), comm/ (bytes
/// of each collective) and offload/ (file bytes). The list is in docs/trainer.md.
std::vector<TensorBoardScalar> tensorboard_scalars(const StepMetrics& m);

// ---- The JSON-lines log --------------------------------------------------------------------

/// Appends one line per step to a JSON-lines file, flushed per line so that a killed run keeps
/// every step it logged. Opening appends to an existing file, for resumed runs.
class MetricsWriter {
 public:
  /// Opens (creating if needed) `path` for appending. An incomplete last line, left by a run
  /// killed mid-write, is dropped so that the next line starts on its own. With `first_step`,
  /// existing lines with step >= first_step are dropped too: a run resumed from an earlier
  /// checkpoint logs those steps again. Throws std::runtime_error naming the path on failure.
  explicit MetricsWriter(const std::string& path, std::optional<int64_t> first_step = {});
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  /// Writes and flushes one line; throws if the write fails (e.g. disk full).
  void append(const StepMetrics& m);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

/// Reads and validates every line (all required fields present with the right JSON types, no
/// unknown fields). Errors are "<path>:<line>: <what is wrong>". Empty lines are skipped.
std::vector<StepMetrics> read_metrics(const std::string& path);

// ---- Step-time breakdown -------------------------------------------------------------------

struct BreakdownRow {
  std::string name;
  double seconds = 0;  // mean per step
  double percent = 0;  // of the mean step time
};

/// Means over the steps after the warm-up. Rows, in order: Forward pass, Backward pass,
/// All-gather wait (not hidden), Gradient reduce wait (not hidden), Optimizer step, Other, and
/// Total. Forward and backward exclude the waits inside them (Note [Waits inside phases]), and
/// Other = step time - forward - backward - optimizer (clamped at 0), so the first six rows sum
/// to Total (100%) whenever the phases fit inside the step.
struct Breakdown {
  std::vector<BreakdownRow> rows;
  int64_t first_step = 0, last_step = 0;  // step numbers of the averaged range
  int64_t num_steps = 0;                  // steps averaged
  bool warmup_skipped = true;             // false when there were no steps after the warm-up
  double tokens_per_second = 0;           // mean over the averaged steps
  double mfu = 0;                         // mean over the averaged steps
  int64_t peak_bytes = 0;                 // max over ALL steps: warm-up allocations count
  double allgather_bytes = 0, reducescatter_bytes = 0, allreduce_bytes = 0;  // mean per step
  std::optional<double> tp_bytes;  // mean per step, with tensor parallelism
  /// Set when a phase was shorter than the waits attributed to it (its row was clamped at 0),
  /// which means the timings are inconsistent.
  std::string warning;
};

/// Skips the first `skip_first` records (by position: warm-up). With no records left after the
/// warm-up it averages all of them and says so; with no records at all it throws.
Breakdown compute_breakdown(const std::vector<StepMetrics>& steps, int64_t skip_first = 1);

/// The breakdown as a text table (in the style of "Throughput Breakdown" tables), then one line
/// with tokens/s, MFU, peak memory and the collective bytes per step.
std::string breakdown_table(const std::vector<StepMetrics>& steps, int64_t skip_first = 1);

// ---- FLOPs and MFU -------------------------------------------------------------------------

/// Training FLOPs per token of a GPT (forward + backward), the PaLM / nanoGPT estimate:
///   6 N + 12 L C T
/// 6N for the matmuls with the weights (2 forward, 4 backward per parameter), 12LCT for the
/// attention scores and weighted sum (QK^T and AV: 2 matmuls x 2 FLOPs x 3 for fwd+bwd). N counts
/// the parameters that take part in matmuls: like nanoGPT, exclude the position embedding (a
/// lookup), and count a token embedding tied to the output head once.
double gpt_flops_per_token(int64_t n_params, int64_t n_layer, int64_t n_embd, int64_t seq_len);

/// achieved / peak as a fraction: flops_per_token * tokens_per_second / peak_flops, where
/// tokens_per_second and peak_flops cover the same cores (all ranks, or one). 0 if peak <= 0.
/// The trainer's peak is peak_matmul_flops (matmul_speed.h).
double model_flops_utilization(double flops_per_token, double tokens_per_second, double peak_flops);

}  // namespace fsdp_trainer
