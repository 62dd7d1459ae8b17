// The benchmark mode of the collectives door (ProcessGroupOptions::bench_local_collectives,
// FSDP_BENCH_LOCAL_COLLECTIVES, fsdp-train's fsdp.bench_local_collectives): every collective is
// a local copy of the same bytes, nothing reaches the backend, the counters see the same calls
// and sizes as the real step. bench/bounds.py's compute-only step rests on these properties.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <fsdp/fsdp.h>

#include <fsdp/distributed/collectives.h>
#include <fsdp/distributed/flight_recorder.h>
#include "harness/command.h"
#include "harness/multiprocess.h"

namespace {

namespace fs = std::filesystem;
using fsdp::ReduceOp;

// Rank r's piece i: a value that identifies both.
torch::Tensor piece(int rank, int i, int64_t n, torch::ScalarType dtype) {
  return (torch::arange(n, torch::kFloat) + 1000 * rank + 100 * i).to(dtype);
}

bool nothing_sent(const fsdp::CommStats& s) {
  return s.all_gather.sent_bytes == 0 && s.reduce_scatter.sent_bytes == 0 &&
         s.all_reduce.sent_bytes == 0 && s.broadcast.sent_bytes == 0 && s.point_to_point.bytes == 0;
}

FSDP_WORKER(local_collectives_copy) {
  // A short timeout: a collective that did reach the backend while its peers never issue it
  // (below) fails in 3 s instead of passing.
  auto pg = fsdp::init_process_group(
      fsdp::ProcessGroupOptions().bench_local_collectives(true).timeout(std::chrono::seconds(10)));
  const int rank = pg->rank(), n = pg->size();
  WORKER_CHECK(pg->bench_local_collectives());

  // all-gather: three pieces of different dtypes, whole and in buckets that cut inside
  // elements; every rank's slot holds this rank's piece.
  const std::vector<int64_t> sizes{5, 7, 1};
  const std::vector<torch::ScalarType> dtypes{torch::kFloat, torch::kDouble, torch::kBFloat16};
  const int64_t in_bytes = 5 * 4 + 7 * 8 + 1 * 2;
  for (int64_t bucket : {int64_t{0}, int64_t{5} * n}) {
    std::vector<torch::Tensor> inputs, outputs;
    for (int i = 0; i < 3; ++i) {
      inputs.push_back(piece(rank, i, sizes[i], dtypes[i]));
      outputs.push_back(torch::full({n * sizes[i]}, -1, dtypes[i]));
    }
    fsdp::all_gather(*pg, inputs, outputs, bucket, "test")->wait();
    for (int i = 0; i < 3; ++i) {
      WORKER_CHECK(outputs[i].numel() == n * sizes[i]);
      for (int r = 0; r < n; ++r) {
        WORKER_CHECK(torch::equal(outputs[i].narrow(0, r * sizes[i], sizes[i]), inputs[i]))
            << "bucket " << bucket << ", piece " << i << ", slot " << r << ": " << outputs[i];
      }
    }
  }
  // reduce-scatter: this rank's own block of its input (the sum or mean over one rank).
  const int64_t s = 6;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    auto input = torch::arange(n * s, torch::kFloat) + 100 * rank;
    auto output = torch::full({s}, -1.0f);
    fsdp::reduce_scatter(*pg, input, output, op, "test")->wait();
    WORKER_CHECK(torch::equal(output, input.narrow(0, rank * s, s))) << output;
  }
  // all-reduce and broadcast leave this rank's values in place.
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
    auto t = piece(rank, 1, 9, torch::kFloat);
    fsdp::all_reduce(*pg, t, op, "test")->wait();
    WORKER_CHECK(torch::equal(t, piece(rank, 1, 9, torch::kFloat))) << t;
  }
  auto b = piece(rank, 2, 4, torch::kDouble);
  fsdp::broadcast(*pg, b, 0, "test")->wait();
  WORKER_CHECK(torch::equal(b, piece(rank, 2, 4, torch::kDouble))) << b;

  // Counted like the real collectives (calls and sizes), with nothing sent.
  const auto& st = pg->comm_stats();
  WORKER_CHECK(st.all_gather.calls == 2 && st.all_gather.bytes == 2 * n * in_bytes)
      << st.to_string();
  WORKER_CHECK(st.reduce_scatter.calls == 2 && st.reduce_scatter.bytes == 2 * n * s * 4)
      << st.to_string();
  WORKER_CHECK(st.all_reduce.calls == 3 && st.all_reduce.bytes == 3 * 9 * 4) << st.to_string();
  WORKER_CHECK(st.broadcast.calls == 1 && st.broadcast.bytes == 4 * 8) << st.to_string();
  WORKER_CHECK(nothing_sent(st)) << st.to_string();

  // Nothing reaches the backend: rank 1 alone issues collectives no other rank issues (on the
  // backend they would wait for peers that never come, and fail after the timeout). Then
  // every rank meets at a barrier, which is real: it would pair with rank 1's all-gather if
  // that had gone to the backend.
  if (rank == 1) {
    auto big = torch::ones({1 << 18});
    auto out = torch::empty({n << 18});
    const auto start = std::chrono::steady_clock::now();
    for (int k = 0; k < 5; ++k) {
      fsdp::all_gather(*pg, {big}, {out}, 0, "rank 1 only")->wait();
      fsdp::all_reduce(*pg, big, ReduceOp::kSum, "rank 1 only")->wait();
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    WORKER_CHECK(seconds < 1.0) << "rank 1's lone collectives took " << seconds << " s";
    WORKER_CHECK(torch::equal(out, torch::ones({n << 18})));
  }
  pg->barrier();
  WORKER_CHECK(pg->comm_stats().barrier.calls == 1);
  WORKER_CHECK(nothing_sent(pg->comm_stats())) << pg->comm_stats().to_string();

  // Subgroups inherit the mode; point-to-point has no local meaning and is refused.
  std::vector<int> first_two{0, 1};
  auto sub = pg->new_group(first_two);
  if (sub) {
    WORKER_CHECK(sub->bench_local_collectives());
    auto in = piece(rank, 0, 3, torch::kFloat);
    auto out = torch::empty({6});
    fsdp::all_gather(*sub, {in}, {out})->wait();
    WORKER_CHECK(torch::equal(out, torch::cat({in, in})));
    WORKER_CHECK(nothing_sent(sub->comm_stats()));
  }
  bool refused = false;
  try {
    fsdp::send(*pg, torch::ones({2}), (rank + 1) % n, 0);
  } catch (const std::exception& e) {
    refused = std::string(e.what()).find("bench_local_collectives") != std::string::npos;
  }
  WORKER_CHECK(refused) << "send was not refused";

  // The flight recorder says which collectives were local copies.
  int local_records = 0;
  for (const auto& r : fsdp::FlightRecorder::global().records())
    local_records += r.description.find("(local copy)") != std::string::npos;
  WORKER_CHECK(local_records >= 8) << local_records << " records say '(local copy)'";
  pg->barrier();
  std::printf(
      "[rank %d] LOCAL COPIES OK: all-gather, reduce-scatter, all-reduce, broadcast; "
      "%lld B counted, 0 sent\n",
      rank,
      static_cast<long long>(pg->comm_stats().all_gather.bytes +
                             pg->comm_stats().reduce_scatter.bytes));
  return 0;
}

