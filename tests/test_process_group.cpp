// Process groups and the multi-process harness: launcher environments, the rendezvous, Gloo
// collectives and subgroups on 3 real processes, and the failure modes that must end in a clear
// message instead of a hang (a rank that never starts, a rank that dies, a rank that is silent).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <fsdp/distributed/collectives.h>
#include <fsdp/distributed/process_group.h>
#include <fsdp/distributed/store_latch.h>

#include "distributed/group_access.h"

#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "harness/multiprocess.h"
#include "harness/ports.h"

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// ---- Environment parsing ----------------------------------------------------------------------

// Clears every variable the launcher detection reads and restores them afterwards, so that
// these tests pass under torchrun or SLURM too.
class ScopedEnv {
 public:
  ScopedEnv() {
    for (const char* var : kVars) {
      const char* v = std::getenv(var);
      if (v)
        saved_[var] = v;
      ::unsetenv(var);
    }
  }
  ~ScopedEnv() {
    for (const char* var : kVars)
      ::unsetenv(var);
    for (const auto& [k, v] : saved_)
      ::setenv(k.c_str(), v.c_str(), 1);
  }
  ScopedEnv& set(const char* var, const std::string& value) {
    ::setenv(var, value.c_str(), 1);
    return *this;
  }

 private:
  static constexpr const char* kVars[] = {"RANK",
                                          "WORLD_SIZE",
                                          "LOCAL_RANK",
                                          "LOCAL_WORLD_SIZE",
                                          "MASTER_ADDR",
                                          "MASTER_PORT",
                                          "TORCHELASTIC_USE_AGENT_STORE",
                                          "TORCHELASTIC_RESTART_COUNT",
                                          "SLURM_PROCID",
                                          "SLURM_NTASKS",
                                          "SLURM_LOCALID",
                                          "SLURM_NTASKS_PER_NODE",
                                          "SLURM_TASKS_PER_NODE",
                                          "SLURM_NODEID",
                                          "SLURM_LAUNCH_NODE_IPADDR",
                                          "SLURM_JOB_ID",
                                          "GLOO_SOCKET_IFNAME"};
  std::map<std::string, std::string> saved_;
};

// The message of what `f` throws, or nullopt.
std::optional<std::string> error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return std::string(e.what());
  }
  return std::nullopt;
}

TEST(LaunchEnv, SingleProcessWhenNoLauncherVariables) {
  ScopedEnv env;
  auto e = fsdp::launch_env_from_environment();
  EXPECT_EQ(e.source, "single");
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.local_world_size, 1);
  EXPECT_FALSE(e.agent_store);
  EXPECT_TRUE(e.store_prefix.empty());
}

TEST(LaunchEnv, TorchrunWithAgentStore) {
  ScopedEnv env;
  env.set("RANK", "5")
      .set("WORLD_SIZE", "8")
      .set("LOCAL_RANK", "1")
      .set("LOCAL_WORLD_SIZE", "4")
      .set("MASTER_ADDR", "10.1.2.3")
      .set("MASTER_PORT", "29400")
      .set("TORCHELASTIC_USE_AGENT_STORE", "True")
      .set("TORCHELASTIC_RESTART_COUNT", "2");
  auto e = fsdp::launch_env_from_environment();
  EXPECT_EQ(e.source, "torchrun");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.master_addr, "10.1.2.3");
  EXPECT_EQ(e.master_port, 29400);
  EXPECT_TRUE(e.agent_store);
  EXPECT_EQ(e.store_prefix, "/worker/attempt_2");
}

TEST(LaunchEnv, TorchrunWithoutAgentStoreAndDefaults) {
  ScopedEnv env;
  // torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 exports "False": rank 0 serves.
  env.set("RANK", "2").set("WORLD_SIZE", "3").set("TORCHELASTIC_USE_AGENT_STORE", "False");
  auto e = fsdp::launch_env_from_environment();
  EXPECT_EQ(e.source, "torchrun");
  EXPECT_FALSE(e.agent_store);
  EXPECT_TRUE(e.store_prefix.empty());
  EXPECT_EQ(e.local_rank, 2);  // no LOCAL_*: one node
  EXPECT_EQ(e.local_world_size, 3);
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, 29500);
}

TEST(LaunchEnv, SlurmCompressedTasksPerNode) {
  ScopedEnv env;
  env.set("SLURM_PROCID", "4")
      .set("SLURM_NTASKS", "6")
      .set("SLURM_LOCALID", "0")
      .set("SLURM_NTASKS_PER_NODE", "2(x3)")
      .set("SLURM_NODEID", "2")
      .set("SLURM_LAUNCH_NODE_IPADDR", "10.0.0.7")
      .set("SLURM_JOB_ID", "123456");
  auto e = fsdp::launch_env_from_environment();
  EXPECT_EQ(e.source, "slurm");
  EXPECT_EQ(e.rank, 4);
  EXPECT_EQ(e.world_size, 6);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.master_addr, "10.0.0.7");
  EXPECT_EQ(e.master_port, 20000 + 123456 % 10000);  // per-job default port
  EXPECT_FALSE(e.agent_store);                       // rank 0 serves the store
}

