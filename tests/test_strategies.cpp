// The memory-versus-communication knobs: every sharding strategy, hybrid sharding on a 2x2
// mesh, reshard-after-forward to a block, prefetch (implicit, explicit, limited), and a mix of
// strategies across units. Each must (1) train exactly like one process, (2) send exactly the
// analytic collectives, and (3) order memory as the FSDP paper says.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>

#include <map>
#include <set>

#include "engine/param_group.h"
#include "engine/prefetch.h"
#include "engine/registry.h"
#include "engine/root_state.h"
#include "gpt.h"
#include "harness/multiprocess.h"
#include "harness/sharding.h"

namespace {

using fsdp::BackwardPrefetch;
using fsdp::ShardingStrategy;
using fsdp_models::GPT;
using fsdp_models::GPTConfig;

constexpr int kSteps = 4;
constexpr int64_t kGlobalBatch = 12;  // divisible by 1..4 ranks
// Same reasons as test_equivalence.cpp: lr 1e-3, eps 1e-6 keep AdamW's rounding
// amplification inside the fp32 tolerance; SGD catches a sum that should be a mean.
constexpr double kAdamLr = 1e-3, kAdamEps = 1e-6, kSgdLr = 0.5;
int64_t default_bucket_bytes() {
  return fsdp::FullyShardOptions(nullptr).all_gather_bucket_bytes();
}

struct UnitSpec {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int hybrid_shard_size = 0;
  int reshard_after_forward_size = 0;
};

struct Spec {
  std::string name;
  std::vector<UnitSpec> units;  // one per block, then the root; a single entry applies to all
  bool forward_prefetch = true;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kBackwardPre;
  int max_inflight = 2;
  int explicit_ahead = 0;  // > 0: explicit prefetch lists of this many units ahead
  std::string optimizer = "adamw";
  int n_layer = 3;
  int micro_batches = 1;  // gradient accumulation over this many micro-batches per step
  bool no_sync = false;   // ...communicating only on the last one
  int64_t all_gather_bucket_bytes = default_bucket_bytes();

  const UnitSpec& unit(size_t i) const { return units.size() == 1 ? units[0] : units.at(i); }
};

GPTConfig config_for(const Spec& spec) {
  auto cfg = GPTConfig::preset("gpt2-test");  // sizes 2, 3, 4 do not divide
  cfg.attn_bias = false;
  cfg.n_layer = spec.n_layer;
  return cfg;
}

torch::Tensor batch_tokens(const GPTConfig& cfg, int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2000 + step);
  return torch::randint(cfg.vocab_size, {kGlobalBatch, cfg.block_size + 1}, gen,
                        torch::TensorOptions().dtype(torch::kLong));
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind,
                                                        std::vector<torch::Tensor> params) {
  if (kind == "adamw") {
    return std::make_unique<torch::optim::AdamW>(
        std::move(params), torch::optim::AdamWOptions(kAdamLr).weight_decay(0.1).eps(kAdamEps));
  }
  return std::make_unique<torch::optim::SGD>(std::move(params),
                                             torch::optim::SGDOptions(kSgdLr).momentum(0.9));
}

fsdp::FullyShardOptions options_for(const Spec& spec, size_t unit,
                                    const std::shared_ptr<fsdp::ProcessGroup>& pg) {
  const auto& u = spec.unit(unit);
  return fsdp::FullyShardOptions(pg)
      .strategy(u.strategy)
      .hybrid_shard_size(u.hybrid_shard_size)
      .reshard_after_forward_size(u.reshard_after_forward_size)
      .forward_prefetch(spec.forward_prefetch)
      .backward_prefetch(spec.backward_prefetch)
      .max_inflight_all_gathers(spec.max_inflight)
      .all_gather_bucket_bytes(spec.all_gather_bucket_bytes);
}

