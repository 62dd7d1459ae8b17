// fsdp::plan (issue 26): the model states a rank holds between steps, predicted from the units
// alone, against what the tracking allocator measures on the same run, byte for byte, across
// strategies, optimizers, moment dtypes, reduce dtypes, CPU offload, optimizer state in a file,
// and QLoRA (NF4 frozen weights, LoRA adapters).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include <unistd.h>

#include <fsdp/fsdp.h>
#include <fsdp/plan/hardware.h>
#include <fsdp/plan/machine_profile.h>
#include <fsdp/plan/model_states.h>
#include <fsdp/plan/step_memory.h>
#include <fsdp/plan/tp_traffic.h>
#include <fsdp/plan/units.h>

#include "gpt.h"
#include "harness/multiprocess.h"
#include "llama.h"
#include "lora.h"
#include "plan_pieces.h"
#include "tensor_parallel.h"

namespace {

namespace mem = fsdp::memory;
using fsdp_models::GPT;
using fsdp_models::GPTConfig;
using fsdp_models::Llama;
using fsdp_models::LlamaConfig;

// After sharding (`params` measured since `base`): runs `backward`, then the optimizer step
// (tagged as the trainer tags it), and compares the three categories with the prediction.
int check_states(const std::string& what, int rank, const mem::CategoryBytes& base, int64_t params,
                 const fsdp::plan::RankStates& predicted, const std::function<void()>& backward,
                 torch::optim::Optimizer& opt) {
  backward();
  // A reduce-scatter's input (the unit's unsharded gradients) is freed by whichever drops its
  // last reference: the engine after wait(), or Gloo's worker thread once it has marked the work
  // complete, a moment later (later still on a loaded machine: once, in a suite under the AVX2
  // emulation, the QLoRA rank measured its whole unsharded gradients still held). What the step
  // keeps is the figure once that thread has let go: up to 2 s for it.
  const auto grads_now = [&] {
    return mem::current_by_category()[mem::Category::kGrads] - base[mem::Category::kGrads];
  };
  int64_t grads = grads_now();
  for (int i = 0; i < 200 && grads != predicted.grads; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    grads = grads_now();
  }
  {
    mem::CategoryScope tag(mem::Category::kOptimizer);
    opt.step();
  }
  const int64_t optim =
      mem::current_by_category()[mem::Category::kOptimizer] - base[mem::Category::kOptimizer];
  WORKER_CHECK(params == predicted.params)
      << "params: measured " << params << " B, predicted " << predicted.params;
  WORKER_CHECK(grads == predicted.grads)
      << "grads: measured " << grads << " B, predicted " << predicted.grads;
  WORKER_CHECK(optim == predicted.optimizer)
      << "optimizer: measured " << optim << " B, predicted " << predicted.optimizer;
  std::printf("[rank %d] PLAN OK (%s): params %lld, grads %lld, optimizer %lld B, as predicted\n",
              rank, what.c_str(), (long long)params, (long long)grads, (long long)optim);
  return 0;
}

// QLoRA: a Llama whose block Linears are NF4 (frozen, packed) with LoRA adapters (the only
// trainable parameters, the only ones the optimizer gets).
int qlora_states(const std::shared_ptr<fsdp::ProcessGroup>& pg,
                 const fsdp::plan::StateOptions& plan) {
  const int rank = pg->rank();
  const auto base = mem::current_by_category();
  // Widths that are multiples of 64 (whole NF4 blocks per row), rows 3 ranks do not divide.
  LlamaConfig cfg;
  cfg.vocab_size = 67, cfg.max_seq_len = 16, cfg.dim = 64, cfg.n_layers = 2, cfg.n_heads = 2;
  cfg.n_kv_heads = 1, cfg.ffn_hidden_dim = 192;
  torch::manual_seed(9);
  Llama model(cfg);
  fsdp_models::use_nf4(*model, /*quantize=*/true);
  fsdp_models::add_lora(*model, "wq|wv", fsdp_models::LoraOptions().rank(4).alpha(8));
  const auto paths = fsdp_models::unit_paths(cfg);
  const auto units = fsdp::plan::describe_units(*model, paths);
  const auto predicted = fsdp::plan::model_states(units, plan, rank);
  fsdp_models::parallelize_llama(model, fsdp::FullyShardOptions(pg));
  const int64_t params =
      mem::current_by_category()[mem::Category::kParams] - base[mem::Category::kParams];
  fsdp::FusedAdamW opt(fsdp_models::trainable_parameters(*model), torch::optim::AdamWOptions(1e-3));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(200 + rank);
  auto t = torch::randint(cfg.vocab_size, {2, 16}, gen, torch::TensorOptions().dtype(torch::kLong));
  return check_states(
      "llama qlora", rank, base, params, predicted,
      [&] {
        auto logits = fsdp::forward(model, t);
        torch::nn::functional::cross_entropy(logits.reshape({-1, cfg.vocab_size}), t.reshape({-1}))
            .backward();
      },
      opt);
}

FSDP_WORKER(plan_model_states) {
  mem::install_tracking_allocator();
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), world = pg->size();
  const std::string strategy = ctx.env("FSDP_STRATEGY", "full_shard");
  const std::string optimizer = ctx.env("FSDP_OPTIMIZER", "fused_adamw");
  const bool bf16_moments = ctx.env("FSDP_BF16_MOMENTS", "0") == "1";
  const bool reduce_bf16 = ctx.env("FSDP_REDUCE_BF16", "0") == "1";
  const bool offload = ctx.env("FSDP_OFFLOAD", "0") == "1";
  const bool state_file = ctx.env("FSDP_STATE_FILE", "0") == "1";

  fsdp::plan::StateOptions plan;
  plan.world_size = world;
  plan.strategy = fsdp::from_string<fsdp::ShardingStrategy>(strategy);
  plan.hybrid_shard_size = plan.strategy == fsdp::ShardingStrategy::kHybridShard ? 2 : 0;
  plan.cpu_offload = offload;
  plan.fused = optimizer != "torch_adamw";
  plan.optimizer = optimizer == "fused_sgd" ? fsdp::plan::Optimizer::kSgdMomentum
                                            : fsdp::plan::Optimizer::kAdamW;
  plan.moments_dtype = bf16_moments ? torch::kBFloat16 : torch::kFloat32;
  if (reduce_bf16)
    plan.reduce_dtype = torch::kBFloat16;
  plan.optimizer_in_file = state_file;
  plan.chunk_bytes = 16 << 10;  // small chunks: several per step on this model