TEST(LaunchEnv, SlurmHeterogeneousNodesAndExplicitMaster) {
  ScopedEnv env;
  env.set("SLURM_PROCID", "4")
      .set("SLURM_NTASKS", "5")
      .set("SLURM_LOCALID", "1")
      .set("SLURM_TASKS_PER_NODE", "3,2(x1)")
      .set("SLURM_NODEID", "1")
      .set("SLURM_LAUNCH_NODE_IPADDR", "10.0.0.7")
      .set("MASTER_ADDR", "node001")
      .set("MASTER_PORT", "31000");
  auto e = fsdp::launch_env_from_environment();
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.master_addr, "node001");
  EXPECT_EQ(e.master_port, 31000);
}

struct BadEnvCase {
  std::map<std::string, std::string> vars;
  std::string must_mention;
};

// Names the case by what its error must mention (GoogleTest otherwise prints raw bytes).
void PrintTo(const BadEnvCase& c, std::ostream* os) {
  *os << c.must_mention;
}

class LaunchEnvErrors : public ::testing::TestWithParam<BadEnvCase> {};

TEST_P(LaunchEnvErrors, NameTheVariableOnOneLine) {
  ScopedEnv env;
  for (const auto& [k, v] : GetParam().vars)
    env.set(k.c_str(), v);
  auto err = error_of([] { fsdp::launch_env_from_environment(); });
  ASSERT_TRUE(err.has_value()) << "no error for " << GetParam().must_mention;
  EXPECT_NE(err->find(GetParam().must_mention), std::string::npos) << *err;
  EXPECT_EQ(err->find('\n'), std::string::npos) << *err;
}

INSTANTIATE_TEST_SUITE_P(
    Malformed, LaunchEnvErrors,
    ::testing::Values(
        BadEnvCase{{{"RANK", "abc"}, {"WORLD_SIZE", "2"}}, "RANK=\"abc\""},
        BadEnvCase{{{"RANK", "1x"}, {"WORLD_SIZE", "2"}}, "RANK=\"1x\""},
        BadEnvCase{{{"RANK", "-1"}, {"WORLD_SIZE", "2"}}, "RANK=-1"},
        BadEnvCase{{{"RANK", "3"}, {"WORLD_SIZE", "3"}}, "RANK=3 is not below WORLD_SIZE=3"},
        BadEnvCase{{{"RANK", "0"}, {"WORLD_SIZE", "0"}}, "WORLD_SIZE=0"},
        BadEnvCase{{{"RANK", "0"}}, "WORLD_SIZE is not set"},
        BadEnvCase{{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "x"}}, "LOCAL_RANK=\"x\""},
        BadEnvCase{
            {{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}},
            "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"},
        BadEnvCase{{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}},
                   "MASTER_PORT=70000"},
        BadEnvCase{{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "p"}}, "MASTER_PORT=\"p\""},
        BadEnvCase{{{"RANK", "0"},
                    {"WORLD_SIZE", "2"},
                    {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                    {"TORCHELASTIC_RESTART_COUNT", "one"}},
                   "TORCHELASTIC_RESTART_COUNT=\"one\""},
        BadEnvCase{{{"SLURM_PROCID", "x"}, {"SLURM_NTASKS", "2"}}, "SLURM_PROCID=\"x\""},
        BadEnvCase{{{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "2"}},
                   "SLURM_PROCID=2 is not below SLURM_NTASKS=2"},
        BadEnvCase{{{"SLURM_PROCID", "0"}}, "SLURM_NTASKS is not set"},
        BadEnvCase{{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "6"}, {"SLURM_NTASKS_PER_NODE", "2(x"}},
                   "SLURM_NTASKS_PER_NODE=\"2(x\""},
        BadEnvCase{
            {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "6"}, {"SLURM_NTASKS_PER_NODE", "2(y3)"}},
            "SLURM_NTASKS_PER_NODE=\"2(y3)\""},
        BadEnvCase{{{"SLURM_PROCID", "0"},
                    {"SLURM_NTASKS", "6"},
                    {"SLURM_LOCALID", "2"},
                    {"SLURM_NTASKS_PER_NODE", "2(x3)"}},
                   "SLURM_LOCALID=2 is not below SLURM_NTASKS_PER_NODE=2"}),
    [](const auto& info) { return "case" + std::to_string(info.index); });

// ---- In-process groups ------------------------------------------------------------------------

