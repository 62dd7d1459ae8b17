// See step_plan.h.
#include "step_plan.h"

#include <fmt/core.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <cmath>
#include <functional>
#include <optional>

#include <fsdp/activation_checkpoint.h>
#include <fsdp/distributed/process_group.h>
#include <fsdp/fully_shard.h>
#include <fsdp/quant/nf4.h>

#include "compute_dtype.h"
#include "data/pretrained_model.h"
#include "gpt.h"
#include "llama.h"
#include "lora.h"
#include "model_factory.h"
#include "plan_pieces.h"

namespace fsdp_trainer {
namespace {

namespace mem = fsdp::memory;
namespace plan = fsdp::plan;

// The calibration's sizes: (b, t), (2b, t) and (b, 2t) within the model's context, at least 128
// tokens each (fsdp/plan/activations.h says why); t a multiple of `positions_multiple`
// (sequence parallelism splits the positions evenly over the tensor-parallel group).
std::pair<int64_t, int64_t> calibration_size(int64_t seq_len, int64_t positions_multiple) {
  int64_t t = std::max<int64_t>(1, std::min<int64_t>(64, seq_len / 2));
  t = std::max(positions_multiple, t / positions_multiple * positions_multiple);
  return {std::max<int64_t>(1, (128 + t - 1) / t), t};
}

// The one-block model in the dtypes the engine computes in: the floating parameters of the
// blocks in the compute dtype, the root's too unless precision.root_fp32. Parameters only, as
// the engine casts them (buffers, such as NF4's packed scales, stay as they are).
void to_compute_dtypes(torch::nn::Module& model, torch::ScalarType dtype, bool root_fp32,
                       const std::function<bool(const std::string&)>& is_blocks) {
  if (dtype == torch::kFloat)
    return;
  torch::NoGradGuard no_grad;
  for (const auto& child : model.named_children()) {
    if (!is_blocks(child.key()) && root_fp32)
      continue;
    for (auto& p : child.value()->parameters()) {
      if (p.is_floating_point())
        p.set_data(p.detach().to(dtype));
    }
  }
}

// The loss fsdp-train takes (train_step): the mean cross-entropy over a micro-batch divided by
// the number of micro-batches, or for conversations the masked sum over the batch's answer
// tokens divided by their count.
fsdp_models::PlanLoss trainer_loss(const Config& config) {
  const bool finetune = config.finetuning;
  const double micro = static_cast<double>(config.training.micro_batches);
  return [finetune, micro](const torch::Tensor& logits, int64_t b, int64_t t) {
    const int64_t vocab = logits.size(-1);
    auto targets = torch::randint(vocab, {b * t}, torch::TensorOptions().dtype(torch::kLong));
    auto flat = logits.reshape({-1, vocab});
    if (!finetune)
      return torch::nn::functional::cross_entropy(flat, targets) / micro;
    auto mask = torch::ones({b * t});
    auto ce = torch::nn::functional::cross_entropy(
        flat, targets, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
    return (ce * mask).sum() / static_cast<double>(b * t);
  };
}

// The same loss through the model's fused head (training.loss_chunk >= 0), for a run of
// `positions` per micro-batch, on a model of `vocab` tokens. The chunk is the run's, chosen for
// the run's vocabulary `run_vocab`: a narrowed model's (fsdp_models::narrowed) must keep it, or
// what a chunk holds would not scale with the widths as the extrapolation assumes.
std::optional<fsdp_models::PlanFusedLoss> trainer_fused_loss(const Config& config, int64_t vocab,
                                                             int64_t run_vocab, int64_t positions) {
  if (config.training.loss_chunk < 0)
    return std::nullopt;
  const bool finetune = config.finetuning;
  const double micro = static_cast<double>(config.training.micro_batches);
  fsdp_models::PlanFusedLoss fused;
  fused.chunk = config.training.loss_chunk > 0 ? config.training.loss_chunk
                                               : fsdp_models::auto_loss_chunk(run_vocab);
  fused.positions = std::max<int64_t>(1, positions);
  fused.spec = [finetune, micro, vocab](int64_t b, int64_t t) {
    fsdp_models::LossSpec spec;
    spec.targets = torch::randint(vocab, {b, t}, torch::TensorOptions().dtype(torch::kLong));
    if (finetune) {
      // Every position an answer: the most the head computes. The fused loss leaves out the
      // positions of weight 0, so a batch of conversations holds a chunk of fewer positions'
      // logits, and a K x C copy of its K answer positions' hidden states through forward.
      spec.weights = torch::ones({b, t});
      spec.denominator = static_cast<double>(b * t);
    } else {
      spec.denominator = static_cast<double>(b * t) * micro;
    }
    return spec;
  };
  return fused;
}

// The most parameters the calibration's one-block model may have before it is narrowed
// (fsdp/plan/activations.h, extrapolate_to_full_width). Calibrating runs ~20 passes of it at a
// few hundred tokens, three times: at 4M parameters that is a few seconds in fp32 on 2 cores,
// and in bf16 or fp16 on a CPU without AVX-512 BF16 (~10-36x slower matmuls) a few seconds at
// 4M / 16 parameters. Below these the model is calibrated as it is, at full width. Where ATen
// hands bf16/fp16 to oneDNN (AVX-512 CPUs), narrowing them is only approximate
// (plan::narrowing_is_exact), and they are faster: the fp32 limit.
int64_t calibration_params_limit(torch::ScalarType dtype) {
  return plan::narrowing_is_exact(dtype) && dtype != torch::kFloat ? int64_t{1} << 18
                                                                   : int64_t{4} << 20;
}

// Whether the Linear widths of `c` are multiples of `m` (NF4 packs its rows in blocks of 64).
bool widths_multiple_of(const fsdp_models::LlamaConfig& c, int64_t m) {
  return c.dim % m == 0 && c.ffn_hidden_dim % m == 0;
}
bool widths_multiple_of(const fsdp_models::GPTConfig& c, int64_t m) {
  return c.n_embd % m == 0;
}

// Whether tensor parallelism over `tp` ranks splits `c` (the head counts are kept by narrowing,
// so only Llama's feed-forward width can stop dividing).
bool splits_over(const fsdp_models::LlamaConfig& c, int64_t tp) {
  return c.ffn_hidden_dim % tp == 0;
}
bool splits_over(const fsdp_models::GPTConfig&, int64_t) {
  return true;
}

// Whether the narrowed copies (by k, 2k, 4k) narrow the vocabulary too: where each copy's
// words still divide evenly over the tensor-parallel ranks, so that every rank's part is the
// whole's width over the narrowing (as the extrapolation assumes).
template <typename ModelConfig>
bool vocab_narrows(const ModelConfig& one, int64_t k, int64_t tp) {
  return one.vocab_size % (4 * k * tp) == 0;
}

// How much calibrate() narrows the one-block model `one` (0: not at all): by k, 2k and 4k, the
// least k >= 2 (k = 1 would be the full width itself) that brings the widest copy within the
// limit, as far as the widths allow: each narrowed copy keeps its widths multiples of
// `width_multiple` (QLoRA's NF4 block), else the model is calibrated at full width.
template <typename ModelConfig>
int64_t narrowing_factor(const ModelConfig& one, torch::ScalarType dtype, int64_t width_multiple,
                         int64_t tp) {
  const int64_t limit = calibration_params_limit(dtype), most = fsdp_models::max_narrowing(one);
  if (one.num_params() <= limit * tp || most < 8)
    return 0;
  // A tensor-parallel rank's one-block model has about 1/tp of the parameters.
  auto params_at = [&](int64_t k) {
    return fsdp_models::narrowed(one, k, vocab_narrows(one, k, tp)).num_params() / tp;
  };
  int64_t k = 2;
  while (8 * k <= most && params_at(k) > limit)
    k *= 2;
  // The narrowest copy's widths divide the others' (by 2 and 4), and still split over tp.
  const auto narrowest = fsdp_models::narrowed(one, 4 * k, false);
  if (!widths_multiple_of(narrowest, width_multiple) || !splits_over(narrowest, tp))
    return 0;
  return k;
}

// `make` builds a one-block model of the run (real tensors) from the run's one-block config
// `one`, narrowed or not (fsdp_models::narrowed); `out` gets the activations, and with
// `time_compute` the pieces of `copies` full-width such models and their times (timed together).
// With `tp` (a local group of the run's tensor-parallel size, playing this rank) `make` splits
// the model over the group it is given (that one, or for each further timing copy a group of
// its own: the copies run on threads of their own, and a group's counters are not shared
// between threads), so every measurement is of one tensor-parallel rank's part, and the
// collectives the pieces issue are counted as they run (ActivationModel::tp_traffic).
template <typename Model, typename ModelConfig>
void calibrate(const ModelConfig& one,
               const std::function<Model(const ModelConfig&,
                                         const std::shared_ptr<fsdp::ProcessGroup>&)>& make,
               const Config& config, torch::ScalarType dtype, int64_t seq_len,
               const std::function<bool(const std::string&)>& is_blocks, bool time_compute,
               int copies, const std::function<void()>& before_timing, const PlanProgress& progress,
               int64_t width_multiple, const std::shared_ptr<fsdp::ProcessGroup>& tp,
               RunPlan& out) {
  // With root_fp32 the blocks hand fp32 to each other and to the root (output_dtype, as
  // trainer.cpp sets it).
  const auto output = config.precision.root_fp32 && dtype != torch::kFloat
                          ? std::optional<torch::ScalarType>(torch::kFloat)
                          : std::nullopt;
  // A model of `cfg` split over `group` (or `tp`), as the pieces to measure or time.
  auto pieces_of = [&](const ModelConfig& cfg,
                       const std::shared_ptr<fsdp::ProcessGroup>& group = nullptr) {
    const auto& over = group ? group : tp;
    Model model = make(cfg, over);
    to_compute_dtypes(*model, dtype, config.precision.root_fp32, is_blocks);
    auto pieces = fsdp_models::calibration_pieces(
        model, dtype, trainer_loss(config), output,
        trainer_fused_loss(config, model->config().vocab_size, one.vocab_size,
                           out.options.batch_rows * seq_len));
    pieces.group = over;  // its collectives counted as the activations are measured
    return std::make_shared<const plan::CalibrationPieces>(std::move(pieces));
  };
  // Lines only for big models (their calibration takes seconds even narrowed): a small model's
  // errors stay one line.
  auto say = [&](const std::string& line) {
    if (progress && one.num_params() > (int64_t{16} << 20))
      progress(line);
  };
  const int64_t ways = tp ? tp->size() : 1;
  const int64_t positions_multiple = config.parallel.sequence_parallel ? ways : 1;
  if (2 * positions_multiple > seq_len) {
    throw ConfigError(fmt::format(
        "the planner calibrates sequence parallelism at two lengths that divide by parallel.tp "
        "({}) within training.seq_len ({}): it must be at least twice parallel.tp",
        positions_multiple, seq_len));
  }
  const auto [b, t] = calibration_size(seq_len, positions_multiple);
  const char* dtype_text = dtype == torch::kFloat      ? "fp32"
                           : dtype == torch::kBFloat16 ? "bf16"
                                                       : "fp16";
  const int64_t k = narrowing_factor(one, dtype, width_multiple, ways);
  // At full width the calibrated pieces are also the first timed ones (below): built once.
  std::shared_ptr<const plan::CalibrationPieces> full_width;
  if (k == 0) {
    full_width = pieces_of(one);
    out.activations = plan::calibrate_activations(*full_width, b, t);
  } else {
    const auto timer = std::chrono::steady_clock::now();
    if (progress && !plan::narrowing_is_exact(dtype))
      progress(fmt::format(
          "note: one block has {} parameters, calibrated narrowed; on this CPU oneDNN pads {} "
          "to its block sizes, so the activations' extrapolation is approximate",
          one.num_params(), dtype_text));
    const bool vocab = vocab_narrows(one, k, ways);
    auto model_at = [&](int64_t by, int step) {
      const auto cfg = fsdp_models::narrowed(one, by, vocab);
      say(
          fmt::format("calibrating activations on one block narrowed {}x ({} of 3: {} "
                      "parameters instead of {}, {})",
                      by, step, cfg.num_params(), one.num_params(), dtype_text));
      return pieces_of(cfg);
    };
    // The widest at one size, the two narrower at three (plan::extrapolate_to_full_width).
    const auto widest = plan::measure_activations(*model_at(k, 1), b, t);
    const plan::NarrowedCalibration narrower{
        2 * k, plan::calibrate_activations(*model_at(2 * k, 2), b, t)};
    const plan::NarrowedCalibration narrowest{
        4 * k, plan::calibrate_activations(*model_at(4 * k, 3), b, t)};
    out.activations = plan::extrapolate_to_full_width(widest, k, narrower, narrowest);
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - timer).count();
    say(fmt::format("activations calibrated in {:.1f} s", took));
  }
  if (!time_compute)
    return;
  out.pieces = full_width ? full_width : pieces_of(one);
  out.timing_pieces = {out.pieces};
  for (int i = 1; i < copies; ++i) {
    out.timing_pieces.push_back(
        pieces_of(one, tp ? fsdp::local_group(tp->size(), tp->rank(), "plan/tp") : nullptr));
  }
  if (before_timing)
    before_timing();
  out.compute = plan::time_pieces_together(out.timing_pieces, out.options.batch_rows, seq_len);
}

bool is_gpt_block(const std::string& name) {
  return name.size() > 1 && name[0] == 'h' && std::isdigit(static_cast<unsigned char>(name[1]));
}

bool is_llama_blocks(const std::string& name) {
  return name == "layers";
}

}  // namespace

namespace {

// The planner's options for `config`: what the engine will be given (model_factory.h,
// unit_options: the trainer shards with the same), read back into the planner's terms. The
// sequence, the batch's bytes and activation checkpointing depend on the model: plan_run's.
plan::StepOptions step_options(const Config& config, int world_size, int local_world_size,
                               const std::string& compute_dtype) {
  plan::StepOptions o;
  auto& s = o.states;
  const auto& prec = config.precision;
  const auto& t = config.training;
  const auto& opt = config.optimizer;
  const UnitOptions units = unit_options(config, nullptr, compute_dtype, local_world_size);
  const auto& blocks = units.blocks;
  const auto& mp = blocks.mp_policy();
  s.world_size = world_size;
  s.strategy = blocks.strategy();
  if (s.strategy == fsdp::ShardingStrategy::kHybridShard)
    s.hybrid_shard_size = blocks.hybrid_shard_size();
  s.param_dtype = dtype_named(compute_dtype);
  s.reduce_dtype = dtype_named(prec.reduce_dtype);
  s.root_full_precision = prec.root_fp32;
  s.cpu_offload = blocks.offload_policy().has_value();
  if (opt.name == "sgd") {
    s.optimizer = opt.momentum > 0 ? plan::Optimizer::kSgdMomentum : plan::Optimizer::kSgd;
  } else {
    s.optimizer = plan::Optimizer::kAdamW;
    s.fused = opt.name == "adamw_fused";
  }
  s.moments_dtype = opt.moments_dtype == "bf16" ? torch::kBFloat16 : torch::kFloat;
  s.optimizer_in_file = opt.offload == "file";
  s.chunk_bytes = std::llround(opt.chunk_mb * (1 << 20));
  if (blocks.reshard_after_forward().has_value()) {
    o.reshard_after_forward = *blocks.reshard_after_forward();
    o.reshard_after_forward_size = blocks.reshard_after_forward_size();
  }
  o.forward_prefetch = blocks.forward_prefetch();
  o.backward_prefetch = blocks.backward_prefetch();
  o.max_inflight_all_gathers = blocks.max_inflight_all_gathers();
  o.gather_format = mp.gather_format();
  o.int8_block_size = mp.int8_block_size();
  o.reduce_format = mp.reduce_format();
  o.error_feedback = mp.error_feedback();
  o.optimizer_in_backward = config.fsdp.optimizer_in_backward;
  o.all_gather_bucket_bytes = blocks.all_gather_bucket_bytes();
  o.gloo_staging = o.gloo_reduce_scatter = t.device == "cpu";
  o.micro_batches = static_cast<int>(t.micro_batches);
  o.sync_every_micro_batch = config.fsdp.sync_every_micro_batch;
  o.batch_rows = t.batch_size / t.micro_batches;
  return o;
}

// fsdp.activation_checkpointing of each of `blocks` blocks (every fsdp.ac_every-th).
std::vector<fsdp::CheckpointMode> checkpoint_modes(const FsdpConfig& f, int64_t blocks) {
  const auto ac = fsdp::from_string<fsdp::CheckpointMode>(f.activation_checkpointing);
  std::vector<fsdp::CheckpointMode> modes;
  for (int64_t i = 0; i < blocks; ++i)
    modes.push_back(i % f.ac_every == 0 ? ac : fsdp::CheckpointMode::kNone);
  return modes;
}

// What plan_run's models share: how to calibrate and time them.
struct Calibration {
  const Config& config;
  torch::ScalarType dtype;
  bool time_compute;
  int timing_copies;
  const std::function<void()>& before_timing;
  const PlanProgress& progress;
  /// parallel.tp > 1: a local group of that size in which this process plays the planned
  /// rank's tensor-parallel rank (fsdp::local_group); null otherwise.
  std::shared_ptr<fsdp::ProcessGroup> tp;
};

// `model` split as the run splits it over `group` (nothing without one).
template <typename Model>
void split(const Config& config, Model& model, const std::shared_ptr<fsdp::ProcessGroup>& group) {
  if (group)
    split_for_tensor_parallel(config, model, group);
}

// fsdp-train finetune's model (the pretrained file's Llama with its adapters or NF4 weights):
// its units in `out`, calibrated; returns its blocks.
int64_t plan_finetune(const Calibration& c, const std::string& model_path, int64_t other_bytes,
                      RunPlan& out) {
  const auto& ft = c.config.finetune;
  const auto& t = c.config.training;
  auto& o = out.options;
  auto cfg = pretrained_config(model_path);
  cfg.max_seq_len = ft.max_tokens;
  o.seq_len = ft.max_tokens;
  // The batch: (rows, max_tokens) token ids, labels and a float mask.
  o.other_bytes = other_bytes + t.batch_size * ft.max_tokens * (8 + 8 + 4);
  const bool adapters = ft.method != "full";
  auto shape = [&](fsdp_models::Llama& model, const fsdp_models::ModelInit& init, bool real) {
    if (ft.method == "qlora")
      fsdp_models::use_nf4(*model, /*quantize=*/real);
    if (adapters) {
      fsdp_models::add_lora(*model, ft.targets,
                            fsdp_models::LoraOptions()
                                .rank(ft.lora_rank)
                                .alpha(ft.lora_alpha)
                                .dropout(ft.lora_dropout),
                            init);
    }
  };
  {
    const fsdp_models::ModelInit meta = fsdp_models::ModelInit().device(torch::kMeta);
    fsdp_models::Llama model(cfg, meta);
    shape(model, meta, false);
    split(c.config, model, c.tp);
    out.units = plan::describe_units(*model, fsdp_models::unit_paths(cfg));
  }
  auto one = cfg;
  one.n_layers = 1;
  const std::function<fsdp_models::Llama(const fsdp_models::LlamaConfig&,
                                         const std::shared_ptr<fsdp::ProcessGroup>&)>
      make = [&](const fsdp_models::LlamaConfig& lc,
                 const std::shared_ptr<fsdp::ProcessGroup>& group) {
        fsdp_models::Llama model(lc);
        shape(model, fsdp_models::ModelInit(), true);
        split(c.config, model, group);
        return model;
      };
  calibrate(one, make, c.config, c.dtype, o.seq_len, is_llama_blocks, c.time_compute,
            c.timing_copies, c.before_timing, c.progress,
            ft.method == "qlora" ? fsdp::nf4::kBlock : int64_t{1}, c.tp, out);
  return cfg.n_layers;
}

// A pretraining run's GPT or Llama (model.arch), as plan_finetune.
template <typename Model, typename ModelConfig>
int64_t plan_pretrain(const Calibration& c, const ModelConfig& cfg, int64_t ModelConfig::*layers,
                      const std::function<bool(const std::string&)>& is_blocks, int64_t other_bytes,
                      RunPlan& out) {
  const auto& t = c.config.training;
  auto& o = out.options;
  o.seq_len = t.seq_len;
  o.other_bytes = other_bytes + t.batch_size * (t.seq_len + 1) * 8;  // the batch's token ids
  {
    Model model(cfg, fsdp_models::ModelInit().device(torch::kMeta));
    split(c.config, model, c.tp);
    out.units = plan::describe_units(*model, fsdp_models::unit_paths(cfg));
  }
  auto one = cfg;
  one.*layers = 1;
  const std::function<Model(const ModelConfig&, const std::shared_ptr<fsdp::ProcessGroup>&)> make =
      [&c](const ModelConfig& mc, const std::shared_ptr<fsdp::ProcessGroup>& group) {
        Model model(mc);
        split(c.config, model, group);
        return model;
      };
  calibrate(one, make, c.config, c.dtype, o.seq_len, is_blocks, c.time_compute, c.timing_copies,
            c.before_timing, c.progress, /*width_multiple=*/1, c.tp, out);
  return cfg.*layers;
}

}  // namespace

RunPlan plan_run(const Config& config, int64_t vocab_size, const std::string& model_path,
                 int world_size, int local_world_size, const std::string& compute_dtype,
                 int64_t other_bytes, bool time_compute, const std::function<void()>& before_timing,
                 int timing_copies, const PlanProgress& progress, int tp_rank) {
  RunPlan out;
  // With tensor parallelism the units are sharded over the data-parallel axis.
  const int tp = static_cast<int>(config.parallel.tp);
  out.options = step_options(config, world_size / tp, local_world_size, compute_dtype);
  const Calibration c{config,
                      dtype_named(compute_dtype),
                      time_compute,
                      timing_copies,
                      before_timing,
                      progress,
                      tp > 1 ? fsdp::local_group(tp, tp_rank, "plan/tp") : nullptr};
  int64_t blocks = 0;
  if (config.finetuning) {
    blocks = plan_finetune(c, model_path, other_bytes, out);
  } else if (config.model.arch == "gpt") {
    blocks = plan_pretrain<fsdp_models::GPT>(c, gpt_config(config, vocab_size),
                                             &fsdp_models::GPTConfig::n_layer, is_gpt_block,
                                             other_bytes, out);
  } else {
    blocks = plan_pretrain<fsdp_models::Llama>(c, llama_config(config, vocab_size),
                                               &fsdp_models::LlamaConfig::n_layers, is_llama_blocks,
                                               other_bytes, out);
  }
  out.options.checkpoint = checkpoint_modes(config.fsdp, blocks);
  return out;
}

std::string describe_prediction(const plan::MemoryPrediction& p) {
  std::string out = fmt::format("predicted peak per rank {} at {} ({})", mem::format_bytes(p.peak),
                                plan::moment_label(p.moment), p.moment.what);
  if (p.peak_without_staging != p.peak) {
    out += fmt::format("; {} if Gloo's staging buffers are freed by then",
                       mem::format_bytes(p.peak_without_staging));
  }
  out += "\n ";
  for (int c = 1; c <= mem::kNumCategories; ++c) {
    const int cat = c % mem::kNumCategories;  // "other" last
    out +=
        fmt::format(" {} {}{}", mem::to_string(static_cast<mem::Category>(cat)),
                    mem::format_bytes(p.at_peak.bytes[cat]), c < mem::kNumCategories ? " |" : "");
  }
  return out;
}

std::string compare_prediction(const plan::MemoryPrediction& p, const MeasuredPeak& m) {
  std::string out = fmt::format(
      "Memory per rank (rank 0), predicted by fsdp::plan vs measured (the highest tracked peak "
      "of {} steady step(s), whose sequences had {} tokens):\n{:<22}{:>18}{:>18}\n",
      m.steps, m.seq_len, "", "predicted", "measured");
  for (int c = 1; c <= mem::kNumCategories; ++c) {
    const int cat = c % mem::kNumCategories;
    out += fmt::format("{:<22}{:>18}{:>18}\n", mem::to_string(static_cast<mem::Category>(cat)),
                       mem::format_bytes(p.at_peak.bytes[cat]),
                       mem::format_bytes(m.at_peak.bytes[cat]));
  }
  const double error =
      m.peak > 0 ? 100.0 * static_cast<double>(p.peak - m.peak) / static_cast<double>(m.peak) : 0;
  out += fmt::format("{:<22}{:>18}{:>18}   error {:+.1f}%", "peak", mem::format_bytes(p.peak),
                     mem::format_bytes(m.peak), error);
  if (p.peak_without_staging != p.peak) {
    out += fmt::format(" (predicted {} without Gloo's staging buffers)",
                       mem::format_bytes(p.peak_without_staging));
  }
  out += fmt::format("\n{:<22}{:>18}{:>18}", "moment", plan::moment_label(p.moment), m.moment);
  return out;
}

std::string plan_json(const plan::MemoryPrediction& p, const MeasuredPeak& m,
                      const std::optional<MeasuredTime>& time, const MeasuredTime& mt,
                      const std::string& method,
                      const std::optional<plan::TimePrediction>& traffic) {
  auto categories = [](const mem::CategoryBytes& bytes) {
    std::string out = "{";
    for (int c = 0; c < mem::kNumCategories; ++c) {
      out += fmt::format("{}\"{}\":{}", c ? "," : "", mem::to_string(static_cast<mem::Category>(c)),
                         bytes.bytes[c]);
    }
    return out + "}";
  };
  auto phases = [](const MeasuredTime& t) {
    return fmt::format(
        "\"forward\":{},\"backward\":{},\"all_gather_wait\":{},\"reduce_wait\":{},"
        "\"optimizer\":{},\"other\":{},\"step\":{}",
        t.forward, t.backward, t.all_gather_wait, t.reduce_wait, t.optimizer, t.other, t.step);
  };
  std::string times;
  if (time) {
    times = fmt::format(
        ",\"time\":{{\"method\":\"{}\",\"predicted\":{{{}}},\"measured\":{{{},"
        "\"steps\":{}}}}}",
        method, phases(*time), phases(mt), mt.steps);
  }
  if (traffic) {
    const auto& tp = traffic->tp_traffic;
    times += fmt::format(
        ",\"traffic\":{{\"all_gather\":{},\"reduce_scatter\":{},\"all_reduce\":{},"
        "\"tp\":{{\"bytes\":{},\"all_reduce\":{},\"all_reduce_calls\":{},\"all_gather\":{},"
        "\"all_gather_calls\":{},\"reduce_scatter\":{},\"reduce_scatter_calls\":{}}}}}",
        traffic->all_gather_bytes, traffic->reduce_scatter_bytes, traffic->all_reduce_bytes,
        traffic->tp_bytes, tp.all_reduce.bytes, tp.all_reduce.calls, tp.all_gather.bytes,
        tp.all_gather.calls, tp.reduce_scatter.bytes, tp.reduce_scatter.calls);
  }
  // The highest predicted total at each moment, by fsdp::memory label.
  std::vector<std::string> labels;
  for (const auto& [moment, bytes] : p.timeline) {
    const auto label = plan::moment_label(moment);
    if (std::find(labels.begin(), labels.end(), label) == labels.end())
      labels.push_back(label);
  }
  std::string moments = "{";
  for (size_t i = 0; i < labels.size(); ++i)
    moments += fmt::format("{}\"{}\":{}", i ? "," : "", labels[i], p.highest_at(labels[i]));
  moments += "}";
  return fmt::format(
      "{{\"predicted\":{{\"peak\":{},\"peak_without_staging\":{},\"moment\":\"{}\","
      "\"categories\":{},\"category_peaks\":{},\"moments\":{}}},\"measured\":{{\"peak\":{},"
      "\"moment\":\"{}\",\"steps\":{},\"seq_len\":{},\"categories\":{},"
      "\"category_peaks\":{}}}{}}}\n",
      p.peak, p.peak_without_staging, plan::moment_label(p.moment), categories(p.at_peak),
      categories(p.category_peaks), moments, m.peak, m.moment, m.steps, m.seq_len,
      categories(m.at_peak), categories(m.category_peaks), times);
}

std::string compare_time(const MeasuredTime& p, const MeasuredTime& m, const std::string& method) {
  auto row = [](const char* name, double predicted, double measured) {
    return fmt::format("{:<30}{:>12.4f}{:>12.4f}\n", name, predicted, measured);
  };
  std::string out = fmt::format(
      "Step time (rank 0), predicted from {} vs measured (mean of {} steady step(s)), "
      "seconds:\n{:<30}{:>12}{:>12}\n",
      method, m.steps, "", "predicted", "measured");
  out += row("forward", p.forward, m.forward);
  out += row("backward (recomputation incl.)", p.backward, m.backward);
  out += row("all-gather wait", p.all_gather_wait, m.all_gather_wait);
  out += row("reduce wait", p.reduce_wait, m.reduce_wait);
  out += row("optimizer", p.optimizer, m.optimizer);
  out += row("other", p.other, m.other);
  const double error = m.step > 0 ? 100.0 * (p.step - m.step) / m.step : 0;
  out += fmt::format("{:<30}{:>12.4f}{:>12.4f}   error {:+.1f}%", "step", p.step, m.step, error);
  return out;
}

std::string budget_warning(const RunPlan& run, const plan::MemoryPrediction& p, int64_t budget,
                           int rank, const std::string& budget_name) {
  // The two largest categories at the peak.
  std::vector<int> order(mem::kNumCategories);
  for (int c = 0; c < mem::kNumCategories; ++c)
    order[static_cast<size_t>(c)] = c;
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return p.at_peak.bytes[a] > p.at_peak.bytes[b]; });
  std::string out =
      fmt::format("the predicted peak per rank, {} at {}, exceeds {} = {} (largest: {} {}, {} {})",
                  mem::format_bytes(p.peak), plan::moment_label(p.moment), budget_name,
                  mem::format_bytes(budget), mem::to_string(static_cast<mem::Category>(order[0])),
                  mem::format_bytes(p.at_peak.bytes[order[0]]),
                  mem::to_string(static_cast<mem::Category>(order[1])),
                  mem::format_bytes(p.at_peak.bytes[order[1]]));
  // Changes in the order of what they cost in speed, each alone.
  struct Change {
    std::string toml;
    std::function<void(plan::StepOptions&)> apply;
  };
  const auto& o = run.options;
  std::vector<Change> changes;
  auto all_blocks = [](fsdp::CheckpointMode mode) {
    return [mode](plan::StepOptions& s) {
      for (auto& m : s.checkpoint)
        m = mode;
    };
  };
  const bool any_ac = std::any_of(o.checkpoint.begin(), o.checkpoint.end(),
                                  [](auto m) { return m != fsdp::CheckpointMode::kNone; });
  if (!any_ac) {
    changes.push_back({"fsdp.activation_checkpointing = \"selective\"",
                       all_blocks(fsdp::CheckpointMode::kSelective)});
  }
  changes.push_back({"fsdp.activation_checkpointing = \"full\", fsdp.ac_every = 1",
                     all_blocks(fsdp::CheckpointMode::kFull)});
  if (o.states.strategy != fsdp::ShardingStrategy::kFullShard) {
    changes.push_back({"fsdp.strategy = \"full_shard\"", [](plan::StepOptions& s) {
                         s.states.strategy = fsdp::ShardingStrategy::kFullShard;
                         s.reshard_after_forward = true;
                       }});
  }
  if (o.batch_rows % 2 == 0) {
    changes.push_back(
        {fmt::format("training.micro_batches = {}", o.micro_batches * 2), [](plan::StepOptions& s) {
           s.batch_rows /= 2;
           s.micro_batches *= 2;
         }});
  }
  if (o.states.optimizer != plan::Optimizer::kSgd && o.states.fused &&
      o.states.moments_dtype == torch::kFloat) {
    changes.push_back({"optimizer.moments_dtype = \"bf16\"",
                       [](plan::StepOptions& s) { s.states.moments_dtype = torch::kBFloat16; }});
  }
  if (o.states.fused && !o.states.optimizer_in_file) {
    changes.push_back({"optimizer.offload = \"file\"",
                       [](plan::StepOptions& s) { s.states.optimizer_in_file = true; }});
  }
  for (const auto& change : changes) {
    auto changed = o;
    change.apply(changed);
    const auto q = plan::predict_step_memory(run.units, changed, run.activations, rank);
    if (q.peak <= budget) {
      return out + fmt::format("; with {} the planner predicts {}", change.toml,
                               mem::format_bytes(q.peak));
    }
  }
  return out +
         "; no single change the planner tries (activation checkpointing, smaller "
         "micro-batches, full_shard, bf16 moments, optimizer state in a file) fits it";
}

}  // namespace fsdp_trainer