  if (ctx.env("FSDP_MODEL", "gpt") == "llama_qlora")
    return qlora_states(pg, plan);
  const auto base = mem::current_by_category();
  auto cfg = GPTConfig::preset("gpt2-test");
  cfg.n_layer = 3;
  torch::manual_seed(8);
  GPT model(cfg);
  const auto paths = fsdp_models::unit_paths(cfg);
  const auto units = fsdp::plan::describe_units(*model, paths);
  const auto predicted = fsdp::plan::model_states(units, plan, rank);

  auto opts = fsdp::FullyShardOptions(pg).strategy(plan.strategy);
  if (plan.hybrid_shard_size > 0)
    opts.hybrid_shard_size(plan.hybrid_shard_size);
  if (reduce_bf16)
    opts.mp_policy(fsdp::MixedPrecisionPolicy().reduce_dtype(torch::kBFloat16));
  if (offload)
    opts.offload_policy(fsdp::CPUOffloadPolicy());
  fsdp_models::parallelize_gpt(model, opts);
  const int64_t params =
      mem::current_by_category()[mem::Category::kParams] - base[mem::Category::kParams];

  std::unique_ptr<torch::optim::Optimizer> opt;
  auto state = fsdp::OptimizerStateOptions().moments_dtype(plan.moments_dtype);
  if (state_file)
    state.offload_dir(ctx.tmp_dir).chunk_bytes(plan.chunk_bytes);
  if (optimizer == "fused_sgd") {
    opt = std::make_unique<fsdp::FusedSGD>(model->parameters(),
                                           torch::optim::SGDOptions(0.1).momentum(0.9), state);
  } else if (optimizer == "torch_adamw") {
    opt = std::make_unique<torch::optim::AdamW>(model->parameters(),
                                                torch::optim::AdamWOptions(1e-3));
  } else {
    opt = std::make_unique<fsdp::FusedAdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3),
                                             state);
  }
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + rank);
  auto tokens = torch::randint(cfg.vocab_size, {2, cfg.block_size + 1}, gen,
                               torch::TensorOptions().dtype(torch::kLong));
  auto x = tokens.narrow(1, 0, cfg.block_size), y = tokens.narrow(1, 1, cfg.block_size);
  return check_states(
      strategy + ", " + optimizer, rank, base, params, predicted,
      [&] { fsdp_models::lm_loss(fsdp::forward(model, x), y).backward(); }, *opt);
}

// ---- A step's peak: predicted from the units and a calibration, measured on a real step ----

// Runs `steps` training steps as fsdp-train does (gradients set to none, forward and backward
// tagged as activations, the optimizer step as optimizer) and returns the last one's peak and
// its breakdown.
struct Measured {
  int64_t peak = 0;
  mem::CategoryBytes at_peak;
};