TEST(ProcessGroup, SingleProcessNeedsNoNetwork) {
  fsdp::LaunchEnv env;  // world of one
  auto pg = fsdp::init_process_group(env, fsdp::ProcessGroupOptions().timeout(10s));
  EXPECT_EQ(pg->rank(), 0);
  EXPECT_EQ(pg->size(), 1);
  EXPECT_EQ(pg->global_ranks(), std::vector<int>{0});
  EXPECT_EQ(pg->device_type(), c10::kCPU);
  EXPECT_EQ(pg->backend_name(), "gloo");
  EXPECT_NE(dynamic_cast<c10d::HashStore*>(fsdp::detail::GroupAccess::store(*pg).get()), nullptr);
  auto t = torch::arange(4, torch::kFloat);
  fsdp::all_reduce(*pg, t, fsdp::ReduceOp::kSum)->wait();
  EXPECT_TRUE(torch::equal(t, torch::arange(4, torch::kFloat)));
  pg->barrier();
  auto sub = pg->new_group({0});
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->size(), 1);
  auto bad = error_of([&] { pg->new_group({1}); });
  ASSERT_TRUE(bad.has_value());
  EXPECT_NE(bad->find("ascending group ranks in [0, 1)"), std::string::npos) << *bad;
}

TEST(ProcessGroup, UnknownBackendListsTheKnownOnes) {
  fsdp::LaunchEnv env;
  auto err = error_of(
      [&] { fsdp::init_process_group(env, fsdp::ProcessGroupOptions().backend("glooo")); });
  ASSERT_TRUE(err.has_value());
  EXPECT_NE(err->find("unknown process group backend \"glooo\""), std::string::npos) << *err;
  EXPECT_NE(err->find("gloo"), std::string::npos) << *err;
}

TEST(ProcessGroup, RegisteredBackendIsUsedForWorldAndSubgroups) {
  int created = 0;
  fsdp::register_backend(
      "counting_gloo", [&](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                           const fsdp::ProcessGroupOptions& options) {
        ++created;
        auto opts = c10d::ProcessGroupGloo::Options::create(options.timeout());
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
        return c10::static_intrusive_pointer_cast<c10d::Backend>(
            c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts));
      });
  fsdp::LaunchEnv env;
  auto pg = fsdp::init_process_group(env, fsdp::ProcessGroupOptions().backend("counting_gloo"));
  auto sub = pg->new_group({0});
  EXPECT_EQ(created, 2);
  EXPECT_EQ(sub->backend_name(), "counting_gloo");
  fsdp::register_backend("counting_gloo", [](auto&&...) -> c10::intrusive_ptr<c10d::Backend> {
    throw std::runtime_error("unregistered");
  });
}

TEST(ProcessGroup, UnreachableStoreFailsWithinTheTimeout) {
  fsdp::LaunchEnv env;
  env.rank = 1;
  env.world_size = 2;
  env.master_port = fsdp::test::reserved_port();
  env.agent_store = true;
  const auto start = Clock::now();
  auto err =
      error_of([&] { fsdp::init_process_group(env, fsdp::ProcessGroupOptions().timeout(1s)); });
  const double took = seconds_since(start);
  ASSERT_TRUE(err.has_value());
  EXPECT_EQ(*err, "[rank 1] cannot reach the rendezvous store at 127.0.0.1:" +
                      std::to_string(env.master_port) +
                      " within 1s (is rank 0 / the launcher running? check "
                      "MASTER_ADDR/MASTER_PORT)");
  EXPECT_GE(took, 1.0);
  EXPECT_LT(took, 1.0 + 3.0);
  std::printf("unreachable store reported after %.2f s (timeout 1 s)\n", took);
}

// ---- Three processes --------------------------------------------------------------------------

fsdp::ProcessGroupOptions options_from(const fsdp::test::WorkerContext& ctx) {
  return fsdp::ProcessGroupOptions().timeout(
      std::chrono::milliseconds(ctx.env_int("FSDP_TEST_PG_TIMEOUT_MS", 60000)));
}