TEST(LocalCollectives, CopyLocallyAndSendNothing) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("local_collectives_copy", 3));
}

FSDP_WORKER(local_collectives_env) {
  // Anything but 0 or 1 is refused, naming the variable.
  ::setenv("FSDP_BENCH_LOCAL_COLLECTIVES", "yes", 1);
  std::string error;
  try {
    fsdp::init_process_group();
  } catch (const std::exception& e) {
    error = e.what();
  }
  WORKER_CHECK(error.find("FSDP_BENCH_LOCAL_COLLECTIVES") != std::string::npos)
      << "error: '" << error << "'";
  ::setenv("FSDP_BENCH_LOCAL_COLLECTIVES", "0", 1);
  auto real = fsdp::init_process_group();
  WORKER_CHECK(!real->bench_local_collectives());
  ::setenv("FSDP_BENCH_LOCAL_COLLECTIVES", "1", 1);
  auto local = fsdp::init_process_group();
  WORKER_CHECK(local->bench_local_collectives());
  auto t = torch::full({4}, static_cast<float>(ctx.rank + 1));
  fsdp::all_reduce(*real, t, ReduceOp::kSum)->wait();
  WORKER_CHECK(t[0].item<float>() == 3.0f) << "real all-reduce: " << t;
  fsdp::all_reduce(*local, t, ReduceOp::kSum)->wait();
  WORKER_CHECK(t[0].item<float>() == 3.0f) << "local all-reduce: " << t;
  WORKER_CHECK(real->comm_stats().all_reduce.sent_bytes > 0);
  WORKER_CHECK(local->comm_stats().all_reduce.sent_bytes == 0);
  std::printf("[rank %d] ENVIRONMENT OK\n", ctx.rank);
  return 0;
}