FSDP_WORKER(plan_step_memory) {
  mem::install_tracking_allocator();
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), world = pg->size();
  const std::string arch = ctx.env("FSDP_ARCH", "gpt");
  const std::string strategy = ctx.env("FSDP_STRATEGY", "full_shard");
  const auto ac = fsdp::from_string<fsdp::CheckpointMode>(ctx.env("FSDP_AC", "none"));
  const int64_t ac_every = std::stoll(ctx.env("FSDP_AC_EVERY", "1"));
  const auto dtype = ctx.env("FSDP_DTYPE", "fp32") == "bf16" ? torch::kBFloat16 : torch::kFloat;
  const auto gather = fsdp::from_string<fsdp::GatherFormat>(ctx.env("FSDP_GATHER", "param_dtype"));
  const int64_t b = std::stoll(ctx.env("FSDP_B", "8")), t = std::stoll(ctx.env("FSDP_T", "64"));
  const int micro = std::stoi(ctx.env("FSDP_MICRO", "1"));
  const int k = std::stoi(ctx.env("FSDP_RESHARD_K", "0"));

  fsdp::plan::StepOptions plan;
  auto& st = plan.states;
  st.world_size = world;
  st.strategy = fsdp::from_string<fsdp::ShardingStrategy>(strategy);
  st.hybrid_shard_size = st.strategy == fsdp::ShardingStrategy::kHybridShard ? 2 : 0;
  if (dtype != torch::kFloat)
    st.param_dtype = dtype;
  st.reduce_dtype = torch::kFloat;
  plan.gather_format = gather;
  plan.reshard_after_forward_size = k;
  plan.batch_rows = b, plan.seq_len = t, plan.micro_batches = micro;

  auto opts = fsdp::FullyShardOptions(pg).strategy(st.strategy);
  if (st.hybrid_shard_size > 0)
    opts.hybrid_shard_size(st.hybrid_shard_size);
  if (k > 0)
    opts.reshard_after_forward_size(k);
  auto policy = fsdp::MixedPrecisionPolicy().reduce_dtype(torch::kFloat).gather_format(gather);
  if (dtype != torch::kFloat)
    policy.param_dtype(dtype);
  auto block_opts = opts;
  block_opts.mp_policy(policy).activation_checkpointing(ac);
  auto root_opts = opts;
  root_opts.mp_policy(fsdp::MixedPrecisionPolicy(policy).output_dtype(torch::kFloat));
  auto loss_of = [&](const torch::Tensor& logits, const torch::Tensor& targets) {
    return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                                targets.reshape({-1})) /
           static_cast<double>(micro);
  };
  fsdp_models::PlanLoss plan_loss = [&](const torch::Tensor& logits, int64_t bb, int64_t tt) {
    auto targets = torch::randint(logits.size(-1), {bb, tt}, torch::kLong);
    return loss_of(logits, targets);
  };

  std::vector<std::string> paths;
  fsdp::plan::ActivationModel acts;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::shared_ptr<torch::nn::Module> module;
  int64_t vocab = 0, layers = 0;
  if (arch == "gpt") {
    auto cfg = GPTConfig::preset("gpt2-tiny");
    cfg.block_size = 2 * t;
    vocab = cfg.vocab_size, layers = cfg.n_layer;
    {
      auto one = cfg;
      one.n_layer = 1;
      GPT small(one);
      small->blocks[0]->to(dtype);
      if (dtype != torch::kFloat)
        small->to(dtype);
      acts = fsdp::plan::calibrate_activations(
          fsdp_models::calibration_pieces(small, dtype, plan_loss), 2, std::min<int64_t>(64, t));
    }
    torch::manual_seed(3);
    GPT model(cfg);
    paths = fsdp_models::unit_paths(cfg);
    fsdp_models::parallelize_gpt(model, block_opts, root_opts, ac_every);
    module = model.ptr();
    forward = [model](const torch::Tensor& x) mutable { return fsdp::forward(model, x); };
  } else {
    LlamaConfig cfg;
    cfg.vocab_size = 384, cfg.max_seq_len = 2 * t, cfg.dim = 128, cfg.n_layers = 3;
    cfg.n_heads = 4, cfg.n_kv_heads = 2, cfg.ffn_hidden_dim = 352;
    vocab = cfg.vocab_size, layers = cfg.n_layers;
    {
      auto one = cfg;
      one.n_layers = 1;
      Llama small(one);
      if (dtype != torch::kFloat)
        small->to(dtype);
      acts = fsdp::plan::calibrate_activations(
          fsdp_models::calibration_pieces(small, dtype, plan_loss), 2, std::min<int64_t>(64, t));
    }
    torch::manual_seed(3);
    Llama model(cfg);
    paths = fsdp_models::unit_paths(cfg);
    fsdp_models::parallelize_llama(model, block_opts, root_opts, ac_every);
    module = model.ptr();
    forward = [model](const torch::Tensor& x) mutable { return fsdp::forward(model, x); };
  }
  for (int64_t i = 0; i < layers; ++i)
    plan.checkpoint.push_back(i % ac_every == 0 ? ac : fsdp::CheckpointMode::kNone);

  // The units from a model of the same shapes that is not sharded (the planner's input).
  std::vector<fsdp::plan::UnitInfo> units;
  if (arch == "gpt") {
    auto cfg = GPTConfig::preset("gpt2-tiny");
    cfg.block_size = 2 * t;
    GPT meta(cfg, fsdp_models::ModelInit().device(torch::kMeta));
    units = fsdp::plan::describe_units(*meta, paths);
  } else {
    LlamaConfig cfg;
    cfg.vocab_size = 384, cfg.max_seq_len = 2 * t, cfg.dim = 128, cfg.n_layers = 3;
    cfg.n_heads = 4, cfg.n_kv_heads = 2, cfg.ffn_hidden_dim = 352;
    Llama meta(cfg, fsdp_models::ModelInit().device(torch::kMeta));
    units = fsdp::plan::describe_units(*meta, paths);
  }

  fsdp::FusedAdamW opt(module->parameters(), torch::optim::AdamWOptions(1e-3));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(50 + rank);
  Measured measured;
  for (int step = 0; step < 3; ++step) {
    auto batch = torch::randint(vocab, {b * micro, t + 1}, gen, torch::kLong);
    if (step == 2) {
      plan.other_bytes = mem::current_by_category()[mem::Category::kOther];
      mem::reset_peak();
    }
    opt.zero_grad();
    for (int i = 0; i < micro; ++i) {
      if (micro > 1)
        fsdp::set_requires_gradient_sync(*module, i == micro - 1);
      mem::CategoryScope tag(mem::Category::kActivations);
      torch::Tensor loss;
      {  // as fsdp-train: the logits go before backward
        auto mb = batch.narrow(0, i * b, b);
        auto logits = forward(mb.narrow(1, 0, t));
        loss = loss_of(logits, mb.narrow(1, 1, t));
      }
      loss.backward();
    }
    mem::CategoryScope tag(mem::Category::kOptimizer);
    mem::set_moment(mem::moment_id("optimizer"));
    opt.step();
  }
  measured.peak = mem::peak_bytes();
  measured.at_peak = mem::at_peak_by_category();
  const auto p = fsdp::plan::predict_step_memory(units, plan, acts, rank);
  std::printf(
      "[rank %d] %s | predicted peak %lld (%lld without staging) at %s %s '%s' | measured %lld at "
      "%s | error %+.2f%%\n",
      rank, ctx.env("FSDP_LABEL", "").c_str(), (long long)p.peak, (long long)p.peak_without_staging,
      fsdp::plan::to_string(p.moment.phase), p.moment.what.c_str(), p.moment.unit.c_str(),
      (long long)measured.peak, mem::at_peak_moment().c_str(),
      100.0 * (double(p.peak) - double(measured.peak)) / double(measured.peak));
  for (int c = 0; c < mem::kNumCategories; ++c) {
    std::printf("[rank %d]   %-20s predicted %10lld measured %10lld\n", rank,
                mem::to_string(static_cast<mem::Category>(c)), (long long)p.at_peak.bytes[c],
                (long long)measured.at_peak.bytes[c]);
  }
  if (ctx.env("FSDP_TIMELINE", "0") == "1" && rank == 0) {
    for (const auto& [m, bytes] : p.timeline) {
      std::printf("  %-9s %-10s %-8s mb%d |", fsdp::plan::to_string(m.phase), m.unit.c_str(),
                  m.what.c_str(), m.micro_batch);
      for (int c = 0; c < mem::kNumCategories; ++c)
        std::printf(" %9lld", (long long)bytes.bytes[c]);
      std::printf(" | %lld\n", (long long)bytes.total());
    }
  }
  // Within 5% of [peak_without_staging, peak]: whether Gloo's staging buffers of a gather in
  // flight are still alive at the high-water mark depends on timing (they differ run to run).
  const double low = 0.95 * double(p.peak_without_staging), high = 1.05 * double(p.peak);
  WORKER_CHECK(double(measured.peak) >= low && double(measured.peak) <= high)
      << "predicted peak " << p.peak_without_staging << " .. " << p.peak << " B, measured "
      << measured.peak;
  // The moment: two moments of a step can peak within a few kB of each other, and which one a
  // run reaches depends on when Gloo frees its buffers; the check is that the prediction puts
  // the measured moment within 5% of its own peak.
  const std::string label = mem::at_peak_moment();
  WORKER_CHECK(double(p.highest_at(label)) >= 0.95 * double(p.peak))
      << "measured peak at '" << label << "', predicted there " << p.highest_at(label)
      << " B, below 95% of the predicted peak " << p.peak;
  auto largest_of = [](const mem::CategoryBytes& bytes) {
    int largest = 0;
    for (int c = 1; c < mem::kNumCategories; ++c) {
      if (bytes.bytes[c] > bytes.bytes[largest])
        largest = c;
    }
    return largest;
  };
  // The largest category: the prediction's at its peak, or at the moment the run peaked (where
  // a gather's staging already freed moved the peak to another moment, its mix is that one's).
  // A category within 25% of the measured largest counts as a tie: how many unsharded gradients
  // are still alive at a moment of backward depends on when Gloo completes a reduce-scatter (at
  // one sequence of 8 tokens, 1.86-2.72 MB of gradients beside 2.31 MB of optimizer state,
  // measured under a loaded suite).
  const int largest = largest_of(measured.at_peak);
  int64_t highest_there = -1;
  int largest_there = -1;
  for (const auto& [m, bytes] : p.timeline) {
    if (fsdp::plan::moment_label(m) == label && bytes.total() > highest_there)
      highest_there = bytes.total(), largest_there = largest_of(bytes);
  }
  const auto ties = [&](int c) {
    return c >= 0 && 4 * measured.at_peak.bytes[c] >= 3 * measured.at_peak.bytes[largest];
  };
  WORKER_CHECK(ties(static_cast<int>(p.largest_category())) || ties(largest_there))
      << "largest category at the peak: predicted " << mem::to_string(p.largest_category())
      << " (at '" << label << "': "
      << (largest_there < 0 ? "none" : mem::to_string(static_cast<mem::Category>(largest_there)))
      << "), measured " << mem::to_string(static_cast<mem::Category>(largest));
  return 0;
}