FSDP_WORKER(pg_collectives) {
  auto pg = fsdp::init_process_group(options_from(ctx));
  const int rank = pg->rank(), n = pg->size();
  WORKER_CHECK(rank == ctx.rank && n == ctx.world_size) << rank << "/" << n;
  WORKER_CHECK(pg->global_ranks() == std::vector<int>({0, 1, 2}));

  auto in = torch::arange(4, torch::kFloat) + 10 * rank;
  auto out = torch::full({n * 4}, -1.0f);
  fsdp::all_gather(*pg, {in}, {out})->wait();
  for (int r = 0; r < n; ++r) {
    WORKER_EXPECT_CLOSE(out.narrow(0, 4 * r, 4), torch::arange(4, torch::kFloat) + 10 * r, 0, 0);
  }
  auto sum = torch::full({3}, static_cast<double>(rank + 1));
  fsdp::all_reduce(*pg, sum, fsdp::ReduceOp::kSum)->wait();
  WORKER_EXPECT_CLOSE(sum, torch::full({3}, n * (n + 1) / 2.0), 0, 0);
  pg->barrier();

  // A subgroup over the outer ranks; rank 1 takes part in the numbering but gets no group.
  auto outer = pg->new_group({0, 2});
  if (rank == 1) {
    WORKER_CHECK(outer == nullptr);
  } else {
    WORKER_CHECK(outer != nullptr);
    WORKER_CHECK(outer->size() == 2 && outer->rank() == rank / 2) << outer->rank();
    WORKER_CHECK(outer->global_ranks() == std::vector<int>({0, 2}));
    auto t = torch::full({2}, static_cast<double>(rank));
    fsdp::all_reduce(*outer, t, fsdp::ReduceOp::kSum)->wait();
    WORKER_EXPECT_CLOSE(t, torch::full({2}, 2.0), 0, 0);
    outer->barrier();
  }
  // The next group must line up on every rank although rank 1 got nothing from the last one.
  auto upper = pg->new_group({1, 2});
  if (rank == 0) {
    WORKER_CHECK(upper == nullptr);
  } else {
    WORKER_CHECK(upper != nullptr && upper->global_ranks() == std::vector<int>({1, 2}));
    auto o = torch::empty({2}, torch::kLong);
    auto mine = torch::full({1}, rank, torch::kLong);
    fsdp::all_gather(*upper, {mine}, {o})->wait();
    WORKER_CHECK(torch::equal(o, torch::tensor({1, 2}, torch::kLong))) << o;
  }
  pg->barrier();

  // A second world group in the same job must not trip over the first one's keys.
  auto again = fsdp::init_process_group(options_from(ctx));
  auto one = torch::ones({2});
  fsdp::all_reduce(*again, one, fsdp::ReduceOp::kSum)->wait();
  WORKER_EXPECT_CLOSE(one, torch::full({2}, static_cast<double>(n)), 0, 0);
  std::printf("[rank %d] COLLECTIVES OK\n", rank);
  return 0;
}

TEST(ProcessGroup, ThreeRanksCollectivesAndSubgroups) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("pg_collectives", 3));
}

TEST(ProcessGroup, ThreeRanksRankZeroHostsTheStore) {
  // As under SLURM or torchrun without the shared store: no agent, rank 0 serves.
  fsdp::test::RunOptions opts;
  opts.env = {{"TORCHELASTIC_USE_AGENT_STORE", "False"},
              {"MASTER_PORT", std::to_string(fsdp::test::reserved_port())}};
  EXPECT_WORKERS_OK(fsdp::test::run_workers("pg_collectives", 3, opts));
}

// Gloo's event-loop threads (one per device: a group's lanes and subgroups each have theirs) run
// under SCHED_BATCH unless FSDP_GLOO_LOOP_BATCH=0 (src/distributed/gloo_loop_policy.h); the rank's
// own threads keep the policy they had.
FSDP_WORKER(pg_loop_policy) {
  auto pg = fsdp::init_process_group();
  auto sub = pg->new_group({0, 1});
  auto t = torch::ones({2});
  fsdp::all_reduce(*sub, t, fsdp::ReduceOp::kSum)->wait();
  const int want = ctx.env("FSDP_GLOO_LOOP_BATCH", "1") == "1" ? SCHED_BATCH : SCHED_OTHER;
  int loops = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::string name;
    std::getline(std::ifstream(task.path() / "comm"), name);
    const pid_t tid = static_cast<pid_t>(std::stol(task.path().filename().string()));
    const int policy = ::sched_getscheduler(tid);
    if (name == "gloo_tcp_loop") {
      ++loops;
      WORKER_CHECK(policy == want) << "loop thread " << tid << " policy " << policy;
    } else if (tid == ::getpid()) {
      WORKER_CHECK(policy == SCHED_OTHER) << "main thread policy " << policy;
    }
  }
  // World and subgroup, two lanes each.
  WORKER_CHECK(loops >= 4) << loops << " Gloo loops";
  std::printf("[rank %d] LOOP POLICY OK: %d loops, policy %d\n", pg->rank(), loops, want);
  return 0;
}

TEST(ProcessGroup, GloosEventLoopsRunUnderSchedBatch) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("pg_loop_policy", 2));
  EXPECT_WORKERS_OK(fsdp::test::run_workers("pg_loop_policy", 2,
                                            fsdp::test::with_env({{"FSDP_GLOO_LOOP_BATCH", "0"}})));
}

FSDP_WORKER(pg_join) {
  auto pg = fsdp::init_process_group(options_from(ctx));
  pg->barrier();
  return 0;
}