TEST(LocalCollectives, EnvironmentTurnsItOn) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("local_collectives_env", 2));
}

// A chain of sharded units, for a training step of each strategy.
struct ChainImpl : torch::nn::Module {
  ChainImpl() : head(register_module("head", torch::nn::Linear(24, 5))) {
    for (int i = 0; i < 3; ++i)
      blocks.push_back(
          register_module(std::string("b").append(std::to_string(i)), torch::nn::Linear(24, 24)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = x;
    for (auto& b : blocks)
      h = torch::relu(fsdp::forward(b, h));
    return head(h);
  }
  std::vector<torch::nn::Linear> blocks;
  torch::nn::Linear head;
};
TORCH_MODULE(Chain);

struct StepResult {
  fsdp::CommStats comm;
  std::vector<std::vector<int64_t>> grad_shapes;
  bool finite = true;
};

StepResult one_step(const std::shared_ptr<fsdp::ProcessGroup>& pg, fsdp::ShardingStrategy s,
                    int rank) {
  torch::manual_seed(7);
  Chain chain;
  fsdp::FullyShardOptions opts(pg);
  opts.strategy(s);
  for (auto& b : chain->blocks)
    fsdp::fully_shard(b, opts);
  fsdp::fully_shard(chain, opts);
  torch::optim::SGD sgd(chain->parameters(), torch::optim::SGDOptions(0.1));
  const fsdp::CommStats before = pg->comm_stats();
  torch::manual_seed(100 + rank);  // each rank its own batch
  for (int step = 0; step < 2; ++step) {
    sgd.zero_grad();
    auto loss = fsdp::forward(chain, torch::randn({4, 24})).pow(2).mean();
    loss.backward();
    sgd.step();
  }
  StepResult r;
  r.comm = pg->comm_stats() - before;
  for (const auto& p : chain->parameters()) {
    r.grad_shapes.push_back(p.grad().defined() ? p.grad().sizes().vec() : std::vector<int64_t>{-1});
    r.finite = r.finite && p.grad().defined() && torch::isfinite(p.grad()).all().item<bool>();
  }
  return r;
}

bool same_sizes(const fsdp::CollectiveCounter& a, const fsdp::CollectiveCounter& b) {
  return a.calls == b.calls && a.bytes == b.bytes;
}

FSDP_WORKER(local_collectives_step) {
  auto real = fsdp::init_process_group();
  auto local = fsdp::init_process_group(fsdp::ProcessGroupOptions().bench_local_collectives(true));
  const int rank = real->rank();
  for (auto s : {fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp,
                 fsdp::ShardingStrategy::kNoShard}) {
    const StepResult a = one_step(real, s, rank);
    const StepResult b = one_step(local, s, rank);
    const auto& x = a.comm;
    const auto& y = b.comm;
    // The same collectives, of the same sizes; the real ones sent bytes, the local ones none.
    WORKER_CHECK(same_sizes(x.all_gather, y.all_gather) &&
                 same_sizes(x.reduce_scatter, y.reduce_scatter) &&
                 same_sizes(x.all_reduce, y.all_reduce) && same_sizes(x.broadcast, y.broadcast))
        << fsdp::to_string(s) << ": real " << x.to_string() << " local " << y.to_string();
    WORKER_CHECK(x.all_gather.calls + x.all_reduce.calls > 0) << fsdp::to_string(s);
    WORKER_CHECK(x.all_gather.sent_bytes + x.reduce_scatter.sent_bytes + x.all_reduce.sent_bytes >
                 0)
        << fsdp::to_string(s);
    WORKER_CHECK(nothing_sent(y)) << fsdp::to_string(s) << ": " << y.to_string();
    // The optimizer stepped on gradients of the shards' shapes, finite.
    WORKER_CHECK(a.grad_shapes == b.grad_shapes) << fsdp::to_string(s);
    WORKER_CHECK(b.finite) << fsdp::to_string(s);
    std::printf(
        "[rank %d] STEP OK (%s): %lld collectives of %lld B, as the real step's; 0 sent\n", rank,
        fsdp::to_string(s),
        static_cast<long long>(y.all_gather.calls + y.reduce_scatter.calls + y.all_reduce.calls),
        static_cast<long long>(y.all_gather.bytes + y.reduce_scatter.bytes + y.all_reduce.bytes));
  }
  return 0;
}

TEST(LocalCollectives, ShardedStepsHaveTheRealSizes) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("local_collectives_step", 2));
}