struct Variant {
  int world;
  std::vector<std::pair<std::string, std::string>> env;
};

TEST(PlanModelStates, PredictedBytesEqualMeasuredPerRank) {
  const std::vector<Variant> variants{
      {3, {{"FSDP_STRATEGY", "full_shard"}}},
      {3, {{"FSDP_STRATEGY", "no_shard"}, {"FSDP_OPTIMIZER", "torch_adamw"}}},
      {3,
       {{"FSDP_STRATEGY", "shard_grad_op"},
        {"FSDP_OPTIMIZER", "fused_sgd"},
        {"FSDP_BF16_MOMENTS", "1"}}},
      {4, {{"FSDP_STRATEGY", "hybrid_shard"}, {"FSDP_REDUCE_BF16", "1"}}},
      {2, {{"FSDP_STRATEGY", "full_shard"}, {"FSDP_OFFLOAD", "1"}}},
      {2, {{"FSDP_STRATEGY", "full_shard"}, {"FSDP_STATE_FILE", "1"}}},
      {3, {{"FSDP_MODEL", "llama_qlora"}}},
  };
  for (const auto& v : variants) {
    fsdp::test::RunOptions opts;
    opts.env = v.env;
    EXPECT_WORKERS_OK(fsdp::test::run_workers("plan_model_states", v.world, opts));
  }
}

// One variant per mechanism of the replay, each on a real step: full_shard, shard_grad_op and
// no_shard on 2 and 3 ranks, both model families, fp32 and bf16, the three checkpoint modes,
// accumulation. The broader grid (world sizes 1-4, hybrid_shard, reshard-to-2, int8 and bf16
// gathers, offload, optimizers) runs through fsdp-train in bench/plan_accuracy.py
// (docs/planner.md has its table); this test stays within 25 s on 2 cores.
TEST(PlanStepMemory, PeakWithinFivePercentOfMeasured) {
  const std::vector<Variant> variants{
      {2, {{"FSDP_LABEL", "gpt full_shard fp32"}}},
      // One sequence of 8 tokens: the peak is in backward, where the reduction's buffers live
      // as fsdp/detail/buffer_lifetimes.h says (the engine frees by it, the replay follows it).
      {3, {{"FSDP_LABEL", "gpt full_shard fp32 1 x 8 tokens"}, {"FSDP_B", "1"}, {"FSDP_T", "8"}}},
      {3,
       {{"FSDP_LABEL", "gpt shard_grad_op ac full"},
        {"FSDP_STRATEGY", "shard_grad_op"},
        {"FSDP_AC", "full"}}},
      {2,
       {{"FSDP_LABEL", "gpt full every-2 micro 2"},
        {"FSDP_AC", "full"},
        {"FSDP_AC_EVERY", "2"},
        {"FSDP_MICRO", "2"}}},
      // no_shard frees its bf16 copies after forward and casts again in backward, as DDP
      // holds no second copy (the planner kept them until the grid's no_shard bf16 rows came
      // out 1.5 MiB high).
      {2,
       {{"FSDP_LABEL", "gpt no_shard bf16 micro 2"},
        {"FSDP_STRATEGY", "no_shard"},
        {"FSDP_DTYPE", "bf16"},
        {"FSDP_MICRO", "2"}}},
      {2,
       {{"FSDP_LABEL", "llama full bf16 selective"},
        {"FSDP_ARCH", "llama"},
        {"FSDP_DTYPE", "bf16"},
        {"FSDP_AC", "selective"}}},
  };
  for (const auto& v : variants) {
    fsdp::test::RunOptions opts;
    opts.env = v.env;
    opts.timeout = std::chrono::seconds(120);
    auto r = fsdp::test::run_workers("plan_step_memory", v.world, opts);
    for (const auto& out : r.outputs)
      std::printf("%s", out.c_str());
    EXPECT_WORKERS_OK(r);
  }
}

// The calibration's three measurements predict a fourth size, and checkpointing keeps less.
TEST(PlanActivations, ScalingPredictsAnotherSizeAndCheckpointingKeepsLess) {
  mem::install_tracking_allocator();
  auto cfg = GPTConfig::preset("gpt2-tiny");
  cfg.n_layer = 1, cfg.block_size = 128;
  GPT model(cfg);
  const auto pieces = fsdp_models::calibration_pieces(
      model, torch::kFloat, [](const torch::Tensor& logits, int64_t b, int64_t t) {
        return torch::nn::functional::cross_entropy(
            logits.reshape({-1, logits.size(-1)}),
            torch::randint(logits.size(-1), {b * t}, torch::kLong));
      });
  const auto acts = fsdp::plan::calibrate_activations(pieces, 2, 32);
  auto show = [](const char* n, const fsdp::plan::PieceBytes& p) {
    const auto peak = p.backward_peak();
    std::printf(
        "%-10s saved %9lld fwd %9lld bwd %9lld + grads %9lld (%zu segments) release %9lld\n", n,
        (long long)p.saved, (long long)p.forward_peak, (long long)peak.activations,
        (long long)peak.grads, p.backward.size(), (long long)p.backward_release);
  };
  const int64_t b = 3, t = 48;
  show("pre", acts.pre.at(b, t));
  show("none", acts.block[0].at(b, t));
  show("full", acts.block[1].at(b, t));
  show("selective", acts.block[2].at(b, t));
  show("post", acts.post.at(b, t));
  // Checkpointing keeps less: full keeps the input only, selective the products too.
  const auto none = acts.block[0].at(b, t), full = acts.block[1].at(b, t),
             selective = acts.block[2].at(b, t);
  EXPECT_LT(full.saved, selective.saved);
  EXPECT_LT(selective.saved, none.saved);
  // ... and recomputes in backward: its high-water mark is the plain block's kept bytes more.
  EXPECT_GT(full.backward_peak().activations, none.backward_peak().activations);
  // A size the calibration never ran, measured: the fit from (2, 32), (4, 32), (2, 64) holds.
  const auto measured = fsdp::plan::measure_piece(
      [&] { return fsdp::plan::calibration_input(pieces, b, t); },
      [&](const torch::Tensor& x) { return pieces.block(x, t); }, pieces.parameters);
  show("measured", measured);
  auto near = [](int64_t predicted, int64_t actual, double tolerance) {
    return std::abs(static_cast<double>(predicted - actual)) <=
           tolerance * static_cast<double>(std::max<int64_t>(1, std::abs(actual)));
  };
  EXPECT_TRUE(near(none.saved, measured.saved, 0.01)) << none.saved << " vs " << measured.saved;
  EXPECT_TRUE(near(none.forward_peak, measured.forward_peak, 0.01))
      << none.forward_peak << " vs " << measured.forward_peak;
  const auto peak_fit = none.backward_peak(), peak_measured = measured.backward_peak();
  EXPECT_TRUE(near(peak_fit.activations + peak_fit.grads,
                   peak_measured.activations + peak_measured.grads, 0.02))
      << peak_fit.activations << " + " << peak_fit.grads << " vs " << peak_measured.activations
      << " + " << peak_measured.grads;
  // One block's output, once the next block has it, is what stays (single-piece release minus
  // the chain correction the calibration makes; within 1%).
  EXPECT_TRUE(near(none.backward_release, measured.backward_release, 0.01))
      << none.backward_release << " vs " << measured.backward_release;
}