// Ranks other than the absent ones must fail on their own, with `expect` in their output,
// well before the harness would kill them.
void expect_no_hang(const std::vector<int>& absent,
                    std::vector<std::pair<std::string, std::string>> env,
                    const std::vector<std::string>& expect) {
  // The present ranks only connect to the store before they wait for the absent one: 1.5 s
  // leaves them ample time now that a connection never asks DNS (trainer/cli/loopback_names.cpp).
  constexpr int kTimeoutMs = 1500;
  fsdp::test::RunOptions opts;
  opts.absent_ranks = absent;
  opts.env = std::move(env);
  opts.env.emplace_back("FSDP_TEST_PG_TIMEOUT_MS", std::to_string(kTimeoutMs));
  opts.timeout = 60s;
  auto result = fsdp::test::run_workers("pg_join", 3, opts);
  EXPECT_FALSE(result.timed_out) << result.describe();
  EXPECT_LT(result.seconds, 20.0) << result.describe();
  for (int r = 0; r < 3; ++r) {
    if (std::find(absent.begin(), absent.end(), r) != absent.end())
      continue;
    EXPECT_NE(result.exit_codes[r], 0) << result.describe();
    // The rank's own one-line message (the library may log other lines around it).
    const std::string prefix = "[rank " + std::to_string(r) + "] ";
    const std::string out = "\n" + result.outputs[r];
    const auto begin = out.rfind("\n" + prefix);
    const auto line = begin == std::string::npos
                          ? std::string()
                          : out.substr(begin + 1, out.find('\n', begin + 1) - begin - 1);
    for (const auto& text : expect) {
      EXPECT_NE(line.find(text), std::string::npos)
          << "expected \"" << text << "\" in \"" << line << "\"\n"
          << result.describe();
    }
    // Process start-up (loading LibTorch) plus the timeout, plus slack for a loaded machine.
    EXPECT_LT(result.exit_seconds[r], kTimeoutMs / 1000.0 + 8.0) << result.describe();
    std::printf("rank %d failed after %.2f s: %s\n", r, result.exit_seconds[r], line.c_str());
  }
  std::printf("whole run: %.2f s (timeout %d ms)\n", result.seconds, kTimeoutMs);
}

TEST(ProcessGroup, MissingRankFailsTheRendezvousWithoutHanging) {
  expect_no_hang({2}, {},
                 {"rendezvous at 127.0.0.1:", "failed: rank(s) 2 of 3 did not join within 1.5s"});
}

TEST(ProcessGroup, MissingRankWhenRankZeroHostsTheStore) {
  expect_no_hang({2},
                 {{"TORCHELASTIC_USE_AGENT_STORE", "False"},
                  {"MASTER_PORT", std::to_string(fsdp::test::reserved_port())}},
                 {"failed: rank(s) 2 of 3 did not join within 1.5s"});
}

TEST(ProcessGroup, MissingRankZeroMeansNoStore) {
  const int port = fsdp::test::reserved_port();
  expect_no_hang(
      {0}, {{"TORCHELASTIC_USE_AGENT_STORE", "False"}, {"MASTER_PORT", std::to_string(port)}},
      {"cannot reach the rendezvous store at 127.0.0.1:" + std::to_string(port) + " within 1.5s"});
}

// Ranks other than 1 run an all-reduce that rank 1 never joins: it is killed (FSDP_TEST_PEER=
// die), exits normally (exit), or stays alive without taking part (silent) until the others
// are done.
FSDP_WORKER(pg_lost_peer) {
  auto opts = options_from(ctx);
  auto pg = fsdp::init_process_group(opts);
  const std::string mode = ctx.env("FSDP_TEST_PEER");
  // Rank 1 leaves only once every rank has its group: init_process_group returns on one rank
  // while another may still be connecting Gloo's pairs, and a peer that died then fails that
  // rank's init instead of the collective under test (seen once in a full suite run).
  auto store = fsdp::detail::GroupAccess::store(*pg);
  store->set("test/ready" + std::to_string(pg->rank()), std::vector<uint8_t>{'1'});
  if (pg->rank() == 1) {
    store->wait({"test/ready0", "test/ready2"}, 60s);
    if (mode == "die") {
      ::kill(::getpid(), SIGKILL);
    } else if (mode == "exit") {
      return 0;
    }
    fsdp::detail::GroupAccess::store(*pg)->wait({"test/done0", "test/done2"}, 60s);
    return 0;
  }
  const auto start = Clock::now();
  auto t = torch::ones({1024});
  std::string error;
  try {
    fsdp::all_reduce(*pg, t, fsdp::ReduceOp::kSum)->wait();
  } catch (const std::exception& e) {
    error = e.what();
  }
  const double took = seconds_since(start);
  const double limit = opts.timeout().count() / 1000.0 + 3.0;
  std::printf("[rank %d] all-reduce with a %s peer failed after %.2f s: %s\n", pg->rank(),
              mode.c_str(), took, error.substr(0, error.find('\n')).c_str());
  fsdp::detail::GroupAccess::store(*pg)->set("test/done" + std::to_string(pg->rank()),
                                             std::vector<uint8_t>{'1'});
  WORKER_CHECK(!error.empty()) << "the all-reduce succeeded without rank 1";
  WORKER_CHECK(took < limit) << "took " << took << " s";
  return 0;
}

TEST(ProcessGroup, DeadPeerMakesTheCollectiveFail) {
  fsdp::test::RunOptions opts;
  opts.env = {{"FSDP_TEST_PEER", "die"}, {"FSDP_TEST_PG_TIMEOUT_MS", "3000"}};
  auto result = fsdp::test::run_workers("pg_lost_peer", 3, opts);
  EXPECT_FALSE(result.timed_out) << result.describe();
  EXPECT_EQ(result.exit_codes[0], 0) << result.describe();
  EXPECT_EQ(result.exit_codes[1], 128 + SIGKILL) << result.describe();
  EXPECT_EQ(result.exit_codes[2], 0) << result.describe();
  EXPECT_LT(result.seconds, 20.0);
  std::printf("%s", result.outputs[0].c_str());
  std::printf("whole run: %.2f s\n", result.seconds);
}