void parallelize(GPT& model, const Spec& spec, const std::shared_ptr<fsdp::ProcessGroup>& pg) {
  const size_t n = model->blocks.size();
  for (size_t i = 0; i < n; ++i)
    fsdp::fully_shard(model->blocks[i], options_for(spec, i, pg));
  fsdp::fully_shard(model, options_for(spec, n, pg));
  if (spec.explicit_ahead > 0) {
    for (size_t i = 0; i < n; ++i) {
      std::vector<std::shared_ptr<torch::nn::Module>> fwd, bwd;
      for (int k = 1; k <= spec.explicit_ahead; ++k) {
        if (i + k < n)
          fwd.push_back(model->blocks[i + k].ptr());
        if (i >= static_cast<size_t>(k))
          bwd.push_back(model->blocks[i - k].ptr());
      }
      fsdp::set_modules_to_forward_prefetch(*model->blocks[i], fwd);
      fsdp::set_modules_to_backward_prefetch(*model->blocks[i], bwd);
    }
  }
}

// The collectives one step must issue, per process group, from the parameter shapes alone.
struct Expected {
  fsdp::CollectiveCounter all_gather, reduce_scatter, all_reduce;
};

int64_t unsharded_padded_bytes(const std::vector<torch::Tensor>& params, int n) {
  int64_t b = 0;
  for (const auto& p : params) {
    const int64_t d0 = p.dim() == 0 ? 1 : p.size(0);
    const int64_t row = d0 == 0 ? 0 : p.numel() / d0;
    b += (d0 + n - 1) / n * n * row * p.element_size();
  }
  return b;
}

std::map<fsdp::ProcessGroup*, Expected> expected_per_step(
    const Spec& spec, GPT& reference, const std::shared_ptr<fsdp::ProcessGroup>& pg) {
  std::map<fsdp::ProcessGroup*, Expected> out;
  const size_t n_blocks = reference->blocks.size();
  // The root owns what the blocks do not.
  std::vector<torch::Tensor> root_params;
  {
    std::set<const void*> in_blocks;
    for (auto& b : reference->blocks)
      for (auto& p : b->parameters())
        in_blocks.insert(p.unsafeGetTensorImpl());
    for (auto& p : reference->parameters())
      if (!in_blocks.count(p.unsafeGetTensorImpl()))
        root_params.push_back(p);
  }
  for (size_t i = 0; i <= n_blocks; ++i) {
    const bool root = i == n_blocks;
    const auto params = root ? root_params : reference->blocks[i]->parameters();
    const auto& u = spec.unit(i);
    std::shared_ptr<fsdp::ProcessGroup> shard, replicate, post;
    switch (u.strategy) {
      case ShardingStrategy::kFullShard:
      case ShardingStrategy::kShardGradOp:
        shard = pg;
        break;
      case ShardingStrategy::kNoShard:
        replicate = pg;
        break;
      case ShardingStrategy::kHybridShard:
        // Cached by fully_shard already: no collective here.
        shard = pg->block_group(u.hybrid_shard_size);
        replicate = pg->strided_group(u.hybrid_shard_size);
        break;
    }
    const bool reshards = !root && (u.strategy == ShardingStrategy::kFullShard ||
                                    u.strategy == ShardingStrategy::kHybridShard);
    if (reshards && u.reshard_after_forward_size > 1 &&
        u.reshard_after_forward_size < shard->size()) {
      post = shard->block_group(u.reshard_after_forward_size);
    }
    const int n = shard ? shard->size() : 1;
    const int64_t unsharded = unsharded_padded_bytes(params, n);
    const int64_t flag_bytes = static_cast<int64_t>(params.size()) * 4;
    if (n > 1) {
      auto& fwd = out[shard.get()].all_gather;
      fwd.calls += 1, fwd.bytes += unsharded;
      if (reshards) {
        auto& bwd = out[post ? post.get() : shard.get()].all_gather;
        bwd.calls += 1, bwd.bytes += unsharded;
      }
      auto& rs = out[shard.get()].reduce_scatter;
      // Plus one gradient flag per parameter in each rank's block (ParamGroup::PendingReduce).
      rs.calls += 1, rs.bytes += unsharded + n * flag_bytes;
    }
    if (replicate && replicate->size() > 1) {
      auto& ar = out[replicate.get()].all_reduce;
      // One bucket (the units are < 25 MiB): this rank's shards and the flags.
      ar.calls += 1, ar.bytes += unsharded / n + flag_bytes;
    }
  }
  return out;
}