// Calibrating narrowed copies (every width / 2 sampled at one size, / 4 and / 8 calibrated) and
// extrapolating to full width gives what calibrating the full width measures: each count of each
// piece at a size neither calibration ran, within a few bytes of rounding. Returns how many
// counts are further off (each printed).
int narrowed_against_full(const char* model, const auto& cfg, const auto& pieces, bool vocab) {
  const int64_t b = 3, t = 96;
  auto calibrate = [&](const auto& c) {
    return fsdp::plan::calibrate_activations(pieces(c), 2, 64);
  };
  // The extrapolation from narrowings 2 (one size), 4 and 8 (calibrated), as fsdp-plan combines
  // them.
  const auto extrapolated = fsdp::plan::extrapolate_to_full_width(
      fsdp::plan::measure_activations(pieces(fsdp_models::narrowed(cfg, 2, vocab)), 2, 64), 2,
      {4, calibrate(fsdp_models::narrowed(cfg, 4, vocab))},
      {8, calibrate(fsdp_models::narrowed(cfg, 8, vocab))});
  const auto full = calibrate(cfg);
  int64_t worst = 0, largest = 0;
  int off = 0;
  auto same = [&](const std::string& what, int64_t expected, int64_t actual) {
    worst = std::max(worst, std::abs(expected - actual));
    largest = std::max(largest, std::abs(expected));
    if (std::abs(expected - actual) > 64) {
      ++off;
      std::printf("%s %s: full width %lld B, extrapolated %lld\n", model, what.c_str(),
                  (long long)expected, (long long)actual);
    }
  };
  auto piece = [&](const std::string& name, const fsdp::plan::PieceScaling& f,
                   const fsdp::plan::PieceScaling& e) {
    const auto pf = f.at(b, t), pe = e.at(b, t);
    same(name + " saved", pf.saved, pe.saved);
    same(name + " forward peak", pf.forward_peak, pe.forward_peak);
    same(name + " output", pf.output, pe.output);
    same(name + " backward release", pf.backward_release, pe.backward_release);
    if (pf.backward.size() != pe.backward.size()) {
      ++off;
      std::printf("%s %s: %zu backward segments at full width, %zu extrapolated\n", model,
                  name.c_str(), pf.backward.size(), pe.backward.size());
      return;
    }
    for (size_t i = 0; i < pf.backward.size(); ++i) {
      same(name + " segment " + std::to_string(i), pf.backward[i].activations,
           pe.backward[i].activations);
      same(name + " segment grads " + std::to_string(i), pf.backward[i].grads,
           pe.backward[i].grads);
    }
  };
  // The tensor-parallel group's counts (none without one): bytes to the byte, calls exactly.
  auto traffic = [&](const std::string& name, const fsdp::plan::PieceScaling& f,
                     const fsdp::plan::PieceScaling& e) {
    const auto ff = fsdp::plan::TrafficScaling::values(f.forward_traffic.at(b, t)),
               fe = fsdp::plan::TrafficScaling::values(e.forward_traffic.at(b, t)),
               bf = fsdp::plan::TrafficScaling::values(f.backward_traffic.at(b, t)),
               be = fsdp::plan::TrafficScaling::values(e.backward_traffic.at(b, t));
    for (size_t i = 0; i < ff.size(); ++i) {
      if (ff[i] != fe[i] || bf[i] != be[i]) {
        ++off;
        std::printf("%s %s traffic count %zu: full width %lld / %lld, extrapolated %lld / %lld\n",
                    model, name.c_str(), i, (long long)ff[i], (long long)bf[i], (long long)fe[i],
                    (long long)be[i]);
      }
    }
  };
  traffic("pre", full.pre, extrapolated.pre);
  traffic("post", full.post, extrapolated.post);
  for (size_t m = 0; m < 3; ++m)
    traffic("block mode " + std::to_string(m), full.block[m], extrapolated.block[m]);
  piece("pre", full.pre, extrapolated.pre);
  piece("post", full.post, extrapolated.post);
  for (size_t m = 0; m < 3; ++m)
    piece("block mode " + std::to_string(m), full.block[m], extrapolated.block[m]);
  off += full.pre_parameters != extrapolated.pre_parameters;
  off += full.post_parameters != extrapolated.post_parameters;
  std::printf(
      "NARROWED (%s): %d count(s) off; every count within %lld B of the full width's "
      "(largest %lld B)\n",
      model, off, (long long)worst, (long long)largest);
  return off;
}

torch::Tensor random_target_loss(const torch::Tensor& logits, int64_t b, int64_t t) {
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}),
      torch::randint(logits.size(-1), {b * t}, torch::kLong));
}

