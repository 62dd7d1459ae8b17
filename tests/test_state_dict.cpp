// fsdp::param_shards: what each rank holds of every parameter, by name, against the rows an
// unsharded copy of the model (same seed) has there; who writes replicated rows.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>
#include <fsdp/state_dict.h>

#include "harness/multiprocess.h"
#include "harness/sharding.h"
#include "harness/small_net.h"

namespace {

using Net = fsdp::test::SmallNet;

Net make_net() {
  torch::manual_seed(5);
  return Net();
}

FSDP_WORKER(param_shards) {
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), n = pg->size();
  const std::string strategy = ctx.env("STRATEGY", "full_shard");
  auto net = make_net();
  auto full = make_net()->named_parameters();
  fsdp::FullyShardOptions opts(pg);
  if (strategy == "no_shard")
    opts.strategy(fsdp::ShardingStrategy::kNoShard);
  if (strategy == "hybrid_shard")
    opts.strategy(fsdp::ShardingStrategy::kHybridShard).hybrid_shard_size(2);
  fsdp::fully_shard(net->a, opts);  // b stays in the root unit; "outside" keeps b out of all
  if (ctx.env("OUTSIDE") != "1")
    fsdp::fully_shard(net, opts);
  auto shards = fsdp::param_shards(*net);
  WORKER_CHECK(shards.size() == 5u) << shards.size();
  for (const auto& s : shards) {
    auto want_full = full[s.name];
    WORKER_CHECK(s.global_shape == want_full.sizes().vec()) << s.name;
    auto rows = want_full.dim() == 0 ? want_full.reshape({1}) : want_full;
    // The rows this rank should hold: its block of the shard group, or everything.
    const bool in_unit = s.name.rfind("a.", 0) == 0 || ctx.env("OUTSIDE") != "1";
    const int shard_n = !in_unit || strategy == "no_shard" ? 1 : strategy == "hybrid_shard" ? 2 : n;
    const int shard_rank = shard_n == 1 ? 0 : rank % shard_n;
    auto want = fsdp::test::expected_shard(rows, shard_rank, shard_n);
    WORKER_CHECK(s.rows == want.size(0) && s.shard.sizes() == want.sizes())
        << s.name << " " << s.shard.sizes() << " vs " << want.sizes();
    WORKER_CHECK(torch::equal(s.shard, want)) << s.name;
    if (s.rows > 0) {
      auto rb = (want.data_ptr<float>() - rows.data_ptr<float>()) / rows.stride(0);
      WORKER_CHECK(s.row_begin == rb) << s.name << " " << s.row_begin << " vs " << rb;
    }
    // Exactly one holder of each row writes it: the first replica.
    const bool want_writer = shard_n == n || rank < shard_n;
    WORKER_CHECK(s.writer == want_writer) << s.name << " rank " << rank;
  }
  // Writing into a shard changes the model.
  {
    torch::NoGradGuard no_grad;
    for (auto& s : shards) {
      if (s.name == "a.weight")
        s.shard.fill_(3.0);
    }
  }
  WORKER_CHECK(net->a->weight.numel() == 0 || (net->a->weight == 3.0).all().item<bool>());
  std::printf("[rank %d] PARAM SHARDS OK (%s%s)\n", rank, strategy.c_str(),
              ctx.env("OUTSIDE") == "1" ? ", params outside units" : "");
  return 0;
}

fsdp::test::RunOptions env(std::vector<std::pair<std::string, std::string>> vars) {
  fsdp::test::RunOptions o;
  o.env = std::move(vars);
  return o;
}

TEST(StateDict, ParamShardsAreTheRowsOfTheGlobalTensors) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("param_shards", 3, env({})));
  EXPECT_WORKERS_OK(fsdp::test::run_workers("param_shards", 3, env({{"OUTSIDE", "1"}})));
}

TEST(StateDict, ReplicasWriteOnce) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("param_shards", 2, env({{"STRATEGY", "no_shard"}})));
  EXPECT_WORKERS_OK(
      fsdp::test::run_workers("param_shards", 4, env({{"STRATEGY", "hybrid_shard"}})));
}

}  // namespace