std::vector<std::shared_ptr<fsdp::ProcessGroup>> all_groups(
    const std::shared_ptr<fsdp::ProcessGroup>& pg) {
  std::vector<std::shared_ptr<fsdp::ProcessGroup>> out{pg};
  for (const auto& unit : fsdp::detail::live_units()) {
    for (const auto& g :
         {unit->groups().shard, unit->groups().replicate, unit->groups().post_forward}) {
      if (g && std::find(out.begin(), out.end(), g) == out.end())
        out.push_back(g);
    }
  }
  return out;
}

int check_spec(const Spec& spec) {
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), world = pg->size();
  auto cfg = config_for(spec);
  torch::manual_seed(77);
  GPT reference(cfg);
  torch::manual_seed(77 + 13 * rank);  // sync_module_states must overwrite this
  GPT model(cfg);
  parallelize(model, spec, pg);

  const int64_t local = kGlobalBatch / world;
  auto opt = make_optimizer(spec.optimizer, model->parameters());
  for (auto& g : all_groups(pg))
    g->comm_stats().reset();
  auto& prefetcher = fsdp::detail::find_unit(*model)->state().prefetcher();
  prefetcher.reset_high_water();
  fsdp::StepProfiler profiler(model.ptr());
  const int micro = spec.micro_batches;
  for (int step = 0; step < kSteps; ++step) {
    auto tokens = batch_tokens(cfg, step).narrow(0, rank * local, local);
    profiler.begin_step();
    opt->zero_grad();
    for (int m = 0; m < micro; ++m) {
      if (spec.no_sync)
        fsdp::set_requires_gradient_sync(*model, m == micro - 1);
      auto mb = tokens.narrow(0, m * (local / micro), local / micro);
      torch::Tensor loss;
      {
        auto scope = profiler.forward();
        loss = fsdp_models::lm_loss(fsdp::forward(model, mb.narrow(1, 0, cfg.block_size)),
                                    mb.narrow(1, 1, cfg.block_size)) /
               micro;
      }
      auto scope = profiler.backward();
      loss.backward();
    }
    {
      auto scope = profiler.optimizer();
      opt->step();
    }
    const fsdp::StepBreakdown b = profiler.end_step();
    // The breakdown's counters are the step's collectives on every group of the model
    // (checked in total against the per-group counts below); where its time goes is
    // test_step_profiler.cpp's subject.
    const fsdp::CommStats total = fsdp::comm_stats(*model);
    WORKER_CHECK(b.comm.all_gather.calls * (step + 1) == total.all_gather.calls &&
                 b.comm.reduce_scatter.bytes * (step + 1) == total.reduce_scatter.bytes &&
                 b.comm.all_reduce.bytes * (step + 1) == total.all_reduce.bytes)
        << "step " << step << " breakdown counters:\n"
        << b.comm.to_string() << "\nmodel totals:\n"
        << total.to_string();
  }
  auto ref_opt = make_optimizer(spec.optimizer, reference->parameters());
  for (int step = 0; step < kSteps; ++step) {
    auto tokens = batch_tokens(cfg, step);
    ref_opt->zero_grad();
    fsdp_models::lm_loss(reference->forward(tokens.narrow(1, 0, cfg.block_size)),
                         tokens.narrow(1, 1, cfg.block_size))
        .backward();
    ref_opt->step();
  }

  // (1) Parameters: each unit holds its shard-group rank's rows (everything when unsharded).
  auto ref_params = reference->named_parameters();
  double max_diff = 0;
  for (const auto& item : model->named_parameters()) {
    auto unit = fsdp::detail::unit_of_param(item.value().unsafeGetTensorImpl());
    WORKER_CHECK(unit) << item.key() << " belongs to no unit";
    const auto& shard = unit->groups().shard;
    auto want = fsdp::test::expected_shard(ref_params[item.key()], shard ? shard->rank() : 0,
                                           shard ? shard->size() : 1);
    if (!shard)
      want = ref_params[item.key()];
    WORKER_CHECK(item.value().sizes() == want.sizes())
        << item.key() << " holds " << item.value().sizes() << ", expected " << want.sizes();
    WORKER_EXPECT_CLOSE(item.value(), want, 1e-5, 1e-6);
    if (want.numel() > 0)
      max_diff = std::max(max_diff, (item.value() - want).abs().max().item<double>());
  }

  // (2) Communication: exactly the analytic calls and bytes on every group.
  auto expected = expected_per_step(spec, reference, pg);
  for (const auto& g : all_groups(pg)) {
    const auto& got = g->comm_stats();
    const Expected want = expected.count(g.get()) ? expected[g.get()] : Expected{};
    auto check = [&](const char* kind, const fsdp::CollectiveCounter& c,
                     const fsdp::CollectiveCounter& w) {
      WORKER_CHECK(c.calls == kSteps * w.calls && c.bytes == kSteps * w.bytes)
          << spec.name << ": " << kind << " on a group of " << g->size() << " ranks: " << c.calls
          << " calls / " << c.bytes << " B in " << kSteps << " steps, expected " << kSteps * w.calls
          << " / " << kSteps * w.bytes;
    };
    // Every micro-batch gathers; gradients travel every micro-batch, or once with no_sync.
    const int grad_syncs = spec.no_sync ? 1 : spec.micro_batches;
    auto times = [](fsdp::CollectiveCounter c, int k) {
      c.calls *= k, c.bytes *= k;
      return c;
    };
    check("all-gather", got.all_gather, times(want.all_gather, spec.micro_batches));
    check("reduce-scatter", got.reduce_scatter, times(want.reduce_scatter, grad_syncs));
    check("all-reduce", got.all_reduce, times(want.all_reduce, grad_syncs));
  }
  // (3) The rate limiter held: never more units in the gather pipeline than allowed.
  const int high_water = prefetcher.slots_high_water();
  WORKER_CHECK(high_water <= spec.max_inflight)
      << high_water << " gathers in flight with a limit of " << spec.max_inflight;
  // Everything is sharded again between steps.
  for (const auto& unit : fsdp::detail::live_units()) {
    WORKER_CHECK(unit->sharded_state() == fsdp::detail::ShardedState::kSharded ||
                 unit->shard_size() == 1)
        << unit->name() << " still gathered after the step";
  }
  std::printf("[rank %d/%d] %s OK: %d %s steps, max |fsdp - reference| = %.3g, in-flight <= %d\n",
              rank, world, spec.name.c_str(), kSteps, spec.optimizer.c_str(), max_diff, high_water);
  return 0;
}

