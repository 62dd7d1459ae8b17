// The graphs users write, not only ours: frozen units in the gradient path, a unit called
// twice, two losses summed before one backward, outputs that receive no gradient, struct
// inputs and outputs, two FSDP models in one process. Each must train exactly like one
// process (fp32, rtol 1e-5), issue exactly the collectives the rules in param_group.h give,
// and leave every unit sharded after every step.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>

#include <atomic>
#include <map>
#include <optional>

#include "engine/param_group.h"
#include "engine/registry.h"
#include "engine/root_state.h"
#include "harness/inspect.h"
#include "harness/multiprocess.h"
#include "harness/sharding.h"

namespace {

using fsdp::ShardingStrategy;
using fsdp::test::units_holding_unsharded_storage;

constexpr int64_t kIn = 7, kWidth = 13, kOut = 5;  // 13 rows: not divisible by 2 or 3
constexpr int64_t kGlobalBatch = 12;
constexpr int kSteps = 4;

// ---- A model with struct inputs and outputs ---------------------------------------------------

struct BlockIn {
  torch::Tensor h;
  torch::Tensor skip;  // the embedding, fed to every block
  template <typename F>
  void visit_tensors(F&& f) {
    f(h);
    f(skip);
  }
};

struct BlockOut {
  torch::Tensor h;
  std::optional<torch::Tensor> aux;  // from a layer of its own (`side`)
  int64_t block = 0;
  template <typename F>
  void visit_tensors(F&& f) {
    f(h);
    f(aux);
  }
};

// Failure injection: the block with this index throws in its forward / its backward.
std::atomic<int> g_throw_in_forward{-1};
std::atomic<int> g_throw_in_backward{-1};

// Set by the rollback test: the all-gathers issued up to the injected backward failure.
const fsdp::ProcessGroup* g_count_gathers_of = nullptr;
int64_t g_gathers_at_failure = -1;

struct ThrowInBackward : torch::autograd::Function<ThrowInBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g) {
    if (g_count_gathers_of)
      g_gathers_at_failure = g_count_gathers_of->comm_stats().all_gather.calls;
    throw std::runtime_error("injected backward failure");
    return g;
  }
};

// Inside a block's backward: how many units hold unsharded storage at that moment.
std::vector<int>* g_backward_probe = nullptr;

struct Probe : torch::autograd::Function<Probe> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g) {
    if (g_backward_probe)
      g_backward_probe->push_back(units_holding_unsharded_storage());
    return g;
  }
};

struct GBlockImpl : torch::nn::Module {
  GBlockImpl(int index)
      : lin(register_module("lin", torch::nn::Linear(kWidth, kWidth))),
        side(register_module("side", torch::nn::Linear(kWidth, kWidth))),
        index_(index) {}
  BlockOut forward(const BlockIn& in) {
    if (g_throw_in_forward == index_) {
      if (g_count_gathers_of)
        g_gathers_at_failure = g_count_gathers_of->comm_stats().all_gather.calls;
      throw std::runtime_error("injected forward failure");
    }
    auto h = torch::tanh(lin(in.h)) + 0.5 * in.skip;
    h = Probe::apply(h);
    if (g_throw_in_backward == index_)
      h = ThrowInBackward::apply(h);
    return {h, side(in.h), index_};
  }
  torch::nn::Linear lin, side;
  int index_;
};
TORCH_MODULE(GBlock);

struct NetSpec {
  int n_blocks = 4;
  std::vector<int> order;  // block call order; empty: 0..n-1
  bool use_aux = false;    // the model adds the blocks' aux outputs
  int dead_block = -1;     // called after the others, result dropped
};

