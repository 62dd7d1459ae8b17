// Tensor parallelism (models/tensor_parallel.h, fsdp/tensor_parallel/): each layer split over a
// tensor-parallel group, alone and with FSDP over the data-parallel axis of a 2-D mesh, must
// train like one process: the same losses (fp32, within 1e-5 per step) and the same parameters
// (within 1e-4 after 10 AdamW steps, the gradients clipped by their norm over both axes of the
// mesh, equal to one process's within 1e-5), on vocabularies, widths and head counts the group's
// size does not all divide. The reference is trained in each rank's own process on the whole batch;
// at the end it is split the same way, so each rank compares its parts with the reference's.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <string>
#include <vector>

#include <fsdp/checkpoint/safetensors.h>

#include "gpt.h"
#include "harness/command.h"
#include "harness/multiprocess.h"
#include "harness/python_ranks.h"
#include "harness/sharding.h"
#include "harness/tp_configs.h"
#include "llama.h"
#include "lora.h"
#include "tensor_parallel.h"

namespace {

using fsdp_models::GPT;
using fsdp_models::GPTConfig;
using fsdp_models::Llama;
using fsdp_models::LlamaConfig;

// Five steps through each loss path (fused and gathered); 20 steps cost the suite 6 CPU-seconds
// more over these 13 tests and differed no more (docs/tensor_parallel.md).
constexpr int kSteps = 10;
constexpr double kMaxNorm = 0.5;  // below most steps' norms: the clipping scales them

double value(const torch::Tensor& t) {
  return t.item<double>();
}

// Step `step`'s sequences of seq + 1 tokens: the same on every rank.
torch::Tensor batch_tokens(int step, int64_t vocab, int64_t batch, int64_t seq) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  return torch::randint(vocab, {batch, seq + 1}, gen, torch::TensorOptions().dtype(torch::kLong));
}
constexpr int64_t kPerRank = 2;  // sequences per data-parallel rank

GPTConfig gpt_config(int tp) {
  auto cfg = GPTConfig::preset("gpt2-test");  // vocab 67, width 22: 2, 3 and 4 do not divide
  cfg.attn_bias = true;
  if (tp == 4)
    cfg.n_head = 4, cfg.n_embd = 24;  // the heads must divide; 67 words still do not
  return cfg;
}

LlamaConfig llama_config() {
  return fsdp::test::tp_llama_config();
}

// The initial weights under the model's own names (init.safetensors) and every step's batch
// (tokens.bin, int64 [steps, batch, seq + 1], described by tokens.json), as train_and_compare
// draws them.
void export_start(const std::string& dir, torch::nn::Module& model, int64_t vocab, int64_t batch,
                  int64_t seq) {
  std::vector<fsdp::safetensors::TensorSpec> specs;
  const auto params = model.named_parameters();
  for (const auto& p : params)
    specs.push_back({p.key(), p.value().scalar_type(), p.value().sizes().vec()});
  fsdp::safetensors::Writer w(dir + "/init.safetensors", specs);
  for (const auto& p : params)
    w.write(p.key(), p.value().detach());
  w.finish();
  std::ofstream bin(dir + "/tokens.bin", std::ios::binary);
  for (int step = 0; step < kSteps; ++step) {
    const auto t = batch_tokens(step, vocab, batch, seq);
    bin.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
  }
  std::ofstream(dir + "/tokens.json")
      << "{\"steps\": " << kSteps << ", \"batch\": " << batch << ", \"seq\": " << seq << "}\n";
}