TEST(ProcessGroup, PeerThatExitedMakesTheCollectiveFail) {
  fsdp::test::RunOptions opts;
  opts.env = {{"FSDP_TEST_PEER", "exit"}, {"FSDP_TEST_PG_TIMEOUT_MS", "3000"}};
  auto result = fsdp::test::run_workers("pg_lost_peer", 3, opts);
  EXPECT_WORKERS_OK(result);
  EXPECT_LT(result.seconds, 20.0);
  std::printf("%s", result.outputs[0].c_str());
}

TEST(ProcessGroup, SilentPeerMakesTheCollectiveTimeOut) {
  fsdp::test::RunOptions opts;
  opts.env = {{"FSDP_TEST_PEER", "silent"}, {"FSDP_TEST_PG_TIMEOUT_MS", "2000"}};
  auto result = fsdp::test::run_workers("pg_lost_peer", 3, opts);
  EXPECT_WORKERS_OK(result);
  EXPECT_LT(result.seconds, 20.0);
  std::printf("%s", result.outputs[0].c_str());
  std::printf("whole run: %.2f s\n", result.seconds);
}

// ---- Who may connect ----------------------------------------------------------------------------

// The listening TCP sockets of process `pid`, as "address:port" read from /proc/net/tcp and
// tcp6 (what `ss -ltn` shows), matched to the process by socket inode.
std::vector<std::string> listening_sockets(int pid) {
  std::set<std::string> inodes;
  const std::string fd_dir = "/proc/" + std::to_string(pid) + "/fd";
  for (const auto& e : std::filesystem::directory_iterator(fd_dir)) {
    std::error_code ec;
    const auto target = std::filesystem::read_symlink(e.path(), ec).string();
    if (!ec && target.rfind("socket:[", 0) == 0)
      inodes.insert(target.substr(8, target.size() - 9));
  }
  std::vector<std::string> out;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string slot, local, remote, state, queues, timer, retr, uid, timeout, inode;
      f >> slot >> local >> remote >> state >> queues >> timer >> retr >> uid >> timeout >> inode;
      if (state == "0A" && inodes.count(inode))  // 0A: LISTEN
        out.push_back(local);
    }
  }
  return out;
}

// Loopback in /proc/net's hex: 127.x.x.x (little-endian "..7F"), ::1, or ::ffff:127.x.x.x.
bool is_loopback_hex(const std::string& address_port) {
  const std::string a = address_port.substr(0, address_port.find(':'));
  if (a.size() == 8)
    return a.substr(6, 2) == "7F";
  return a == "00000000000000000000000001000000" ||
         (a.substr(0, 24) == "0000000000000000FFFF0000" && a.substr(30, 2) == "7F");
}

FSDP_WORKER(listens_on_loopback) {
  auto pg = fsdp::init_process_group();
  fsdp::barrier(*pg)->wait();  // every connection made
  for (int pid : {static_cast<int>(::getpid()), static_cast<int>(::getppid())}) {
    const auto sockets = listening_sockets(pid);
    for (const auto& s : sockets) {
      WORKER_CHECK(is_loopback_hex(s)) << "pid " << pid << " listens on " << s;
    }
    if (pid == ::getppid()) {
      WORKER_CHECK(!sockets.empty()) << "the launcher's store is not listening";
    }
  }
  fsdp::barrier(*pg)->wait();
  return 0;
}

// fsdp-train --nproc and the tests launch through launch_local_ranks: the rendezvous store
// (the launcher's) and the ranks' Gloo sockets accept connections from this machine only.
TEST(LocalLaunch, ListensOnLoopbackOnly) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("listens_on_loopback", 2));
}

// ---- The harness itself -----------------------------------------------------------------------

FSDP_WORKER(harness_echo) {
  std::printf("hello from rank %d of %d\n", ctx.rank, ctx.world_size);
  std::fprintf(stderr, "stderr of rank %d\n", ctx.rank);
  return ctx.rank == ctx.env_int("FSDP_TEST_FAILING_RANK", -1) ? 3 : 0;
}

TEST(Harness, CapturesExitCodesAndOutput) {
  fsdp::test::RunOptions opts;
  opts.env = {{"FSDP_TEST_FAILING_RANK", "1"}};
  auto result = fsdp::test::run_workers("harness_echo", 3, opts);
  EXPECT_FALSE(result.ok());
  EXPECT_EQ(result.exit_codes, std::vector<int>({0, 3, 0}));
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(result.outputs[r].find("hello from rank " + std::to_string(r) + " of 3"),
              std::string::npos);
    EXPECT_NE(result.outputs[r].find("stderr of rank " + std::to_string(r)), std::string::npos);
  }
  const auto text = result.describe();
  EXPECT_NE(text.find("rank 1: exit code 3"), std::string::npos) << text;
  EXPECT_NE(text.find("| hello from rank 1 of 3"), std::string::npos) << text;
  EXPECT_EQ(text.find("| hello from rank 0"), std::string::npos) << text;

  EXPECT_WORKERS_OK(fsdp::test::run_workers("harness_echo", 2));
}