struct GNetImpl : torch::nn::Module {
  explicit GNetImpl(const NetSpec& spec)
      : embed(register_module("embed", torch::nn::Linear(kIn, kWidth))),
        head(register_module("head", torch::nn::Linear(kWidth, kOut))),
        spec_(spec) {
    for (int i = 0; i < spec.n_blocks; ++i)
      blocks.push_back(register_module("b" + std::to_string(i), GBlock(i)));
    if (spec_.order.empty()) {
      for (int i = 0; i < spec.n_blocks; ++i)
        spec_.order.push_back(i);
    }
  }
  // Returns the prediction and an output nobody uses (it never receives a gradient).
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x) {
    auto skip = embed(x);
    auto h = skip;
    for (int i : spec_.order) {
      BlockOut out = fsdp::forward(blocks[static_cast<size_t>(i)], BlockIn{h, skip});
      h = spec_.use_aux ? out.h + 0.1 * out.aux.value() : out.h;
    }
    if (spec_.dead_block >= 0)
      fsdp::forward(blocks[static_cast<size_t>(spec_.dead_block)], BlockIn{h, skip});
    return {head(h), h.sum(1)};
  }
  torch::nn::Linear embed, head;
  std::vector<GBlock> blocks;
  NetSpec spec_;
};
TORCH_MODULE(GNet);

torch::Tensor predict(GNet& net, const torch::Tensor& x) {
  return std::get<0>(fsdp::forward(net, x));
}

struct Batch {
  torch::Tensor x, y;
};

Batch batch(int step, int salt = 0) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3000 + step + 100 * salt);
  return {torch::randn({kGlobalBatch, kIn}, gen), torch::randn({kGlobalBatch, kOut}, gen)};
}

Batch rows(const Batch& b, int64_t first, int64_t count) {
  return {b.x.narrow(0, first, count), b.y.narrow(0, first, count)};
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind,
                                                        std::vector<torch::Tensor> params) {
  // AdamW (weight decay) catches a zero grad installed where one process has none; SGD catches
  // a gradient summed or counted twice.
  if (kind == "adamw") {
    return std::make_unique<torch::optim::AdamW>(
        std::move(params), torch::optim::AdamWOptions(1e-3).weight_decay(0.1).eps(1e-6));
  }
  return std::make_unique<torch::optim::SGD>(std::move(params),
                                             torch::optim::SGDOptions(0.2).momentum(0.9));
}

void shard(GNet& net, const std::shared_ptr<fsdp::ProcessGroup>& pg, ShardingStrategy strategy) {
  auto opts = fsdp::FullyShardOptions(pg).strategy(strategy);
  for (auto& b : net->blocks)
    fsdp::fully_shard(b, opts);
  fsdp::fully_shard(net, opts);
}

// Every unit of the model is sharded, idle and holds nothing unsharded.
void check_all_sharded(const torch::nn::Module& model, const std::string& when) {
  for (const auto& unit : fsdp::detail::units_under(model)) {
    WORKER_CHECK(unit->training_state() == fsdp::detail::TrainingState::kIdle && !unit->held())
        << unit->name() << " not idle " << when;
    if (unit->shard_size() == 1)
      continue;
    WORKER_CHECK(unit->sharded_state() == fsdp::detail::ShardedState::kSharded)
        << unit->name() << " still gathered " << when;
    for (const auto& p : unit->params()) {
      WORKER_CHECK(p.unsharded_storage_bytes() == 0)
          << p.fqn() << " of " << unit->name() << " holds " << p.unsharded_storage_bytes()
          << " unsharded bytes " << when;
    }
  }
}

double compare_params(GNet& model, GNet& reference, int rank, int world, bool sharded) {
  auto ref = reference->named_parameters();
  double max_diff = 0;
  for (const auto& item : model->named_parameters()) {
    auto want =
        sharded ? fsdp::test::expected_shard(ref[item.key()], rank, world) : ref[item.key()];
    WORKER_CHECK(item.value().sizes() == want.sizes())
        << item.key() << " " << item.value().sizes() << " vs " << want.sizes();
    WORKER_EXPECT_CLOSE(item.value(), want, 1e-5, 1e-6);
    if (want.numel() > 0)
      max_diff = std::max(max_diff, (item.value() - want).abs().max().item<double>());
  }
  return max_diff;
}

// A model of the same spec with the same initial values (copied before sharding).
GNet copy_of(GNet& reference) {
  GNet model(reference->spec_);
  torch::NoGradGuard no_grad;
  auto ref = reference->named_parameters();
  for (auto& item : model->named_parameters())
    item.value().copy_(ref[item.key()]);
  return model;
}