// The worker: FSDP_MODEL (gpt | llama) split over FSDP_TP ranks, FSDP over the world / FSDP_TP
// data-parallel ranks (none when 1). Even steps take the fused loss (vocabulary-parallel
// cross-entropy), odd steps the gathered logits and lm_loss.
template <typename Model, typename Config>
int train_and_compare(
    const fsdp::test::WorkerContext& ctx, const Config& cfg, int64_t seq,
    fsdp::TensorParallelLayout (*split)(Model&, const std::shared_ptr<fsdp::ProcessGroup>&),
    void (*shard)(Model&, const fsdp::FullyShardOptions&), void (*prepare)(Model&) = nullptr,
    double max_norm = kMaxNorm) {
  auto pg = fsdp::init_process_group();
  const int tp = static_cast<int>(ctx.env_int("FSDP_TP", pg->size()));
  const auto mesh = fsdp::make_device_mesh(*pg, tp);
  const int dp = mesh.dp->size();
  torch::manual_seed(11);
  Model model(cfg);
  torch::manual_seed(11);
  Model reference(cfg);
  if (prepare)
    prepare(model), prepare(reference);
  // FSDP_EXPORT_DIR: rank 0 writes the initial weights, the batches and the losses there, for
  // PyTorch's run of the same (tests/python/check_tp.py).
  const std::string exported = ctx.env("FSDP_EXPORT_DIR", "");
  if (!exported.empty() && ctx.rank == 0)
    export_start(exported, *model, cfg.vocab_size, dp * kPerRank, seq);
  std::ostringstream losses;
  split(model, mesh.tp);
  const bool sequence_parallel = ctx.env("FSDP_SP", "") == "1";
  if (sequence_parallel)
    model->use_sequence_parallel(mesh.tp);
  if (dp > 1)
    shard(model, fsdp::FullyShardOptions(mesh.dp));
  auto adamw = [](std::vector<torch::Tensor> p) {
    return torch::optim::AdamW(std::move(p),
                               torch::optim::AdamWOptions(1e-3).weight_decay(0.1).eps(1e-6));
  };
  auto opt = adamw(model->parameters());
  auto opt_ref = adamw(reference->parameters());
  const auto split_params = fsdp_models::tensor_parallel_params(*model, tp);
  double worst_loss = 0;
  int clipped = 0;
  for (int step = 0; step < kSteps; ++step) {
    const auto tokens = batch_tokens(step, cfg.vocab_size, dp * kPerRank, seq);
    const auto x = tokens.narrow(1, 0, seq), y = tokens.narrow(1, 1, seq);
    const bool fused = step % 2 == 0;
    auto loss_of = [&](Model& m, const torch::Tensor& xs, const torch::Tensor& ys) {
      if (fused) {
        fsdp_models::LossSpec spec;
        spec.targets = ys;
        spec.denominator = static_cast<double>(ys.numel());
        spec.chunk = 7;  // several chunks, the last one short
        return fsdp::forward(m, xs, spec);
      }
      return fsdp_models::lm_loss(fsdp::forward(m, xs), ys);
    };
    opt.zero_grad();
    const int64_t first = mesh.dp_rank() * kPerRank;
    auto loss = loss_of(model, x.narrow(0, first, kPerRank), y.narrow(0, first, kPerRank));
    loss.backward();
    // Clipped by the norm over both axes: split parts counted once each, whole ones once.
    const double norm = fsdp::clip_grad_norm_(model->parameters(), max_norm, *pg, split_params);
    opt.step();
    opt_ref.zero_grad();
    auto loss_ref = loss_of(reference, x, y);
    loss_ref.backward();
    const double norm_ref = torch::nn::utils::clip_grad_norm_(reference->parameters(), max_norm);
    clipped += norm_ref > max_norm;
    opt_ref.step();
    WORKER_CHECK(std::abs(norm - norm_ref) <= 1e-5 * norm_ref)
        << "step " << step << ": gradient norm " << norm << " against one process's " << norm_ref;
    auto mean = loss.detach().reshape({1}).clone();
    fsdp::all_reduce(*mesh.dp, mean, fsdp::ReduceOp::kAvg)->wait();
    const double diff = std::abs(value(mean) - value(loss_ref));
    worst_loss = std::max(worst_loss, diff);
    losses << std::setprecision(9) << value(mean) << "\n";
    WORKER_CHECK(diff <= 1e-5) << "step " << step << (fused ? " (fused)" : " (logits)") << ": loss "
                               << value(mean) << " against one process's " << value(loss_ref);
  }
  if (sequence_parallel) {
    // A sequence the group's size does not divide (the logits of generation): padded on the
    // right, the same logits as one process's (no backward follows: no grad, so the root unit
    // reshards after it).
    torch::NoGradGuard no_grad;
    const auto x = batch_tokens(kSteps, cfg.vocab_size, 1, seq).narrow(1, 0, seq - 1);
    const torch::Tensor ours = fsdp::forward(model, x);
    const torch::Tensor theirs = reference->forward(x);
    WORKER_CHECK(ours.sizes() == theirs.sizes() &&
                 torch::allclose(ours, theirs, /*rtol=*/1e-4, /*atol=*/1e-5))
        << "logits of " << seq - 1 << " positions differ by " << value((ours - theirs).abs().max());
    // Sampling's forward: the head for the last positions only, after the same padding and
    // gather (fsdp_models::LastLogits).
    const torch::Tensor last = fsdp::forward(model, x, fsdp_models::LastLogits{3});
    WORKER_CHECK(last.sizes() == theirs.narrow(1, seq - 4, 3).sizes() &&
                 torch::allclose(last, theirs.narrow(1, seq - 4, 3), /*rtol=*/1e-4, /*atol=*/1e-5))
        << "the last 3 positions' logits differ";
  }
  // The reference split as the model was: each rank's parts, then its FSDP rows of them.
  split(reference, mesh.tp);
  const auto expected = reference->named_parameters();
  double worst_param = 0;
  for (const auto& s : fsdp::param_shards(*model)) {
    const auto want = fsdp::test::rows_held(expected[s.name], s);
    WORKER_CHECK(want.sizes() == s.shard.sizes())
        << s.name << ": " << s.shard.sizes() << " held, " << want.sizes() << " expected";
    const double d = value((s.shard - want).abs().max());
    worst_param = std::max(worst_param, d);
    WORKER_CHECK(torch::allclose(s.shard, want, /*rtol=*/1e-4, /*atol=*/1e-6))
        << s.name << ": differs from one process's by " << d;
  }
  WORKER_CHECK(clipped >= kSteps / 2) << "only " << clipped << " steps clipped: a test of nothing";
  if (!exported.empty() && ctx.rank == 0)
    std::ofstream(exported + "/losses.txt") << losses.str();
  std::printf(
      "rank %d (dp %d, tp %d%s): TP OK, largest loss difference %.3g, parameter %.3g, %d of %d "
      "steps clipped\n",
      ctx.rank, mesh.dp_rank(), mesh.tp_rank(), sequence_parallel ? ", sequence parallel" : "",
      worst_loss, worst_param, clipped, kSteps);
  return 0;
}

