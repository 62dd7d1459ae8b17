// The trace recorder (fsdp/core/trace.h) and its Chrome-trace file (fsdp/observe/chrome_trace.h)
// on a real step: 2 ranks, full_shard with prefetch and activation checkpointing, a root and
// three blocks. The file is parsed back and checked as a viewer would read it: every unit has
// its forward, backward and recomputation, its all-gather issued and waited for and its
// reduce-scatter issued and waited for; each row is a stack of properly nested spans; every
// event belongs to this rank's process; and nothing at all is recorded while tracing is off.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "harness/multiprocess.h"

namespace {

struct BlockImpl : torch::nn::Module {
  BlockImpl() : fc(register_module("fc", torch::nn::Linear(32, 32))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(fc(x)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Block);

struct StackImpl : torch::nn::Module {
  StackImpl()
      : in(register_module("in", torch::nn::Linear(8, 32))),
        h0(register_module("h0", Block())),
        h1(register_module("h1", Block())),
        h2(register_module("h2", Block())),
        out(register_module("out", torch::nn::Linear(32, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = in(x);
    h = fsdp::forward(h0, h);
    h = fsdp::forward(h1, h);
    h = fsdp::forward(h2, h);
    return out(h);
  }
  torch::nn::Linear in;
  Block h0, h1, h2;
  torch::nn::Linear out;
};
TORCH_MODULE(Stack);

void train_step(Stack& net, fsdp::FusedAdamW& opt, int rank) {
  opt.zero_grad();
  auto x = torch::randn({4, 8}) + rank;
  fsdp::forward(net, x).square().mean().backward();
  opt.step();
}

// One span as read back from the file.
struct Read {
  std::string name, kind, subject;
  int tid = 0;
  double ts = 0, end = 0;
};

FSDP_WORKER(trace_one_step) {
  auto pg = fsdp::init_process_group();
  torch::manual_seed(1);
  Stack net;
  auto blocks = fsdp::FullyShardOptions(pg)
                    .strategy(fsdp::ShardingStrategy::kFullShard)
                    .backward_prefetch(fsdp::BackwardPrefetch::kBackwardPre)
                    .activation_checkpointing(fsdp::CheckpointMode::kFull);
  for (auto* b : {&net->h0, &net->h1, &net->h2})
    fsdp::fully_shard(*b, blocks);
  fsdp::fully_shard(net, fsdp::FullyShardOptions(pg));
  fsdp::FusedAdamW opt(net->parameters());

  // Off (the default): a whole step records nothing, on any thread.
  WORKER_CHECK(!fsdp::trace::enabled());
  train_step(net, opt, pg->rank());  // also records the forward order prefetch follows
  WORKER_CHECK(fsdp::trace::collect().empty()) << "spans recorded while tracing was off";

  fsdp::trace::set_thread_name("main");
  fsdp::trace::start();
  fsdp::trace::set_step(7);
  train_step(net, opt, pg->rank());
  fsdp::trace::stop();
  auto threads = fsdp::trace::collect();
  // Stopped: the next step records nothing either.
  train_step(net, opt, pg->rank());
  WORKER_CHECK(fsdp::trace::collect().empty()) << "spans recorded after stop()";

  const std::string path = ctx.tmp_dir + "/trace/rank" + std::to_string(pg->rank()) + ".json";
  fsdp::write_chrome_trace(path, threads, pg->rank(), pg->size());
  std::ifstream in(path);
  const auto doc = nlohmann::json::parse(in);
  WORKER_CHECK(doc.at("distributedInfo").at("rank") == pg->rank());
  WORKER_CHECK(doc.at("distributedInfo").at("world_size") == pg->size());

  std::map<int, std::string> thread_names;
  std::vector<Read> spans;
  for (const auto& e : doc.at("traceEvents")) {
    WORKER_CHECK(e.at("pid") == pg->rank()) << e.dump();
    if (e.at("ph") == "M") {
      if (e.at("name") == "thread_name")
        thread_names[e.at("tid").get<int>()] = e.at("args").at("name").get<std::string>();
      continue;
    }
    WORKER_CHECK(e.at("ph") == "X") << e.dump();
    WORKER_CHECK(e.at("cat") == "user_annotation") << e.dump();
    const double dur = e.at("dur").get<double>();
    WORKER_CHECK(dur >= 0) << e.dump();
    WORKER_CHECK(e.at("args").at("step") == 7) << e.dump();
    Read r;
    r.name = e.at("name").get<std::string>();
    r.kind = e.at("args").at("kind").get<std::string>();
    r.subject = e.at("args").value("for", "");
    r.tid = e.at("tid").get<int>();
    r.ts = e.at("ts").get<double>();
    r.end = r.ts + dur;
    spans.push_back(r);
  }

  // Every unit: the root (named by its class) and the three blocks.
  std::set<std::string> units;
  std::map<std::string, std::set<std::string>> kinds_of;  // unit -> kinds of its spans
  for (const auto& s : spans) {
    if (s.kind == "forward")
      units.insert(s.subject);
    kinds_of[s.subject].insert(s.kind);
  }
  WORKER_CHECK(units.size() == 4) << units.size() << " units have a forward span";
  for (const char* b : {"h0", "h1", "h2"}) {
    WORKER_CHECK(units.count(b)) << "no forward span for " << b;
    WORKER_CHECK(kinds_of[b].count("recompute")) << "no recompute span for " << b;
  }
  for (const auto& u : units) {
    for (const char* kind : {"forward", "backward", "all_gather_issue", "all_gather_wait",
                             "reduce_scatter_issue", "reduce_scatter_wait"}) {
      WORKER_CHECK(kinds_of[u].count(kind)) << "unit '" << u << "' has no " << kind << " span";
    }
  }
  WORKER_CHECK(kinds_of[""].count("optimizer")) << "no optimizer span";

  // The transfers ran on the Gloo lanes' tracks, named; every row has a name.
  int transfers = 0;
  for (const auto& s : spans) {
    WORKER_CHECK(thread_names.count(s.tid)) << "tid " << s.tid << " has no name";
    if (s.kind == "transfer") {
      ++transfers;
      WORKER_CHECK(thread_names[s.tid].find("lane") != std::string::npos) << thread_names[s.tid];
    }
  }
  WORKER_CHECK(transfers >= 8) << transfers << " transfer spans (4 all-gathers of blocks and 4 "
                               << "reduce-scatters at least)";

  // Per row: spans nest (a span that starts inside another ends inside it). The file lists each
  // row's spans by start, enclosing ones first; check it in file order.
  std::map<int, std::vector<const Read*>> open;  // tid -> stack of enclosing spans
  for (const auto& s : spans) {
    auto& stack = open[s.tid];
    while (!stack.empty() && stack.back()->end <= s.ts)
      stack.pop_back();
    if (!stack.empty()) {
      WORKER_CHECK(s.ts >= stack.back()->ts && s.end <= stack.back()->end)
          << "'" << s.name << "' [" << s.ts << ", " << s.end << "] overlaps '" << stack.back()->name
          << "' [" << stack.back()->ts << ", " << stack.back()->end << "] on tid " << s.tid
          << " without nesting in it";
    }
    stack.push_back(&s);
  }
  std::printf("[rank %d] TRACE OK: %zu spans on %zu rows, %zu units, %d transfers\n", pg->rank(),
              spans.size(), thread_names.size(), units.size(), transfers);
  return 0;
}

TEST(Trace, OneStepOfFullShardWithPrefetchHasEveryUnitsSpansWellNested) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("trace_one_step", 2));
}

// The recorder alone: a span opened before start() is not recorded, nor one closed after
// stop(); spans from another thread land on that thread's row.
TEST(Trace, RecordsOnlyInsideStartAndStopPerThread) {
  fsdp::trace::stop();
  (void)fsdp::trace::collect();
  {
    fsdp::trace::Span before("test", "opened before start");
    fsdp::trace::start();
    { fsdp::trace::Span inside("test", "inside", "x", 12); }
    std::thread([] { fsdp::trace::Span other("test", "other thread"); }).join();
  }
  auto late = std::make_unique<fsdp::trace::Span>("test", "closed after stop");
  fsdp::trace::stop();
  late.reset();
  const auto threads = fsdp::trace::collect();
  ASSERT_EQ(threads.size(), 2u);
  std::set<std::string> names;
  for (const auto& t : threads) {
    ASSERT_EQ(t.events.size(), 1u);
    names.insert(t.events[0].name);
    EXPECT_GE(t.events[0].end_ns, t.events[0].begin_ns);
  }
  EXPECT_EQ(names, (std::set<std::string>{"inside x", "other thread"}));
  EXPECT_NE(threads[0].tid, threads[1].tid);
}

}  // namespace