// fsdp-train with fsdp.bench_local_collectives: the run finishes and reports its speed, its
// step counted the collectives of a real step, and every rank said nothing was sent.
TEST(LocalCollectives, TrainerRunWithTheOption) {
  const fs::path work = fs::path(FSDP_TEST_WORK_DIR) / "local-collectives";
  const fs::path run_dir = work / "run";
  fs::remove_all(work);
  fs::create_directories(work);
  const auto cmd = std::string(FSDP_TRAIN_CMD) +
                   " --nproc 2 --model.preset=gpt2-test --data.corpus=fortunes --data.dir=" +
                   (work / "data").string() +
                   " --data.vocab_size=512 --training.steps=5 --training.batch_size=2 "
                   "--training.seq_len=16 --training.eval_every=0 --training.eval_batches=1 "
                   "--generate.tokens=0 --logging.plot=false --logging.progress=none "
                   "--logging.run_dir=" +
                   run_dir.string() + " --fsdp.bench_local_collectives=true";
  const auto r = fsdp::test::run_command("FSDP_FLIGHT_RECORDER_DUMP_AT_EXIT=1 " + cmd);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("benchmark mode (bench_local_collectives)"), std::string::npos)
      << r.output;
  std::ifstream metrics(run_dir / "metrics.jsonl");
  ASSERT_TRUE(metrics) << "no metrics.jsonl";
  int steps = 0;
  for (std::string line; std::getline(metrics, line);) {
    const auto m = nlohmann::json::parse(line);
    ++steps;
    EXPECT_GT(m.at("tokens_per_second").get<double>(), 0) << line;
    EXPECT_GT(m.at("allgather_bytes").get<int64_t>(), 0) << line;
    EXPECT_GT(m.at("reducescatter_bytes").get<int64_t>(), 0) << line;
  }
  EXPECT_EQ(steps, 5);
  // Both ranks dumped their flight recorder at exit: every collective a training step issued
  // was a local copy (the barriers of the set-up are the only real ones).
  for (int rank = 0; rank < 2; ++rank) {
    std::ifstream in(run_dir / "flight_recorder" / ("rank" + std::to_string(rank) + ".json"));
    ASSERT_TRUE(in) << "rank " << rank << " left no flight-recorder dump";
    const auto dump = nlohmann::json::parse(in);
    int local = 0, real = 0;
    for (const auto& rec : dump.at("records")) {
      const std::string kind = rec.at("kind"), what = rec.at("description");
      if (kind == "barrier")
        continue;
      (what.find("(local copy)") != std::string::npos ? local : real) += 1;
    }
    EXPECT_GT(local, 5 * 5) << "rank " << rank;
    EXPECT_EQ(real, 0) << "rank " << rank;
  }
}

}  // namespace