// One step of `net` on `b` (this rank's rows, or all of them for the reference).
void step(GNet& net, torch::optim::Optimizer& opt, const Batch& b, bool two_losses) {
  opt.zero_grad();
  torch::Tensor loss;
  if (two_losses) {
    // Two forwards of the whole model, one backward: the mean of the two halves' means.
    const int64_t half = b.x.size(0) / 2;
    auto l1 = torch::mse_loss(predict(net, b.x.narrow(0, 0, half)), b.y.narrow(0, 0, half));
    auto l2 = torch::mse_loss(predict(net, b.x.narrow(0, half, half)), b.y.narrow(0, half, half));
    loss = (l1 + l2) / 2;
  } else {
    loss = torch::mse_loss(predict(net, b.x), b.y);
  }
  loss.backward();
  opt.step();
}

struct Counts {
  int64_t all_gather = 0, reduce_scatter = 0, all_reduce = 0;
};

struct Scenario {
  NetSpec net;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  std::string optimizer = "adamw";
  bool two_losses = false;
  std::vector<std::string> frozen;  // parameter name prefixes
  Counts per_step;                  // world > 1
};

Scenario scenario(const std::string& name, ShardingStrategy strategy) {
  Scenario s;
  s.strategy = strategy;
  const bool full = strategy == ShardingStrategy::kFullShard;
  const bool sgo = strategy == ShardingStrategy::kShardGradOp;
  if (name == "frozen_root") {
    // Embedding and head frozen over trainable blocks: the root has no trainable parameter
    // but its head is in the gradient path, so it stays gathered for backward and reduces
    // nothing. Block 0's inputs need no grad: its backward ends at the end of the pass.
    s.frozen = {"embed.", "head."};
    s.per_step = {1 + 4 + 4, 4, 0};
  } else if (name == "frozen_lower") {
    // Blocks 0 and 1 frozen under trainable blocks and a trainable root: gathered for their
    // backward (the embedding's gradient flows through them), no reduction.
    s.frozen = {"b0.", "b1."};
    s.per_step = {1 + 4 + 4, 3, 0};
  } else if (name == "reused") {
    // Block 1 runs twice: 0, 1, 2, 1. Each call's backward gathers (if needed) and reduces.
    s.net.n_blocks = 3;
    s.net.order = {0, 1, 2, 1};
    s.optimizer = "sgd";
    if (full)
      s.per_step = {1 + 4 + 4, 5, 0};  // forward: root + 4 calls; backward: 4 calls
    else if (sgo)
      s.per_step = {1 + 3 + 1, 5, 0};  // held from the first call; regathered for call 1
    else
      s.per_step = {0, 0, 5};  // no_shard: one all-reduce per call, the root's once
  } else if (name == "two_losses") {
    // Two forwards, (l1 + l2).backward(): the root is held from the first forward; every block
    // call gathers in forward and in backward and reduces; the root reduces once.
    s.two_losses = true;
    s.optimizer = "sgd";
    s.per_step = {1 + 4 + 4 + 8, 9, 0};
  } else if (name == "unused_outputs") {
    // The blocks' aux outputs get no gradient (their `side` layers: no grad, as in one
    // process), the model's second output neither, and block 4 runs on the side, its result
    // dropped: it never runs a backward and reduces nothing.
    s.net.n_blocks = 5;
    s.net.order = {0, 1, 2, 3};
    s.net.dead_block = 4;
    s.per_step = {1 + 5 + 4, 5, 0};
  } else if (name == "struct_outputs") {
    s.net.use_aux = true;
    s.optimizer = "sgd";
    s.per_step = {1 + 4 + 4, 5, 0};
  } else {
    throw std::runtime_error("unknown scenario " + name);
  }
  return s;
}

void apply_frozen(GNet& net, const std::vector<std::string>& prefixes) {
  for (const auto& item : net->named_parameters()) {
    for (const auto& p : prefixes) {
      if (item.key().rfind(p, 0) == 0)
        item.value().set_requires_grad(false);
    }
  }
}

ShardingStrategy strategy_from(const std::string& s) {
  if (s == "shard_grad_op")
    return ShardingStrategy::kShardGradOp;
  if (s == "no_shard")
    return ShardingStrategy::kNoShard;
  return ShardingStrategy::kFullShard;
}