UnitSpec full() {
  return {};
}
UnitSpec sgo() {
  return {ShardingStrategy::kShardGradOp};
}
UnitSpec no_shard() {
  return {ShardingStrategy::kNoShard};
}
UnitSpec hybrid(int s, int reshard_to = 0) {
  return {ShardingStrategy::kHybridShard, s, reshard_to};
}
UnitSpec full_to(int k) {
  return {ShardingStrategy::kFullShard, 0, k};
}

Spec prefetch_off(Spec s) {
  s.forward_prefetch = false;
  s.backward_prefetch = BackwardPrefetch::kNone;
  return s;
}

FSDP_WORKER(strategy_equivalence) {
  const std::string which = ctx.env("FSDP_SPEC");
  const std::string opt = ctx.env("FSDP_OPT", "adamw");
  Spec s;
  s.optimizer = opt;
  if (which == "full_prefetch_off") {
    s = prefetch_off(s), s.units = {full()};
  } else if (which == "full_backward_post") {
    s.units = {full()}, s.backward_prefetch = BackwardPrefetch::kBackwardPost;
  } else if (which == "full_explicit") {
    s.units = {full()}, s.n_layer = 4, s.explicit_ahead = 2, s.max_inflight = 3;
    s.all_gather_bucket_bytes = 1000;  // cuts inside parameters, several calls per unit
  } else if (which == "full_limit1") {
    s.units = {full()}, s.n_layer = 4, s.explicit_ahead = 2, s.max_inflight = 1;
  } else if (which == "shard_grad_op") {
    s.units = {sgo()};
  } else if (which == "no_shard") {
    s.units = {no_shard()};
  } else if (which == "hybrid") {
    s.units = {hybrid(2)};
  } else if (which == "reshard_to_2") {
    s.units = {full_to(2)};
  } else if (which == "hybrid_reshard_to") {
    s.units = {hybrid(4, 2)};
  } else if (which == "no_shard_accumulate") {
    s.units = {no_shard()}, s.micro_batches = 2;
  } else if (which == "no_shard_no_sync") {
    s.units = {no_shard()}, s.micro_batches = 2, s.no_sync = true;
  } else if (which == "hybrid_accumulate") {
    s.units = {hybrid(2)}, s.micro_batches = 3;
  } else if (which == "hybrid_no_sync") {
    s.units = {hybrid(2)}, s.micro_batches = 3, s.no_sync = true;
  } else if (which == "mixed3") {
    s.units = {no_shard(), full(), sgo(), full()};
  } else if (which == "mixed4") {
    s.units = {sgo(), hybrid(2), full_to(2), no_shard()};
  } else {
    WORKER_CHECK(false) << "unknown FSDP_SPEC '" << which << "'";
  }
  s.name = which;
  return check_spec(s);
}