// A bf16 Llama with grouped-query attention and a vocabulary that narrows with it. Run as a
// worker with ATen's own bf16 kernels (ONEDNN_MAX_CPU_ISA=AVX2), where the extrapolation is
// exact on every CPU; where ATen hands bf16 to oneDNN it is not (plan::narrowing_is_exact), and
// the planner calibrates such models at full width up to the fp32 limit.
FSDP_WORKER(narrowed_llama_bf16) {
  mem::install_tracking_allocator();
  WORKER_CHECK(fsdp::plan::narrowing_is_exact(torch::kBFloat16))
      << "ATen still hands bf16 to oneDNN under ONEDNN_MAX_CPU_ISA="
      << ctx.env("ONEDNN_MAX_CPU_ISA");
  LlamaConfig cfg;
  cfg.vocab_size = 384, cfg.max_seq_len = 256, cfg.dim = 128, cfg.n_layers = 1;
  cfg.n_heads = 4, cfg.n_kv_heads = 2, cfg.ffn_hidden_dim = 352;
  WORKER_CHECK(fsdp_models::max_narrowing(cfg) >= 8);
  auto pieces = [&](const LlamaConfig& c) {
    torch::manual_seed(1);
    Llama model(c);
    model->to(torch::kBFloat16);
    return fsdp_models::calibration_pieces(model, torch::kBFloat16, random_target_loss);
  };
  WORKER_CHECK(narrowed_against_full("llama bf16", cfg, pieces, /*vocab=*/true) == 0);
  return 0;
}

// The Llama above in a worker, and an fp32 GPT whose vocabulary (prime) does not narrow, with the
// fused, chunked head and loss, in this process (fp32 narrows exactly on every CPU).
TEST(PlanActivations, NarrowedCalibrationExtrapolatesToTheFullWidth) {
  auto llama = fsdp::test::run_workers(
      "narrowed_llama_bf16", 1,
      fsdp::test::with_env({{"ONEDNN_MAX_CPU_ISA", "AVX2"}, {"ATEN_CPU_CAPABILITY", "avx2"}}));
  for (const auto& out : llama.outputs)
    std::printf("%s", out.c_str());
  EXPECT_WORKERS_OK(llama);
  std::printf("this CPU: bf16 narrowing %s\n", fsdp::plan::narrowing_is_exact(torch::kBFloat16)
                                                   ? "exact"
                                                   : "approximate (ATen hands bf16 to oneDNN)");
  mem::install_tracking_allocator();
  auto cfg = GPTConfig::preset("gpt2-tiny");
  cfg.n_layer = 1, cfg.block_size = 256, cfg.vocab_size = 509;
  // The fused head and loss (the trainer's default), in chunks of 37 of a run's 288 positions:
  // the chunk stays the run's at every width.
  fsdp_models::PlanFusedLoss fused;
  fused.chunk = 37, fused.positions = 3 * 96;
  fused.spec = [](int64_t bb, int64_t tt) {
    fsdp_models::LossSpec spec;
    spec.targets = torch::randint(509, {bb, tt}, torch::kLong);
    spec.denominator = static_cast<double>(bb * tt);
    return spec;
  };
  auto pieces = [&](const GPTConfig& c) {
    torch::manual_seed(1);
    GPT model(c);
    return fsdp_models::calibration_pieces(model, torch::kFloat, random_target_loss, std::nullopt,
                                           fused);
  };
  EXPECT_EQ(narrowed_against_full("gpt fp32", cfg, pieces, /*vocab=*/false), 0);
}