void shard_gpt(GPT& m, const fsdp::FullyShardOptions& o) {
  fsdp_models::parallelize_gpt(m, o);
}
void shard_llama(Llama& m, const fsdp::FullyShardOptions& o) {
  fsdp_models::parallelize_llama(m, o);
}

// LoRA (rank 4, alpha 8) on every Linear of the blocks, the rest frozen: the adapters are split
// with the weights (lora_B on column-parallel layers, lora_A on row-parallel ones) and train as
// in one process (clipped to 0.01: the adapters' gradients are small). PEFT's initialisation,
// except lora_B drawn like lora_A instead of zero, so that every adapter's gradient is non-zero
// from the first step.
void add_adapters(GPT& m) {
  fsdp_models::add_lora(*m, "c_attn|c_proj|c_fc", fsdp_models::LoraOptions().rank(4).alpha(8));
  auto peft = fsdp_models::lora_init_scheme(fsdp_models::gpt_init_scheme(m->config()), *m);
  fsdp_models::init_weights(
      *m,
      [peft](const std::string& fqn) {
        return fqn.find("lora_B") != std::string::npos ? fsdp_models::InitRule::uniform(0.2)
                                                       : peft(fqn);
      },
      3);
}

FSDP_WORKER(tp_gpt_lora) {
  const int tp = static_cast<int>(ctx.env_int("FSDP_TP", ctx.world_size));
  return train_and_compare<GPT>(ctx, gpt_config(tp), 16, &fsdp_models::tensor_parallelize_gpt,
                                &shard_gpt, &add_adapters, /*max_norm=*/0.01);
}