fsdp::test::RunResult run_spec(const std::string& spec, int world,
                               const std::string& optimizer = "adamw") {
  fsdp::test::RunOptions opts;
  opts.env = {{"FSDP_SPEC", spec}, {"FSDP_OPT", optimizer}};
  return fsdp::test::run_workers("strategy_equivalence", world, opts);
}

TEST(Strategies, FullShardWithoutPrefetch) {
  EXPECT_WORKERS_OK(run_spec("full_prefetch_off", 3));
}
TEST(Strategies, FullShardBackwardPrefetchAfterReduceScatter) {
  EXPECT_WORKERS_OK(run_spec("full_backward_post", 3));
}
TEST(Strategies, ExplicitPrefetchTwoAheadWithLimit3) {
  EXPECT_WORKERS_OK(run_spec("full_explicit", 3));
}
TEST(Strategies, ExplicitPrefetchTwoAheadWithLimit1) {
  EXPECT_WORKERS_OK(run_spec("full_limit1", 3));
}
TEST(Strategies, ShardGradOp) {
  EXPECT_WORKERS_OK(run_spec("shard_grad_op", 3));
}
TEST(Strategies, NoShardIsDataParallel) {
  EXPECT_WORKERS_OK(run_spec("no_shard", 3));
  EXPECT_WORKERS_OK(run_spec("no_shard", 3, "sgd"));
}
TEST(Strategies, HybridShard2x2) {
  EXPECT_WORKERS_OK(run_spec("hybrid", 4));
  EXPECT_WORKERS_OK(run_spec("hybrid", 4, "sgd"));
}
TEST(Strategies, ReshardAfterForwardToBlockOf2) {
  EXPECT_WORKERS_OK(run_spec("reshard_to_2", 4));
}
TEST(Strategies, HybridOfOneBlockReshardingToBlocksOf2) {
  EXPECT_WORKERS_OK(run_spec("hybrid_reshard_to", 4));
}
// Both accumulation modes under the replicated strategies (FULL_SHARD's are in
// test_equivalence.cpp): equal to one step on the whole batch, with gradient traffic every
// micro-batch or once per step.
TEST(Strategies, NoShardAccumulationBothModes) {
  EXPECT_WORKERS_OK(run_spec("no_shard_accumulate", 3, "sgd"));
  EXPECT_WORKERS_OK(run_spec("no_shard_no_sync", 3, "sgd"));
}
TEST(Strategies, HybridAccumulationBothModes) {
  EXPECT_WORKERS_OK(run_spec("hybrid_accumulate", 4, "sgd"));
  EXPECT_WORKERS_OK(run_spec("hybrid_no_sync", 4, "sgd"));
}
TEST(Strategies, MixedStrategiesAcrossUnits) {
  EXPECT_WORKERS_OK(run_spec("mixed3", 3));
  EXPECT_WORKERS_OK(run_spec("mixed4", 4, "sgd"));
}

// Peak memory per rank of one training step (after two warm-up steps that create the
// optimizer state and record the unit order), under each knob setting, on one model.
constexpr int64_t kMemoryBucketBytes = 16 << 10;