// Tensor parallelism: the calibration, run on a model split over a local group of the
// tensor-parallel size, counts the collectives each piece issues there, and its fit gives, at a
// size it never ran, the bytes (exactly) and calls that the pieces issue when run at that size;
// and narrowed copies extrapolate them to the full width exactly. GPT with sequence parallelism
// and the fused loss in chunks (tp rank 0 of 2), Llama with its kv heads kept whole and the
// unfused loss (the last of 4 ranks, which holds the fewest words).
TEST(PlanActivations, TensorParallelTrafficIsCountedAndScaled) {
  mem::install_tracking_allocator();
  const int64_t b = 3, t = 96;
  auto check = [&](const char* name, const fsdp::plan::CalibrationPieces& pieces,
                   bool per_chunk_loss) {
    const auto acts = fsdp::plan::calibrate_activations(pieces, 2, 64);
    EXPECT_EQ(acts.tp_ways, pieces.group->size());
    const auto predicted = acts.tp_traffic(b, t);
    auto input = [&] { return fsdp::plan::calibration_input(pieces, b, t); };
    auto compare = [&](const std::string& piece, const fsdp::plan::PieceTraffic& p,
                       const fsdp::plan::PieceBytes& m, bool exact_calls) {
      const auto pf = fsdp::plan::TrafficScaling::values(p.forward),
                 mf = fsdp::plan::TrafficScaling::values(m.traffic.forward),
                 pb = fsdp::plan::TrafficScaling::values(p.backward),
                 mb = fsdp::plan::TrafficScaling::values(m.traffic.backward);
      for (size_t i = 0; i < pf.size(); ++i) {
        const bool bytes = i % 2 == 1;
        if (!bytes && !exact_calls)
          continue;
        EXPECT_EQ(pf[i], mf[i]) << name << " " << piece << " forward count " << i;
        EXPECT_EQ(pb[i], mb[i]) << name << " " << piece << " backward count " << i;
      }
    };
    auto none = [] { return torch::Tensor(); };
    compare("pre", predicted.pre,
            fsdp::plan::measure_piece(
                none, [&](const torch::Tensor&) { return pieces.pre(b, t); }, pieces.parameters,
                nullptr, pieces.group.get()),
            true);
    for (auto mode : {fsdp::CheckpointMode::kNone, fsdp::CheckpointMode::kFull,
                      fsdp::CheckpointMode::kSelective}) {
      const auto measured = fsdp::plan::measure_piece(
          input,
          [&](const torch::Tensor& x) {
            return fsdp::checkpoint(
                [&](const std::vector<torch::Tensor>& in) {
                  return std::vector<torch::Tensor>{pieces.block(in[0], t)};
                },
                {x}, mode)[0];
          },
          pieces.parameters, nullptr, pieces.group.get());
      compare("block mode " + std::to_string(static_cast<int>(mode)), predicted.block_with(mode),
              measured, true);
    }
    const auto post = fsdp::plan::measure_piece(
        input, [&](const torch::Tensor& x) { return pieces.loss(pieces.head(x, t), t); },
        pieces.parameters, nullptr, pieces.group.get());
    // The loss's all-reduces per chunk of positions, ceil(B·T / chunk) calls, are counted at the
    // calibration's sizes, not fitted to them: their bytes only.
    compare("post", predicted.post, post, !per_chunk_loss);
    const auto block = predicted.block_with(fsdp::CheckpointMode::kNone);
    std::printf(
        "%s at (%lld, %lld): a block issues %lld all-reduces (%lld B), %lld all-gathers (%lld B) "
        "and %lld reduce-scatters (%lld B) in forward and backward; the whole chain %lld B\n",
        name, (long long)b, (long long)t,
        (long long)(block.forward.all_reduce.calls + block.backward.all_reduce.calls),
        (long long)(block.forward.all_reduce.bytes + block.backward.all_reduce.bytes),
        (long long)(block.forward.all_gather.calls + block.backward.all_gather.calls),
        (long long)(block.forward.all_gather.bytes + block.backward.all_gather.bytes),
        (long long)(block.forward.reduce_scatter.calls + block.backward.reduce_scatter.calls),
        (long long)(block.forward.reduce_scatter.bytes + block.backward.reduce_scatter.bytes),
        (long long)(fsdp::plan::buffer_bytes(predicted.pre.forward) +
                    fsdp::plan::buffer_bytes(predicted.pre.backward) +
                    fsdp::plan::buffer_bytes(block.forward) +
                    fsdp::plan::buffer_bytes(block.backward) +
                    fsdp::plan::buffer_bytes(predicted.post.forward) +
                    fsdp::plan::buffer_bytes(predicted.post.backward)));
    EXPECT_GT(fsdp::plan::buffer_bytes(block.forward), 0) << name;
  };

  auto gpt_cfg = GPTConfig::preset("gpt2-tiny");
  gpt_cfg.n_layer = 1, gpt_cfg.block_size = 256, gpt_cfg.vocab_size = 509;
  const auto tp2 = fsdp::local_group(2, 0, "test/tp2");
  fsdp_models::PlanFusedLoss fused;
  fused.chunk = 37, fused.positions = b * t;
  fused.spec = [](int64_t bb, int64_t tt) {
    fsdp_models::LossSpec spec;
    spec.targets = torch::randint(509, {bb, tt}, torch::kLong);
    spec.denominator = static_cast<double>(bb * tt);
    return spec;
  };
  auto gpt_pieces = [&](const GPTConfig& c) {
    torch::manual_seed(1);
    GPT model(c);
    fsdp_models::tensor_parallelize_gpt(model, tp2);
    model->use_sequence_parallel(tp2);
    auto pieces = fsdp_models::calibration_pieces(model, torch::kFloat, random_target_loss,
                                                  std::nullopt, fused);
    pieces.group = tp2;
    return pieces;
  };
  check("gpt, tp 2, sequence parallel, fused loss", gpt_pieces(gpt_cfg), true);
  EXPECT_EQ(narrowed_against_full("gpt tp 2 sequence parallel", gpt_cfg, gpt_pieces, false), 0);

  LlamaConfig llama_cfg;
  llama_cfg.vocab_size = 383, llama_cfg.max_seq_len = 256, llama_cfg.dim = 64;
  llama_cfg.n_layers = 1, llama_cfg.n_heads = 4, llama_cfg.n_kv_heads = 2;
  llama_cfg.ffn_hidden_dim = 96;
  const auto tp4 = fsdp::local_group(4, 3, "test/tp4");
  torch::manual_seed(2);
  Llama llama(llama_cfg);
  fsdp_models::tensor_parallelize_llama(llama, tp4);  // 2 kv heads on 4 ranks: kept whole
  auto llama_pieces = fsdp_models::calibration_pieces(llama, torch::kFloat, random_target_loss);
  llama_pieces.group = tp4;
  check("llama, tp 4 (rank 3), kv heads kept whole, unfused loss", llama_pieces, false);
  // What the layout implies for a Llama block: forward, the row-parallel wo and w2 sum their
  // parts (2 all-reduces); backward, one all-reduce of the input's gradient for q (whose copy
  // of the input is shared, LlamaAttentionImpl::share_input_copy) and one for w1 and w3, and
  // one each for the kept-whole k and v outputs' gradients (4).
  const auto block = fsdp::plan::calibrate_activations(llama_pieces, 2, 64)
                         .tp_traffic(b, t)
                         .block_with(fsdp::CheckpointMode::kNone);
  EXPECT_EQ(block.forward.all_reduce.calls, 2);
  EXPECT_EQ(block.backward.all_reduce.calls, 4);
}

TEST(PlanUnits, EveryParameterInItsInnermostUnitAndBadPathsNamed) {
  auto cfg = GPTConfig::preset("gpt2-test");
  cfg.n_layer = 2;
  GPT model(cfg);
  const auto units = fsdp::plan::describe_units(*model, {"h0", "h1", ""});
  ASSERT_EQ(units.size(), 3u);
  size_t listed = 0;
  for (const auto& u : units) {
    for (const auto& p : u.params) {
      ++listed;
      if (!u.path.empty()) {
        EXPECT_EQ(p.name.rfind(u.path + ".", 0), 0u) << p.name << " in " << u.path;
      } else {
        EXPECT_NE(p.name.rfind("h0.", 0), 0u) << p.name;
        EXPECT_NE(p.name.rfind("h1.", 0), 0u) << p.name;
      }
    }
  }
  EXPECT_EQ(listed, model->parameters().size());
  try {
    fsdp::plan::describe_units(*model, {"h7"});
    ADD_FAILURE() << "an unknown path was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("'h7'"), std::string::npos);
  }
  try {
    fsdp::plan::describe_units(*model, {"h0"});
    ADD_FAILURE() << "parameters in no unit were accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("in no unit"), std::string::npos);
  }
}

}  // namespace