FSDP_WORKER(tp_gpt) {
  const int tp = static_cast<int>(ctx.env_int("FSDP_TP", ctx.world_size));
  return train_and_compare<GPT>(ctx, gpt_config(tp), 16, &fsdp_models::tensor_parallelize_gpt,
                                &shard_gpt);
}

FSDP_WORKER(tp_llama) {
  return train_and_compare<Llama>(ctx, llama_config(), 16, &fsdp_models::tensor_parallelize_llama,
                                  &shard_llama);
}

// The operations alone on 3 ranks (67 words: 23, 23 and 21 each), against the same computation
// in one process: values and gradients.
FSDP_WORKER(tp_ops) {
  auto pg = fsdp::init_process_group();
  const int r = pg->rank(), n = pg->size();
  auto g = std::shared_ptr<fsdp::ProcessGroup>(pg);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat);
  auto close = [](const torch::Tensor& a, const torch::Tensor& b) {
    return torch::allclose(a, b, 1e-5, 1e-6);
  };
  // Cross-entropy over a split vocabulary, two targets ignored.
  const auto shard = fsdp::tp::VocabShard::of(67, r, n);
  WORKER_CHECK(shard.sizes == (std::vector<int64_t>{23, 23, 21})) << shard.size;
  auto logits = torch::randn({10, 67}, gen, f64) * 3;
  auto targets = torch::randint(67, {10}, gen, torch::TensorOptions().dtype(torch::kLong));
  targets[3] = -100, targets[8] = -100;
  auto whole = logits.clone().requires_grad_(true);
  auto want = torch::nn::functional::cross_entropy(
      whole, targets, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
  want.backward();
  auto mine = logits.narrow(1, shard.first, shard.size).clone().requires_grad_(true);
  auto got = fsdp::tp::vocab_parallel_cross_entropy(mine, targets, shard, g).sum();
  got.backward();
  WORKER_CHECK(close(got, want)) << got.item<double>() << " against " << want.item<double>();
  WORKER_CHECK(close(mine.grad(), whole.grad().narrow(1, shard.first, shard.size)))
      << "the logits' gradient";
  // The embedding looked up from a split table.
  auto table = torch::randn({67, 5}, gen, f64);
  auto ids = torch::randint(67, {4, 6}, gen, torch::TensorOptions().dtype(torch::kLong));
  auto rows = table.narrow(0, shard.first, shard.size).clone().requires_grad_(true);
  auto looked = fsdp::tp::vocab_parallel_embedding(rows, ids, shard, g);
  WORKER_CHECK(close(looked, torch::embedding(table, ids))) << "embedding";
  (looked * looked).sum().backward();
  auto full_table = table.clone().requires_grad_(true);
  auto e = torch::embedding(full_table, ids);
  (e * e).sum().backward();
  WORKER_CHECK(close(rows.grad(), full_table.grad().narrow(0, shard.first, shard.size)))
      << "the table's gradient";
  // Sequence parallelism's pair, and the split: rank r's input is whole * (r + 1), its
  // upstream gradient up * (r + 1).
  auto base = torch::randn({2, 6, 4}, gen, f64), up = torch::randn({2, 6, 4}, gen, f64);
  const double k = r + 1, sum_k = n * (n + 1) / 2.0;
  auto piece = [&](const torch::Tensor& t) { return t.chunk(n, 1)[static_cast<size_t>(r)]; };
  auto x = (base * k).requires_grad_(true);
  auto scattered = fsdp::tp::reduce_scatter_to_group(x, 1, g);
  WORKER_CHECK(close(scattered, piece(base) * sum_k)) << "reduce_scatter_to_group";
  scattered.backward(piece(up) * k);
  // d x: every rank's piece of the upstream gradient, gathered: piece j came from rank j.
  std::vector<torch::Tensor> pieces;
  for (int j = 0; j < n; ++j)
    pieces.push_back(up.chunk(n, 1)[static_cast<size_t>(j)] * (j + 1));
  WORKER_CHECK(close(x.grad(), torch::cat(pieces, 1))) << "reduce_scatter_to_group backward";
  auto p = (piece(base) * 1.0).requires_grad_(true);
  auto gathered = fsdp::tp::gather_from_group(p, 1, g);
  WORKER_CHECK(close(gathered, base)) << "gather_from_group";
  gathered.backward(up * k);
  WORKER_CHECK(close(p.grad(), piece(up) * sum_k)) << "gather_from_group backward";
  auto w = base.clone().requires_grad_(true);
  auto split = fsdp::tp::split_to_group(w, 1, g);
  WORKER_CHECK(close(split, piece(base))) << "split_to_group";
  split.backward(piece(up) * k);
  WORKER_CHECK(close(w.grad(), torch::cat(pieces, 1))) << "split_to_group backward";
  // The uneven gather of a split head's logits, and its gradient: this rank's columns.
  auto cols = logits.narrow(1, shard.first, shard.size).clone().requires_grad_(true);
  auto all = fsdp::tp::gather_last_dim(cols, shard.sizes, g);
  WORKER_CHECK(torch::equal(all, logits)) << "gather_last_dim";
  all.backward(logits * 2);
  WORKER_CHECK(torch::equal(cols.grad(), logits.narrow(1, shard.first, shard.size) * 2))
      << "gather_last_dim backward";
  std::printf("rank %d: TP OPS OK\n", r);
  return 0;
}