// What a rank is: a fork of the test binary (its command line is the parent's: gtest's), or the
// binary executed anew (its command line names the worker); either way it sees the launcher's
// environment as it is at the launch, with the rank's variables, and its output and exit code
// reach the test.
FSDP_WORKER(harness_how_started) {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  const std::string cmdline((std::istreambuf_iterator<char>(in)), {});
  const bool executed = cmdline.find("--fsdp-worker=harness_how_started") != std::string::npos;
  std::printf("rank %d %s, OMP threads %d, RANK %s\n", ctx.rank, executed ? "executed" : "forked",
              at::get_num_threads(), std::getenv("RANK"));
  const char* set_late = std::getenv("FSDP_TEST_SET_BEFORE_LAUNCH");
  WORKER_CHECK(set_late && std::string(set_late) == "yes") << (set_late ? set_late : "unset");
  return 10 + ctx.rank;
}

TEST(LocalLaunch, ForksTheRanksWhereSingleThreadedAndExecutesThemOtherwise) {
  // Set after the binary started: a rank started either way sees it, as a spawned one would.
  ::setenv("FSDP_TEST_SET_BEFORE_LAUNCH", "yes", 1);
  fsdp::test::RunOptions fork;
  fork.fork_ranks = true;
  auto forked = fsdp::test::run_workers("harness_how_started", 2, fork);
  EXPECT_TRUE(forked.forked);
  // With another thread alive, a fork could copy a lock that thread holds: spawned instead.
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::thread other([&] {
    std::unique_lock lock(m);
    cv.wait(lock, [&] { return done; });
  });
  auto executed = fsdp::test::run_workers("harness_how_started", 2, fork);
  {
    std::lock_guard lock(m);
    done = true;
  }
  cv.notify_all();
  other.join();
  ::unsetenv("FSDP_TEST_SET_BEFORE_LAUNCH");
  EXPECT_FALSE(executed.forked);
  EXPECT_FALSE(  // asked not to
      fsdp::test::run_workers("harness_how_started", 2, fsdp::test::executed({})).forked);
  for (const auto* run : {&forked, &executed}) {
    const char* how = run == &forked ? "forked" : "executed";
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(run->exit_codes[r], 10 + r) << run->describe();
      EXPECT_NE(run->outputs[r].find("rank " + std::to_string(r) + " " + how +
                                     ", OMP threads 1, RANK " + std::to_string(r)),
                std::string::npos)
          << run->outputs[r];
    }
  }
}

FSDP_WORKER(harness_hang) {
  std::printf("rank %d hangs (pid %d)\n", ctx.rank, static_cast<int>(::getpid()));
  std::fflush(stdout);
  std::this_thread::sleep_for(std::chrono::minutes(10));
  return 0;
}

TEST(Harness, KillsHungRanksAtTheTimeoutAndLeavesNoProcess) {
  fsdp::test::RunOptions opts;
  opts.timeout = 1500ms;
  auto result = fsdp::test::run_workers("harness_hang", 2, opts);
  EXPECT_TRUE(result.timed_out);
  EXPECT_FALSE(result.ok());
  EXPECT_LT(result.seconds, 10.0);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(result.exit_codes[r], 128 + SIGKILL);
    EXPECT_EQ(::kill(result.pids[r], 0), -1);
    EXPECT_EQ(errno, ESRCH);
  }
  EXPECT_NE(result.describe().find("TIMED OUT"), std::string::npos);
  EXPECT_NE(result.describe().find("| rank 0 hangs"), std::string::npos) << result.describe();
}

TEST(Harness, AbsentRanksAreNotLaunched) {
  fsdp::test::RunOptions opts;
  opts.absent_ranks = {1};
  auto result = fsdp::test::run_workers("harness_echo", 3, opts);
  EXPECT_WORKERS_OK(result);
  EXPECT_EQ(result.exit_codes[1], fsdp::test::RunResult::kNotLaunched);
  EXPECT_EQ(result.pids[1], 0);
  EXPECT_TRUE(result.outputs[1].empty());
}

FSDP_WORKER(harness_checks) {
  const int x = 1;
  WORKER_CHECK(x == 1) << "not reached";
  if (ctx.rank == 0) {
    WORKER_CHECK(x + 1 == 3) << "custom " << 42;
  } else if (ctx.rank == 1) {
    WORKER_EXPECT_CLOSE(torch::ones({3}), torch::ones({3}, torch::kDouble), 0, 0);
    WORKER_EXPECT_CLOSE(torch::ones({3}), torch::tensor({1.0, 1.5, 1.0}), 1e-5, 1e-6);
  } else {
    throw std::runtime_error("plain exception");
  }
  return 0;
}