FSDP_WORKER(graph_equivalence) {
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), world = pg->size();
  const std::string name = ctx.env("FSDP_GRAPH");
  const Scenario s = scenario(name, strategy_from(ctx.env("FSDP_STRATEGY", "full_shard")));
  torch::manual_seed(11);
  GNet reference(s.net);
  torch::manual_seed(11 + rank);  // sync_module_states makes every rank rank 0's
  GNet model(s.net);
  apply_frozen(reference, s.frozen);
  apply_frozen(model, s.frozen);
  shard(model, pg, s.strategy);
  auto opt = make_optimizer(s.optimizer, model->parameters());
  auto ref_opt = make_optimizer(s.optimizer, reference->parameters());
  const int64_t local = kGlobalBatch / world;
  std::vector<int> probe;
  g_backward_probe = &probe;
  for (int k = 0; k < kSteps; ++k) {
    pg->comm_stats().reset();
    step(model, *opt, rows(batch(k), rank * local, local), s.two_losses);
    const auto& c = pg->comm_stats();
    if (world > 1) {
      WORKER_CHECK(c.all_gather.calls == s.per_step.all_gather &&
                   c.reduce_scatter.calls == s.per_step.reduce_scatter &&
                   c.all_reduce.calls == s.per_step.all_reduce)
          << name << " step " << k << ": " << c.all_gather.calls << " all-gathers, "
          << c.reduce_scatter.calls << " reduce-scatters, " << c.all_reduce.calls
          << " all-reduces; expected " << s.per_step.all_gather << ", " << s.per_step.reduce_scatter
          << ", " << s.per_step.all_reduce;
    }
    check_all_sharded(*model, "after step " + std::to_string(k));
  }
  g_backward_probe = nullptr;
  for (int k = 0; k < kSteps; ++k)
    step(reference, *ref_opt, batch(k), s.two_losses);
  const bool sharded = s.strategy != ShardingStrategy::kNoShard;
  const double diff = compare_params(model, reference, rank, world, sharded);
  // Frozen parameters never got a grad; unused ones neither, as in one process.
  auto ref = reference->named_parameters();
  for (const auto& item : model->named_parameters()) {
    WORKER_CHECK(item.value().grad().defined() == ref[item.key()].grad().defined())
        << item.key() << ": grad " << (item.value().grad().defined() ? "defined" : "undefined")
        << " here, " << (ref[item.key()].grad().defined() ? "defined" : "undefined")
        << " in one process";
  }
  // Inside a block's backward the units gathered are the root, that block and at most the
  // next one prefetched: the blocks after it have reduced (their struct inputs were hooked).
  int most = 0;
  for (int n : probe)
    most = std::max(most, n);
  if (world > 1 && s.strategy == ShardingStrategy::kFullShard && s.frozen.empty() &&
      !s.two_losses) {
    WORKER_CHECK(most <= 3) << "up to " << most << " units gathered inside a block's backward";
  }
  std::printf(
      "[rank %d/%d] GRAPH %s (%s) OK: %d steps, max |fsdp - reference| = %.3g; per step %lld "
      "all-gathers, %lld reduce-scatters, %lld all-reduces; <= %d units gathered in a block's "
      "backward; all units sharded after every step\n",
      rank, world, name.c_str(), fsdp::to_string(s.strategy), kSteps, diff,
      (long long)s.per_step.all_gather, (long long)s.per_step.reduce_scatter,
      (long long)s.per_step.all_reduce, most);
  return 0;
}

fsdp::test::RunResult run_graph(const std::string& graph, int world,
                                const std::string& strategy = "full_shard") {
  fsdp::test::RunOptions opts;
  opts.env = {{"FSDP_GRAPH", graph}, {"FSDP_STRATEGY", strategy}};
  return fsdp::test::run_workers("graph_equivalence", world, opts);
}

class Graphs : public ::testing::TestWithParam<int> {};