// One step's tensor-parallel traffic, by the mesh's axes, against what the layout implies: on
// the tp group, forward all-reduces the embedding's rows and each block's two row-parallel
// outputs (B x T x C each), the fused loss two per chunk (the largest logits, then the sums and
// the target logits: 3 values per position); backward all-reduces the input gradients of each
// block's two column-parallel layers and of the head (B x T x C each). Nothing else, and
// nothing on the dp group (of one rank here).
FSDP_WORKER(tp_traffic) {
  auto pg = fsdp::init_process_group();
  const auto mesh = fsdp::make_device_mesh(*pg, pg->size());
  const auto cfg = gpt_config(pg->size());
  torch::manual_seed(11);
  GPT model(cfg);
  fsdp_models::tensor_parallelize_gpt(model, mesh.tp);
  const int64_t b = 2, t = cfg.block_size, c = cfg.n_embd, chunk = 7;
  const auto tokens = batch_tokens(0, cfg.vocab_size, b, t);
  fsdp_models::LossSpec spec;
  spec.targets = tokens.narrow(1, 1, t);
  spec.denominator = static_cast<double>(b * t);
  spec.chunk = chunk;
  const auto before = mesh.tp->comm_stats();
  fsdp::forward(model, tokens.narrow(1, 0, t), spec).backward();
  const auto used = mesh.tp->comm_stats() - before;
  const int64_t positions = b * t, chunks = (positions + chunk - 1) / chunk;
  const int64_t stream = positions * c * 4;  // one (B, T, C) float32 tensor
  const int64_t calls = 1 + 2 * cfg.n_layer + 2 * chunks + 2 * cfg.n_layer + 1;
  const int64_t bytes = (2 + 4 * cfg.n_layer) * stream + 3 * positions * 4;
  WORKER_CHECK(used.all_reduce.calls == calls && used.all_reduce.bytes == bytes)
      << "tp all-reduces: " << used.all_reduce.calls << " of " << used.all_reduce.bytes
      << " B, expected " << calls << " of " << bytes << " B";
  WORKER_CHECK(used.all_gather.calls == 0 && used.reduce_scatter.calls == 0 &&
               used.broadcast.calls == 0)
      << used.to_string();
  WORKER_CHECK(mesh.dp->comm_stats().all_reduce.calls == 0) << mesh.dp->comm_stats().to_string();
  std::printf("rank %d: TP TRAFFIC OK: %lld all-reduces, %lld B per step on tp\n", ctx.rank,
              static_cast<long long>(calls), static_cast<long long>(bytes));
  return 0;
}