TEST(Harness, WorkerChecksNameRankFileLineAndValues) {
  auto result = fsdp::test::run_workers("harness_checks", 3);
  EXPECT_EQ(result.exit_codes, std::vector<int>({1, 1, 1})) << result.describe();
  EXPECT_NE(result.outputs[0].find("[rank 0] test_process_group.cpp:"), std::string::npos)
      << result.outputs[0];
  EXPECT_NE(result.outputs[0].find(": x + 1 == 3: custom 42"), std::string::npos)
      << result.outputs[0];
  EXPECT_NE(result.outputs[1].find("max |a - b| = 0.5 at flat index 1"), std::string::npos)
      << result.outputs[1];
  EXPECT_NE(result.outputs[1].find("1 of 3 elements"), std::string::npos) << result.outputs[1];
  EXPECT_NE(result.outputs[2].find("[rank 2] plain exception"), std::string::npos)
      << result.outputs[2];
}

}  // namespace

namespace {

// A stand-in for a torchrun agent: a forked child that ignores SIGTERM or not, with a second
// worker that runs for `sibling_ms` (another rank still writing its error), and a worker (the
// "rank") that ends it with fsdp::end_torchrun_agent. Returns how the agent ended and how long
// it took.
std::pair<int, double> end_agent(bool ignores_sigterm, std::chrono::milliseconds grace,
                                 int sibling_ms = 0) {
  const auto start = std::chrono::steady_clock::now();
  const pid_t agent = ::fork();
  if (agent == 0) {
    ::alarm(20);  // never left behind, whatever end_torchrun_agent does
    if (ignores_sigterm)
      ::signal(SIGTERM, SIG_IGN);  // as an agent whose handler waits behind a store call
    const pid_t me = ::getpid();
    if (sibling_ms > 0 && ::fork() == 0) {
      ::usleep(static_cast<useconds_t>(sibling_ms) * 1000);
      ::_exit(0);
    }
    if (::fork() == 0) {
      fsdp::end_torchrun_agent(static_cast<int>(me), grace);
      ::_exit(0);
    }
    // Reaps the sibling when it ends (so that it is gone, not a zombie), until a signal ends it.
    while (true) {
      if (::wait(nullptr) < 0 && errno == ECHILD)
        ::pause();
    }
  }
  int status = 0;
  ::waitpid(agent, &status, 0);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return {WIFSIGNALED(status) ? WTERMSIG(status) : -WEXITSTATUS(status), seconds};
}

}  // namespace

// A rank cut off from the store ends its torchrun agent, which would otherwise wait on the
// store for ever, once the host's other ranks are done: SIGTERM, and SIGKILL if the agent has
// not ended within the grace.
TEST(TorchrunAgent, EndedBySigtermOrAfterTheGraceBySigkill) {
  const auto [term, term_s] = end_agent(false, std::chrono::seconds(5));
  EXPECT_EQ(term, SIGTERM);
  EXPECT_LT(term_s, 2.0);
  const auto [kill, kill_s] = end_agent(true, std::chrono::milliseconds(400));
  EXPECT_EQ(kill, SIGKILL);
  EXPECT_GE(kill_s, 0.4);
  EXPECT_LT(kill_s, 3.0);
  // Another rank of the host is still at work for 0.6 s: the agent is ended after it is done.
  const auto [after, after_s] = end_agent(false, std::chrono::seconds(5), 600);
  EXPECT_EQ(after, SIGTERM);
  EXPECT_GE(after_s, 0.6);
  EXPECT_LT(after_s, 3.0);
  // Not cut off (no collective failed with the store out of reach): there is none to end.
  EXPECT_FALSE(fsdp::store_out_of_reach());
  EXPECT_EQ(fsdp::cut_off_torchrun_agent(), 0);
}

// A latch given up on (an asynchronous save whose ranks did not all write in time) leaves
// neither its count nor its notes in the store for the rest of the job.
TEST(StoreLatch, CountsNotesAndDiscardLeavesNothingInTheStore) {
  auto pg = fsdp::init_process_group(fsdp::LaunchEnv{}, fsdp::ProcessGroupOptions().timeout(10s));
  const auto& store = fsdp::detail::GroupAccess::store(*pg);
  const std::string key = "fsdp/latch/" + pg->name() + "/save";
  {
    fsdp::StoreLatch latch(*pg, "save");
    EXPECT_EQ(latch.arrived(), 0);
    latch.arrive("pieces of rank 0");
    ASSERT_TRUE(latch.wait(1s));
    EXPECT_TRUE(store->check({key + "/note/0"}));
    latch.discard();
  }
  EXPECT_FALSE(store->check({key + "/note/0"}));
  EXPECT_FALSE(store->check({key}));
  fsdp::StoreLatch again(*pg, "save");
  EXPECT_EQ(again.arrived(), 0);
  again.arrive("again");
  ASSERT_TRUE(again.wait(1s));
  EXPECT_EQ(again.take_notes(), std::vector<std::string>{"again"});
}
