// The flight recorder: the ring and its dumps, and the three failures it exists for (a rank
// that issues another collective, a rank that stalls, a rank that dies): the failing ranks'
// errors name the peer, and the analysis of the dumps names the culprit and the unit.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <signal.h>
#include <unistd.h>

#include <fsdp/distributed/flight_analysis.h>
#include <fsdp/fsdp.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "gpt.h"
#include "harness/multiprocess.h"

namespace {

namespace fs = std::filesystem;
using fsdp_models::GPT;
using fsdp_models::GPTConfig;

std::string make_temp_dir(const char* tag) {
  std::string pattern = (fs::temp_directory_path() / (std::string("fsdp-fr-") + tag + "-XXXXXX"));
  const char* dir = ::mkdtemp(pattern.data());
  EXPECT_NE(dir, nullptr);
  return pattern;
}

TEST(FlightRecorder, RingKeepsTheNewestCollectivesWithTheirStatesAndDumpsThem) {
  auto& recorder = fsdp::FlightRecorder::global();
  const size_t before = recorder.capacity();
  recorder.set_capacity(3);
  auto pg = fsdp::init_process_group();  // one rank: real collectives, nothing to wait for
  auto t = torch::ones({10});
  for (int i = 0; i < 5; ++i)
    fsdp::all_reduce(*pg, t, fsdp::ReduceOp::kSum, "unit 'u" + std::to_string(i) + "'")->wait();
  auto pending = fsdp::broadcast(*pg, t, 0, "unit 'last'");  // issued, not yet waited for
  auto recs = recorder.records();
  ASSERT_EQ(recs.size(), 3u);
  EXPECT_EQ(recs[0].context, "unit 'u3'");
  EXPECT_EQ(recs[1].context, "unit 'u4'");
  EXPECT_EQ(recs[2].context, "unit 'last'");
  EXPECT_EQ(recs[0].state, fsdp::CollectiveState::kCompleted);
  EXPECT_EQ(recs[2].state, fsdp::CollectiveState::kIssued);
  EXPECT_EQ(recs[2].seq, recs[1].seq + 1);  // the group's own numbering
  EXPECT_EQ(recs[1].kind, "all-reduce");
  EXPECT_EQ(recs[1].bytes, 40);
  EXPECT_EQ(recs[1].dtype, "Float");
  EXPECT_GT(recs[0].started, 0);
  EXPECT_GE(recs[0].completed, recs[0].started);
  EXPECT_GE(recs[0].started, recs[0].issued);
  pending->wait();
  EXPECT_EQ(recorder.records().back().state, fsdp::CollectiveState::kCompleted);

  const std::string dir = make_temp_dir("ring");
  const std::string path = dir + "/rank0.json";
  recorder.dump_to(path, "asked by the test");
  std::ifstream in(path);
  const auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j.at("reason"), "asked by the test");
  EXPECT_EQ(j.at("records").size(), 3u);
  EXPECT_EQ(j.at("records")[2].at("state"), "completed");
  EXPECT_EQ(j.at("records")[2].at("context"), "unit 'last'");
  EXPECT_EQ(j.at("groups").at(pg->name()), std::vector<int>{0});
  // Shrinking keeps the newest; 0 records nothing but still counts progress.
  recorder.set_capacity(1);
  ASSERT_EQ(recorder.records().size(), 1u);
  EXPECT_EQ(recorder.records()[0].context, "unit 'last'");
  recorder.set_capacity(0);
  fsdp::all_reduce(*pg, t, fsdp::ReduceOp::kSum)->wait();
  EXPECT_TRUE(recorder.records().empty());
  EXPECT_EQ(recorder.progress().at(pg->name()).completed, recs[2].seq + 1);
  recorder.set_capacity(before);
  // A dump of one rank alone: no disagreement, and the analysis says where it stopped.
  const auto a = fsdp::analyze_flight_dumps(dir);
  EXPECT_EQ(a.seq, 0u) << a.text;
  EXPECT_NE(a.text.find("rank 0: last completed"), std::string::npos) << a.text;
  fs::remove_all(dir);
}