// A model split on the meta device and filled shard by shard (tensor_parallel_initializer) is
// the model built whole and then split: every shard bitwise equal, GPT and Llama, at (2, 2).
template <typename Model, typename Config, typename Split, typename Scheme, typename Shard>
int meta_init_equals_eager(const fsdp::test::WorkerContext& ctx, const Config& cfg, Split split,
                           Scheme scheme_of, Shard shard) {
  auto pg = fsdp::init_process_group();
  const auto mesh = fsdp::make_device_mesh(*pg, 2);
  constexpr uint64_t kSeed = 5;
  Model eager(cfg, fsdp_models::ModelInit());
  fsdp_models::init_weights(*eager, scheme_of(cfg), kSeed);
  split(eager, mesh.tp);
  Model meta(cfg, fsdp_models::ModelInit().device(torch::kMeta));
  const auto layout = split(meta, mesh.tp);
  fsdp_models::to_hollow(*meta, torch::TensorOptions().dtype(torch::kFloat32));
  shard(meta, fsdp::FullyShardOptions(mesh.dp).param_init(
                  fsdp_models::tensor_parallel_initializer(*meta, scheme_of(cfg), kSeed, layout)));
  const auto want = eager->named_parameters();
  int compared = 0;
  for (const auto& s : fsdp::param_shards(*meta)) {
    const auto expected = fsdp::test::rows_held(want[s.name], s);
    WORKER_CHECK(expected.sizes() == s.shard.sizes() && torch::equal(expected, s.shard))
        << s.name << ": the shard differs from the eager model's rows";
    ++compared;
  }
  std::printf("rank %d: TP META INIT OK: %d shards bitwise equal\n", ctx.rank, compared);
  return 0;
}

FSDP_WORKER(tp_meta_init) {
  if (ctx.env("FSDP_MODEL") == "llama")
    return meta_init_equals_eager<Llama>(ctx, llama_config(),
                                         &fsdp_models::tensor_parallelize_llama,
                                         &fsdp_models::llama_init_scheme, &shard_llama);
  return meta_init_equals_eager<GPT>(ctx, gpt_config(2), &fsdp_models::tensor_parallelize_gpt,
                                     &fsdp_models::gpt_init_scheme, &shard_gpt);
}

TEST(TensorParallel, AModelSplitOnTheMetaDeviceStartsAsTheWholeModelSplit) {
  for (const char* model : {"gpt", "llama"}) {
    auto r =
        fsdp::test::run_workers("tp_meta_init", 4, fsdp::test::with_env({{"FSDP_MODEL", model}}));
    ASSERT_TRUE(r.ok()) << model << ": " << r.describe();
    std::printf("%s: %s", model, r.evidence().c_str());
  }
}

TEST(TensorParallel, OneStepsTrafficIsWhatTheLayoutImplies) {
  auto r = fsdp::test::run_workers("tp_traffic", 2);
  ASSERT_TRUE(r.ok()) << r.describe();
  std::printf("%s", r.evidence().c_str());
}

TEST(TensorParallel, OperationsEqualOneProcessOnThreeRanks) {
  auto r = fsdp::test::run_workers("tp_ops", 3);
  ASSERT_TRUE(r.ok()) << r.describe();
}

// `sequence_parallel`: the residual stream split along the sequence between the parallel
// regions too, the norms and embeddings on each rank's positions.
void run(const char* worker, int world, int tp, bool sequence_parallel = false) {
  auto r =
      fsdp::test::run_workers(worker, world,
                              fsdp::test::with_env({{"FSDP_TP", std::to_string(tp)},
                                                    {"FSDP_SP", sequence_parallel ? "1" : "0"}}));
  ASSERT_TRUE(r.ok()) << r.describe();
  std::printf("%s", r.evidence().c_str());
}