FSDP_WORKER(strategy_memory) {
  fsdp::memory::install_tracking_allocator();
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), world = pg->size();
  // Parameters dominate activations (tiny batch), so what the knobs keep gathered shows.
  GPTConfig cfg;
  // Ten blocks: what shard_grad_op holds between forward and backward grows with depth, what
  // full_shard holds does not, so their order is clear of timing noise.
  cfg.vocab_size = 301, cfg.block_size = 8, cfg.n_layer = 10, cfg.n_head = 2, cfg.n_embd = 70;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5 + rank);
  auto tokens = torch::randint(cfg.vocab_size, {1, cfg.block_size + 1}, gen,
                               torch::TensorOptions().dtype(torch::kLong));
  int64_t block_bytes = 0;
  auto measure = [&](Spec spec) {
    spec.n_layer = cfg.n_layer;
    // Buckets much smaller than a block: Gloo's staging buffers (1 + 1/N of each call) then
    // stay a small fraction of a block, and what the knobs keep gathered is what shows.
    spec.all_gather_bucket_bytes = kMemoryBucketBytes;
    // The registry drops the units of dead modules (and their shards) when it is next used.
    fsdp::detail::live_units();
    const int64_t baseline = fsdp::memory::current_bytes();
    int64_t peak = 0;
    {
      torch::manual_seed(0);
      GPT model(cfg);
      parallelize(model, spec, pg);
      for (const auto& unit : fsdp::detail::live_units()) {
        if (unit->name().find("GPT") == std::string::npos)
          block_bytes = std::max(block_bytes, unit->unsharded_bytes());
      }
      torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
      auto step = [&] {
        opt.zero_grad();
        fsdp_models::lm_loss(fsdp::forward(model, tokens.narrow(1, 0, cfg.block_size)),
                             tokens.narrow(1, 1, cfg.block_size))
            .backward();
        opt.step();
      };
      step();
      step();
      fsdp::memory::reset_peak();
      step();
      peak = fsdp::memory::peak_bytes() - baseline;
    }
    return peak;
  };
  Spec base;
  base.units = {full()};
  Spec off = prefetch_off(base);
  Spec sgo_spec = base;
  sgo_spec.units = {sgo()};
  Spec ddp = base;
  ddp.units = {no_shard()};
  auto ahead = [&](int limit) {
    Spec s = base;
    s.explicit_ahead = 2, s.max_inflight = limit;
    return s;
  };
  const int64_t p_off = measure(off), p_full = measure(base), p_sgo = measure(sgo_spec),
                p_ddp = measure(ddp), p_k1 = measure(ahead(1)), p_k2 = measure(ahead(2)),
                p_k3 = measure(ahead(3));
  // The paper's ordering.
  WORKER_CHECK(p_full < p_sgo && p_sgo < p_ddp)
      << "expected full_shard < shard_grad_op < no_shard: " << p_full << ", " << p_sgo << ", "
      << p_ddp;
  // Prefetching one unit ahead costs one more unit gathered, plus, while its gather is in
  // flight, Gloo's staging of the buckets in flight (2 worker threads, (1 + 1/N) each).
  const int64_t slack = block_bytes / 10 + 16384;
  const int64_t staging = 3 * kMemoryBucketBytes;
  WORKER_CHECK(p_full <= p_off + block_bytes + staging + slack)
      << "prefetch raised the peak by " << p_full - p_off << " B, one block is " << block_bytes;
  // The limiter bounds what prefetching two ahead may hold: each slot is about one unit.
  WORKER_CHECK(p_k1 <= p_k2 + slack && p_k2 <= p_k3 + slack)
      << "peaks by limit: " << p_k1 << ", " << p_k2 << ", " << p_k3;
  WORKER_CHECK(p_k3 >= p_k1 + block_bytes - slack)
      << "limit 3 should hold about two more blocks than limit 1: " << p_k3 << " vs " << p_k1;
  WORKER_CHECK(p_k1 <= p_off + slack)
      << "limit 1 keeps one block gathered at a time: " << p_k1 << " vs no prefetch " << p_off;
  std::printf(
      "[rank %d/%d] MEMORY ORDER OK, peak bytes: full_shard %lld (prefetch off %lld), "
      "shard_grad_op %lld, "
      "no_shard %lld; 2-ahead prefetch with limit 1/2/3: %lld / %lld / %lld; one block "
      "unsharded %lld (prefetch: %+.2f blocks, limit 3 vs 1: %+.2f blocks)\n",
      rank, world, (long long)p_full, (long long)p_off, (long long)p_sgo, (long long)p_ddp,
      (long long)p_k1, (long long)p_k2, (long long)p_k3, (long long)block_bytes,
      double(p_full - p_off) / block_bytes, double(p_k3 - p_k1) / block_bytes);
  return 0;
}

TEST(Strategies, PeakMemoryOrderingPrefetchAndLimiter) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("strategy_memory", 2));
}

}  // namespace