TEST_P(Graphs, FrozenRootOverTrainableBlocks) {
  EXPECT_WORKERS_OK(run_graph("frozen_root", GetParam()));
}
TEST_P(Graphs, FrozenLowerBlocks) {
  EXPECT_WORKERS_OK(run_graph("frozen_lower", GetParam()));
}
TEST_P(Graphs, BlockCalledTwiceFullShard) {
  EXPECT_WORKERS_OK(run_graph("reused", GetParam()));
}
TEST_P(Graphs, BlockCalledTwiceShardGradOp) {
  EXPECT_WORKERS_OK(run_graph("reused", GetParam(), "shard_grad_op"));
}
TEST_P(Graphs, BlockCalledTwiceNoShard) {
  EXPECT_WORKERS_OK(run_graph("reused", GetParam(), "no_shard"));
}
TEST_P(Graphs, TwoLossesSummedBeforeOneBackward) {
  EXPECT_WORKERS_OK(run_graph("two_losses", GetParam()));
}
TEST_P(Graphs, OutputsWithoutGradient) {
  EXPECT_WORKERS_OK(run_graph("unused_outputs", GetParam()));
}
TEST_P(Graphs, StructInputsAndOutputs) {
  EXPECT_WORKERS_OK(run_graph("struct_outputs", GetParam()));
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Graphs, ::testing::Values(2, 3),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// ---- Two models in one process ------------------------------------------------------------------

// A teacher/student-like pair: two FSDP models with their own root states, trained alternately
// and then together in one backward. Neither model's schedule, callback or state leaks into
// the other's.
FSDP_WORKER(two_models) {
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), world = pg->size();
  NetSpec spec_a, spec_b;
  spec_b.n_blocks = 2;
  torch::manual_seed(21);
  GNet ref_a(spec_a);
  torch::manual_seed(22);
  GNet ref_b(spec_b);
  torch::manual_seed(21);
  GNet a(spec_a);
  torch::manual_seed(22);
  GNet b(spec_b);
  shard(a, pg, ShardingStrategy::kFullShard);
  shard(b, pg, ShardingStrategy::kFullShard);
  WORKER_CHECK(fsdp::detail::find_unit(*a)->state_ptr() != fsdp::detail::find_unit(*b)->state_ptr())
      << "the two models share a root state";
  auto opt_a = make_optimizer("sgd", a->parameters());
  auto opt_b = make_optimizer("sgd", b->parameters());
  auto ref_opt_a = make_optimizer("sgd", ref_a->parameters());
  auto ref_opt_b = make_optimizer("sgd", ref_b->parameters());
  const int64_t local = kGlobalBatch / world;
  auto joint = [](GNet& m, GNet& n, torch::optim::Optimizer& om, torch::optim::Optimizer& on,
                  const Batch& bm, const Batch& bn) {
    om.zero_grad();
    on.zero_grad();
    auto loss = torch::mse_loss(predict(m, bm.x), bm.y) + torch::mse_loss(predict(n, bn.x), bn.y);
    loss.backward();
    om.step();
    on.step();
  };
  for (int k = 0; k < kSteps; ++k) {
    pg->comm_stats().reset();
    if (k % 2 == 0) {
      step(a, *opt_a, rows(batch(k), rank * local, local), false);
      step(b, *opt_b, rows(batch(k, 1), rank * local, local), false);
    } else {
      joint(a, b, *opt_a, *opt_b, rows(batch(k), rank * local, local),
            rows(batch(k, 1), rank * local, local));
    }
    // Each model: its root once and each block twice; every unit reduces once.
    const int64_t gathers = (1 + 2 * 4) + (1 + 2 * 2), reduces = 5 + 3;
    WORKER_CHECK(pg->comm_stats().all_gather.calls == gathers &&
                 pg->comm_stats().reduce_scatter.calls == reduces)
        << "step " << k << ": " << pg->comm_stats().to_string();
    check_all_sharded(*a, "(model a)");
    check_all_sharded(*b, "(model b)");
  }
  for (int k = 0; k < kSteps; ++k) {
    if (k % 2 == 0) {
      step(ref_a, *ref_opt_a, batch(k), false);
      step(ref_b, *ref_opt_b, batch(k, 1), false);
    } else {
      joint(ref_a, ref_b, *ref_opt_a, *ref_opt_b, batch(k), batch(k, 1));
    }
  }
  const double da = compare_params(a, ref_a, rank, world, true);
  const double db = compare_params(b, ref_b, rank, world, true);
  std::printf(
      "[rank %d/%d] TWO MODELS OK: alternate and joint steps, max diff %.3g / %.3g, 2 root "
      "states\n",
      rank, world, da, db);
  return 0;
}