TEST(TensorParallel, GptOnTwoRanksTrainsLikeOneProcess) {
  run("tp_gpt", 2, 2);
}
TEST(TensorParallel, GptOnFourRanksTrainsLikeOneProcess) {
  run("tp_gpt", 4, 4);
}
TEST(TensorParallel, GptOnATwoByTwoMeshWithFsdpTrainsLikeOneProcess) {
  run("tp_gpt", 4, 2);
}
TEST(TensorParallel, GptWithLoraOnATwoByTwoMeshTrainsLikeOneProcess) {
  run("tp_gpt_lora", 4, 2);
}
TEST(TensorParallel, LlamaWithKvHeadsSplitTrainsLikeOneProcess) {
  run("tp_llama", 2, 2);
}
// Two kv heads on four ranks: kept whole, each rank reading the one its query head uses.
TEST(TensorParallel, LlamaWithKvHeadsKeptWholeTrainsLikeOneProcess) {
  run("tp_llama", 4, 4);
}
TEST(TensorParallel, LlamaOnATwoByTwoMeshWithFsdpTrainsLikeOneProcess) {
  run("tp_llama", 4, 2);
}

TEST(TensorParallel, GptWithSequenceParallelismOnFourRanksTrainsLikeOneProcess) {
  run("tp_gpt", 4, 4, /*sequence_parallel=*/true);
}
TEST(TensorParallel, GptWithSequenceParallelismOnATwoByTwoMeshTrainsLikeOneProcess) {
  run("tp_gpt", 4, 2, /*sequence_parallel=*/true);
}
TEST(TensorParallel, LlamaWithSequenceParallelismOnATwoByTwoMeshTrainsLikeOneProcess) {
  run("tp_llama", 4, 2, /*sequence_parallel=*/true);
}

// Against PyTorch's own composition (tests/python/check_tp.py: init_device_mesh, parallelize_module
// with ColwiseParallel / RowwiseParallel, loss_parallel, fully_shard on dp), on CPU and Gloo,
// (dp, tp) = (2, 2): the same initial weights and batches, the same AdamW and clipping; every
// step's loss within 1e-5 of PyTorch's.
TEST(TensorParallel, LlamaOnATwoByTwoMeshEqualsPyTorchsTensorParallelWithFsdp2) {
  const auto dir = std::filesystem::path(FSDP_TEST_WORK_DIR) / "tp-vs-pytorch";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto ours = fsdp::test::run_workers(
      "tp_llama", 4, fsdp::test::with_env({{"FSDP_TP", "2"}, {"FSDP_EXPORT_DIR", dir.string()}}));
  ASSERT_TRUE(ours.ok()) << ours.describe();
  const auto cfg = llama_config();
  // PyTorch's 4 ranks as torchrun would start them, each a fork of the tests' Python server
  // (harness/python_ranks.h).
  const std::string cmd = fsdp::test::python_ranks_command(
      4, FSDP_PYTHON,
      std::string(FSDP_SOURCE_DIR) + "/tests/python/check_tp.py " + dir.string() +
          " --tp 2 --vocab " + std::to_string(cfg.vocab_size) + " --dim " +
          std::to_string(cfg.dim) + " --layers " + std::to_string(cfg.n_layers) + " --heads " +
          std::to_string(cfg.n_heads) + " --kv-heads " + std::to_string(cfg.n_kv_heads) +
          " --ffn " + std::to_string(cfg.ffn_hidden_dim) + " --max-norm " +
          std::to_string(kMaxNorm),
      "TMPDIR=" + dir.string());
  const auto r = fsdp::test::run_command(cmd);
  ASSERT_EQ(r.code, 0) << cmd << "\n" << r.output;
  auto read = [](const std::filesystem::path& path) {
    std::vector<double> v;
    std::ifstream in(path);
    for (double x; in >> x;)
      v.push_back(x);
    return v;
  };
  const auto mine = read(dir / "losses.txt"), theirs = read(dir / "torch_losses.txt");
  ASSERT_EQ(mine.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(theirs.size(), mine.size());
  double worst = 0;
  for (size_t i = 0; i < mine.size(); ++i) {
    EXPECT_NEAR(mine[i], theirs[i], 1e-5) << "step " << i;
    worst = std::max(worst, std::abs(mine[i] - theirs[i]));
  }
  std::printf("TP VS PYTORCH OK: (dp, tp) = (2, 2), %d steps, largest loss difference %.3g\n",
              kSteps, worst);
  std::filesystem::remove_all(dir);
}

}  // namespace