TEST(FlightRecorder, AnalysisRefusesWhatIsNotADump) {
  const std::string dir = make_temp_dir("bad");
  EXPECT_THROW(fsdp::analyze_flight_dumps(dir + "/missing"), std::runtime_error);
  try {
    fsdp::analyze_flight_dumps(dir);
    ADD_FAILURE() << "an empty directory was analysed";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("no flight-recorder dumps"), std::string::npos);
  }
  std::ofstream(dir + "/rank0.json") << "{\"format\": \"something else\"}";
  try {
    fsdp::analyze_flight_dumps(dir);
    ADD_FAILURE() << "a foreign file was analysed";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(dir + "/rank0.json"), std::string::npos) << e.what();
  }
  fs::remove(dir + "/rank0.json");
  ASSERT_EQ(::mkfifo((dir + "/rank1.json").c_str(), 0600), 0);  // must not block
  try {
    fsdp::analyze_flight_dumps(dir);
    ADD_FAILURE() << "a FIFO was read";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("not a regular file"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

// Three ranks train a 2-block GPT (units h0, h1 and the root); in the second step rank 1
// misbehaves as FSDP_TEST_FAULT says:
//  desync: it gathers block 1 on its own first (a unit called on one rank only);
//  stall:  it sleeps through the step (a hung rank) until the others have dumped, then dumps
//          on demand;
//  die:    it is SIGKILLed.
// The other ranks must fail within the timeout with an error that names rank 1.
FSDP_WORKER(flight_fault) {
  auto pg = fsdp::init_process_group(
      fsdp::ProcessGroupOptions().timeout(std::chrono::milliseconds(2500)));
  const int rank = pg->rank();
  const std::string fault = ctx.env("FSDP_TEST_FAULT");
  auto cfg = GPTConfig::preset("gpt2-test");
  cfg.n_layer = 2;
  torch::manual_seed(9);
  GPT model(cfg);
  fsdp_models::parallelize_gpt(model, fsdp::FullyShardOptions(pg));
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  auto idx = torch::randint(cfg.vocab_size, {2, 9}, torch::TensorOptions().dtype(torch::kLong));
  auto train_step = [&] {
    opt.zero_grad();
    fsdp_models::lm_loss(fsdp::forward(model, idx.narrow(1, 0, 8)), idx.narrow(1, 1, 8)).backward();
    opt.step();
  };
  train_step();
  if (rank == 1) {
    if (fault == "die") {
      ::kill(::getpid(), SIGKILL);
    } else if (fault == "stall") {
      // Hung until the others have failed and dumped (their diagnosis, from the peers'
      // progress reports, comes before their dumps), at most 6 s.
      const std::string dir = ctx.env("FSDP_FLIGHT_RECORDER_DIR");
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(6);
      while (std::chrono::steady_clock::now() < until &&
             !(fs::exists(dir + "/rank0.json") && fs::exists(dir + "/rank2.json")))
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      fsdp::FlightRecorder::global().dump("stalled rank, dumped on demand");
      return 0;
    }
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    if (rank == 1 && fault == "desync")
      fsdp::unshard(*model->blocks[1]);
    train_step();
    if (rank == 1)  // the desynced rank may finish its collectives against the others'
      return 0;
    WORKER_CHECK(false) << "the step succeeded without rank 1";
  } catch (const std::exception& e) {
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const std::string msg = e.what();
    std::printf("[rank %d] failed after %.2f s: %s\n", rank, took, msg.c_str());
    WORKER_CHECK(took < 2.5 + 5 + 3) << "took " << took << " s";  // timeout + diagnosis + slack
    WORKER_CHECK(msg.find("flight recorder: ") != std::string::npos) << msg;
    if (rank != 1 && fault != "desync") {
      WORKER_CHECK(msg.find("rank 1 (host ") != std::string::npos) << "rank 1 not named: " << msg;
    }
  }
  return 0;
}

fsdp::FlightAnalysis run_fault(const std::string& fault) {
  const std::string dir = make_temp_dir(fault.c_str());
  fsdp::test::RunOptions opts;
  opts.env = {{"FSDP_TEST_FAULT", fault}, {"FSDP_FLIGHT_RECORDER_DIR", dir}};
  opts.timeout = std::chrono::seconds(60);
  // Executed anew: a fork would inherit the recorder's ring (process-global) as the earlier
  // tests of this process left it, and the analysis would read their collectives too.
  opts.fork_ranks = false;
  auto result = fsdp::test::run_workers("flight_fault", 3, opts);
  EXPECT_FALSE(result.timed_out) << result.describe();
  for (int r : {0, 2}) {
    // Gloo aborts a rank whose peer sends a collective of another size (an exception on its
    // own thread: std::terminate); the recorder dumps before the abort.
    const bool aborted_by_gloo = fault == "desync" && result.exit_codes[r] == 128 + SIGABRT;
    EXPECT_TRUE(result.exit_codes[r] == 0 || aborted_by_gloo) << result.describe();
  }
  fsdp::FlightAnalysis a;
  try {
    a = fsdp::analyze_flight_dumps(dir);
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what() << "\n" << result.describe();
  }
  std::printf("%s--- analysis ---\n%s", result.outputs[0].c_str(), a.text.c_str());
  fs::remove_all(dir);
  return a;
}

TEST(FlightRecorder, NamesTheRankThatIssuedAnotherCollective) {
  const auto a = run_fault("desync");
  EXPECT_EQ(a.kind, "desync") << a.text;
  EXPECT_EQ(a.culprits, std::vector<int>{1}) << a.text;
  EXPECT_EQ(a.culprit_context, "unit 'h1'") << a.text;
  EXPECT_EQ(a.group, "world") << a.text;
  EXPECT_TRUE(a.missing_dumps.empty()) << a.text;  // the aborted rank dumped too
}

TEST(FlightRecorder, NamesTheRankThatStalled) {
  const auto a = run_fault("stall");
  EXPECT_EQ(a.kind, "not joined") << a.text;
  EXPECT_EQ(a.culprits, std::vector<int>{1}) << a.text;
  EXPECT_FALSE(a.context.empty()) << a.text;  // the unit whose gather rank 1 never joined
  EXPECT_TRUE(a.missing_dumps.empty()) << a.text;
}

TEST(FlightRecorder, NamesTheRankThatDied) {
  const auto a = run_fault("die");
  EXPECT_EQ(a.kind, "no dump") << a.text;
  EXPECT_EQ(a.culprits, std::vector<int>{1}) << a.text;
  EXPECT_EQ(a.missing_dumps, std::vector<int>{1}) << a.text;
  EXPECT_FALSE(a.context.empty()) << a.text;
}

}  // namespace