TEST(Graphs, TwoModelsInOneProcess) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("two_models", 2));
  EXPECT_WORKERS_OK(fsdp::test::run_workers("two_models", 3));
}

// ---- Exceptions in the middle of a step -------------------------------------------------------

// Every rank throws at the same place: in block 2's forward at step 1, in block 2's backward
// at step 2 (in the second of two micro-batches, so a pass that already reduced the first one
// must be kept and the failed one rolled back). Each failed attempt is repeated; the result
// must equal a run that never failed, and every unit must be sharded right after the failure.
FSDP_WORKER(exceptions) {
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), world = pg->size();
  const bool no_sync = ctx.env("FSDP_NO_SYNC", "0") == "1";
  NetSpec spec;
  torch::manual_seed(31);
  GNet reference(spec);
  GNet model = copy_of(reference);
  shard(model, pg, ShardingStrategy::kFullShard);
  auto opt = make_optimizer("sgd", model->parameters());
  auto ref_opt = make_optimizer("sgd", reference->parameters());
  const int64_t local = kGlobalBatch / world;
  int forward_failures = 0, backward_failures = 0;
  auto micro_step = [&](const Batch& b, int micro, int k) {
    const int64_t half = b.x.size(0) / 2;
    auto mb = rows(b, micro * half, half);
    if (no_sync)
      fsdp::set_requires_gradient_sync(*model, micro == 1);
    if (k == 1 && micro == 1) {
      g_throw_in_forward = 2;
      try {
        predict(model, mb.x);
        WORKER_CHECK(false) << "the injected forward failure did not throw";
      } catch (const std::runtime_error& e) {
        WORKER_CHECK(std::string(e.what()).find("injected forward failure") != std::string::npos)
            << e.what();
        ++forward_failures;
      }
      g_throw_in_forward = -1;
      check_all_sharded(*model, "after a failed forward");
    }
    if (k == 2 && micro == 1) {
      g_throw_in_backward = 2;
      auto loss = torch::mse_loss(predict(model, mb.x), mb.y) / 2;
      try {
        loss.backward();
        WORKER_CHECK(false) << "the injected backward failure did not throw";
      } catch (const std::exception& e) {
        WORKER_CHECK(std::string(e.what()).find("injected backward failure") != std::string::npos)
            << e.what();
        ++backward_failures;
      }
      g_throw_in_backward = -1;
      check_all_sharded(*model, "right after a failed backward");
    }
    (torch::mse_loss(predict(model, mb.x), mb.y) / 2).backward();
  };
  for (int k = 0; k < kSteps; ++k) {
    opt->zero_grad();
    auto b = rows(batch(k), rank * local, local);
    micro_step(b, 0, k);
    micro_step(b, 1, k);
    opt->step();
    check_all_sharded(*model, "after step " + std::to_string(k));
  }
  for (int k = 0; k < kSteps; ++k)
    step(reference, *ref_opt, batch(k), /*two_losses=*/true);
  const double diff = compare_params(model, reference, rank, world, true);
  WORKER_CHECK(forward_failures == 1 && backward_failures == 1);
  std::printf(
      "[rank %d/%d] EXCEPTIONS OK (%s): a forward and a backward failure (mid-accumulation) "
      "repeated; max |fsdp - never-failed reference| = %.3g; sharded after each failure\n",
      rank, world, no_sync ? "no_sync" : "sync every micro-batch", diff);
  return 0;
}