// The data-sheet model (fsdp/plan/hardware.h) against the same arithmetic by hand: profiles by
// name, ring collectives on NVLink, backward = 2 forwards (+1 under full checkpointing), the
// FLOPs of a Llama block from its shapes, and overlap exposing only what compute cannot hide.
TEST(PlanHardware, DataSheetModelIsTheArithmeticByHand) {
  namespace plan = fsdp::plan;
  const auto& a100 = plan::builtin_device("a100-80gb");
  EXPECT_EQ(a100.bf16_flops, 312e12);
  EXPECT_EQ(a100.flops(torch::kFloat), 19.5e12);
  EXPECT_FALSE(a100.source.empty());
  EXPECT_EQ(plan::builtin_devices().size(), 6u);
  // The H200: the H100's compute with the memory its machines report (docs/gpu.md).
  const auto& h200 = plan::builtin_device("h200");
  EXPECT_EQ(h200.bf16_flops, plan::builtin_device("h100-80gb").bf16_flops);
  EXPECT_EQ(h200.memory_bytes, int64_t{143771} << 20);
  try {
    plan::builtin_device("tpu");
    ADD_FAILURE() << "an unknown profile was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("known: a100-40gb"), std::string::npos);
  }
  // 4 ranks on NVLink (300 GB/s a direction): a 1 GB all-gather moves 3/4 GB per link.
  const auto link = plan::device_link(a100, 4, false);
  EXPECT_NEAR(link.all_gather.seconds(1000000000), 8.4e-6 + 3 * 3.4e-6 + 0.75 / 300, 1e-12);
  EXPECT_NEAR(link.all_reduce.seconds(1000000000), 8.4e-6 + 6 * 3.4e-6 + 1.5 / 300, 1e-12);
  EXPECT_THROW(plan::device_link(plan::builtin_device("l40s"), 4, true), c10::Error);
  // Across two DGX H100 nodes the ring's slowest link is a 400 Gb/s port.
  const auto h100 = plan::device_link(plan::builtin_device("h100-80gb"), 16, true);
  EXPECT_NEAR(h100.reduce_scatter.bytes_per_s, 50e9 * 16 / 15, 1);

  const auto cfg = LlamaConfig::preset("llama-13b");
  const int64_t b = 2, t = 2048;
  const auto f = fsdp_models::piece_flops(cfg, b, t);
  // 2 FLOPs per multiply-add of every matrix (all but the embedding table and the norms), and
  // attention's two t x t products per layer.
  const double d = static_cast<double>(cfg.dim), tokens = static_cast<double>(b * t);
  const double matrices = static_cast<double>(cfg.num_params()) -
                          static_cast<double>(cfg.vocab_size) * d -
                          static_cast<double>(2 * cfg.n_layers + 1) * d;
  EXPECT_NEAR((cfg.n_layers * f.block + f.post) / tokens,
              2 * matrices + 4.0 * t * d * static_cast<double>(cfg.n_layers), 1e-6 * matrices);
  const auto times = plan::flop_compute_times(f, 312e12);
  const auto& none = times.block[static_cast<size_t>(fsdp::CheckpointMode::kNone)];
  const auto& full = times.block[static_cast<size_t>(fsdp::CheckpointMode::kFull)];
  EXPECT_DOUBLE_EQ(none.forward, f.block / 312e12);
  EXPECT_DOUBLE_EQ(none.backward, 2 * none.forward);
  EXPECT_DOUBLE_EQ(full.backward, 3 * none.forward);

  // Overlap: one block of one parameter matrix on 2 ranks; its gathers take 1 s each. With a
  // block forward of 3 s they hide; with 0.25 s only 0.75 s each is exposed.
  std::vector<plan::UnitInfo> units{{"h0", {{"h0.w", {1000, 1000}, torch::kFloat, true}}},
                                    {"", {{"w", {10}, torch::kFloat, true}}}};
  plan::StepOptions o;
  o.states.world_size = 2;
  o.gloo_staging = o.gloo_reduce_scatter = false;
  plan::TimeInputs in;
  in.overlap = true;
  in.shard.all_gather = {0, 4e6};  // the unit's 4 MB gather output: 1 s
  for (double compute : {3.0, 0.25}) {
    for (auto& m : in.compute.block)
      m = {compute, compute};
    const auto p = plan::predict_step_time(units, o, in, 0);
    EXPECT_EQ(p.all_gather_bytes, 2 * 4000000 + 40) << compute;  // block twice, root once
    const double block_exposed = 2 * std::max(0.0, 1.0 - compute);
    EXPECT_NEAR(p.all_gather_exposed_s, block_exposed + 40 / 4e6, 1e-9) << compute;
  }
}

// The machine profile's cache: written atomically and read back equal; a profile of another
// machine (key) is not used; a damaged file is one error naming the file and the figure.
TEST(PlanMachineProfile, RoundTripsAndRejectsDamagedFiles) {
  namespace plan = fsdp::plan;
  namespace fs = std::filesystem;
  const auto dir = fs::temp_directory_path() / ("fsdp-profile-" + std::to_string(getpid()));
  fs::remove_all(dir);
  const auto key = plan::machine_key();
  EXPECT_NE(key.find(" cores | "), std::string::npos) << key;
  const auto path = plan::machine_profile_path(dir.string(), key);
  EXPECT_EQ(plan::load_machine_profile(path, key), std::nullopt);  // none yet
  plan::MachineProfile p;
  p.key = key;
  p.measured_at = "2026-11-26T00:00:00Z";
  p.matmul = {{"fp32", 1, 1.5e11}, {"bf16", 2, 8.9e11}};
  p.gloo[2] = {{1e-4, 3e9}, {2e-4, 1.4e9}, {3e-4, 2.7e9}};
  p.memcpy_bytes_per_s = 4e10;
  p.disk = plan::measure_disk(dir.string(), int64_t{8} << 20);
  EXPECT_GT(p.disk.read_bytes_per_s, 0);
  EXPECT_GT(p.disk.write_bytes_per_s, 0);
  EXPECT_GT(plan::measure_memcpy(int64_t{1} << 20), 0);
  plan::save_machine_profile(p, path);
  const auto back = plan::load_machine_profile(path, key);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->matmul_flops("bf16", 2), 8.9e11);
  EXPECT_EQ(back->matmul_flops("bf16", 1), 0);
  EXPECT_EQ(back->gloo.at(2).reduce_scatter.bytes_per_s, 1.4e9);
  EXPECT_EQ(back->disk.read_bytes_per_s, p.disk.read_bytes_per_s);
  EXPECT_EQ(plan::load_machine_profile(path, key + " elsewhere"), std::nullopt);
  std::string text;
  {
    std::ifstream in(path);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto damaged = [&](const std::string& content, const std::string& names) {
    std::ofstream(path, std::ios::trunc) << content;
    try {
      plan::load_machine_profile(path, key);
      ADD_FAILURE() << "accepted: " << content.substr(0, 80);
    } catch (const std::runtime_error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(path), std::string::npos) << what;
      EXPECT_NE(what.find(names), std::string::npos) << what;
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    }
  };
  damaged(text.substr(0, text.size() / 2), "not a JSON object");
  auto negative = text;
  negative.replace(negative.find("\"memcpy_bytes_per_s\": "), 22, "\"memcpy_bytes_per_s\": -");
  damaged(negative, "'memcpy_bytes_per_s'");
  auto no_gloo = text;
  no_gloo.replace(no_gloo.find("\"gloo\""), 6, "\"glue\"");
  damaged(no_gloo, "'gloo' missing");
  fs::remove_all(dir);
}