// A forward and a backward that fail while the rate limiter holds a prefetch back: with
// max_inflight_all_gathers = 1 the running block's own gather takes the only slot, so the block
// it prefetches (recorded order, or an explicit list) waits in the queue. Rolling back frees
// that slot; a rollback must issue nothing (the queued gather included) and leave every unit
// sharded, and training must go on equal to a run that never failed.
FSDP_WORKER(rollback_with_queued_prefetch) {
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), world = pg->size();
  const bool explicit_list = ctx.env("FSDP_EXPLICIT_PREFETCH", "0") == "1";
  NetSpec spec;
  torch::manual_seed(37);
  GNet reference(spec);
  GNet model = copy_of(reference);
  auto opts = fsdp::FullyShardOptions(pg).max_inflight_all_gathers(1);
  for (auto& b : model->blocks)
    fsdp::fully_shard(b, opts);
  fsdp::fully_shard(model, opts);
  const int last = spec.n_blocks - 1;
  if (explicit_list) {
    auto block = [&](int i) {
      return std::static_pointer_cast<torch::nn::Module>(
          model->blocks[static_cast<size_t>(i)].ptr());
    };
    fsdp::set_modules_to_forward_prefetch(*block(1), {block(2), block(3)});
    fsdp::set_modules_to_backward_prefetch(*block(last), {block(last - 1), block(last - 2)});
  }
  auto opt = make_optimizer("sgd", model->parameters());
  auto ref_opt = make_optimizer("sgd", reference->parameters());
  const int64_t local = kGlobalBatch / world;
  for (int k = 0; k < kSteps; ++k) {
    opt->zero_grad();
    auto b = rows(batch(k), rank * local, local);
    if (k == 1 || k == 2) {
      // Step 0 recorded the order, so the prefetches have targets. Step 1 fails in block 1's
      // forward (its own gather holds the slot, block 2's prefetch waits), step 2 in the last
      // block's backward (same, with the block before it).
      const bool forward = k == 1;
      (forward ? g_throw_in_forward : g_throw_in_backward) = forward ? 1 : last;
      g_count_gathers_of = pg.get();
      g_gathers_at_failure = -1;
      const char* expected = forward ? "injected forward failure" : "injected backward failure";
      try {
        torch::mse_loss(predict(model, b.x), b.y).backward();
        WORKER_CHECK(false) << "the injected failure did not throw";
      } catch (const std::exception& e) {
        WORKER_CHECK(std::string(e.what()).find(expected) != std::string::npos) << e.what();
      }
      g_throw_in_forward = g_throw_in_backward = -1;
      g_count_gathers_of = nullptr;
      WORKER_CHECK(g_gathers_at_failure >= 0) << "the failure was not reached";
      WORKER_CHECK(pg->comm_stats().all_gather.calls == g_gathers_at_failure)
          << pg->comm_stats().all_gather.calls - g_gathers_at_failure
          << " all-gathers issued while rolling back a failed "
          << (forward ? "forward" : "backward");
      check_all_sharded(*model, std::string("right after a failed ") +
                                    (forward ? "forward" : "backward") + " with a queued prefetch");
    }
    torch::mse_loss(predict(model, b.x), b.y).backward();
    opt->step();
    check_all_sharded(*model, "after step " + std::to_string(k));
  }
  for (int k = 0; k < kSteps; ++k)
    step(reference, *ref_opt, batch(k), /*two_losses=*/false);
  const double diff = compare_params(model, reference, rank, world, true);
  std::printf("[rank %d/%d] ROLLBACK OK (%s prefetch): max |fsdp - reference| = %.3g\n", rank,
              world, explicit_list ? "explicit" : "recorded", diff);
  return 0;
}

TEST(Graphs, RollbackWithAQueuedPrefetchIssuesNothingAndLeavesAllSharded) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("rollback_with_queued_prefetch", 3));
  fsdp::test::RunOptions opts;
  opts.env = {{"FSDP_EXPLICIT_PREFETCH", "1"}};
  EXPECT_WORKERS_OK(fsdp::test::run_workers("rollback_with_queued_prefetch", 3, opts));
}

TEST(Graphs, ExceptionMidForwardAndMidBackwardThenTrainingGoesOn) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("exceptions", 3));
  fsdp::test::RunOptions opts;
  opts.env = {{"FSDP_NO_SYNC", "1"}};
  EXPECT_WORKERS_OK(fsdp::test::run_workers("exceptions", 2, opts));
}

}  // namespace
