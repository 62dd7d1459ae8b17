// Multi-process tests: N ranks run as separate processes of the test binary itself.
//
// A test registers a worker with FSDP_WORKER(name) { ... } and runs it with run_workers(name,
// N). The parent hosts the rendezvous store the way torchrun's agent does and starts one process
// per rank with torchrun's variables plus FSDP_TEST_WORKER=name: a fork of the test process
// where it has no thread but its own (a fork of a process with threads could copy a lock one of
// them holds, and LibTorch's thread pools do not survive it), else /proc/self/exe executed anew,
// where harness/main.cpp sees that variable and runs the worker instead of GoogleTest. Separate
// processes (not threads) because a real job's failure modes (a rank that dies, a rank that
// never starts) can only be reproduced with real processes.
//
//   FSDP_WORKER(my_worker) {
//     auto pg = fsdp::init_process_group();
//     WORKER_CHECK(pg->size() == ctx.world_size) << "size " << pg->size();
//     return 0;
//   }
//   TEST(Suite, Name) { EXPECT_WORKERS_OK(fsdp::test::run_workers("my_worker", 3)); }
#pragma once

#include <gtest/gtest.h>
#include <torch/types.h>

#include <fsdp/distributed/local_launch.h>

#include <chrono>
#include <exception>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::test {

/// What a worker knows about its run (also in its environment, as under torchrun).
struct WorkerContext {
  std::string name;
  int rank = 0;
  int world_size = 1;
  /// A directory shared by all ranks of this run, removed afterwards.
  std::string tmp_dir;

  /// The environment variable `var` (set through RunOptions::env), or `fallback`.
  std::string env(const char* var, const std::string& fallback = "") const;
  int64_t env_int(const char* var, int64_t fallback) const;
  double env_double(const char* var, double fallback) const;
};

using WorkerFn = int (*)(const WorkerContext&);

/// Registers `fn` under `name`; returns true so it can initialise a static.
bool register_worker(const char* name, WorkerFn fn);

struct RunOptions {
  /// The whole run; then every rank still running is killed and timed_out is set.
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  /// Extra environment for every rank; overrides the harness's own variables.
  std::vector<std::pair<std::string, std::string>> env;
  /// Ranks not to launch (their exit code is kNotLaunched): the others see a missing rank.
  std::vector<int> absent_ranks;
  /// Fork the ranks from this process where it has no other thread, as fsdp-train --nproc does
  /// (fsdp/distributed/local_launch.h), instead of executing the binary anew (0.25 s of CPU per
  /// rank saved: LibTorch is not loaded again). The tests of failures whose process groups time
  /// out after 2-3 s used to execute their ranks: forked, a rank's connection to the store now
  /// and then took longer than that under the full suite's load (2 of 8 suites). Each connection
  /// then asked DNS for the store's name, and an unanswered query cost 1-2 s; the ranks no longer
  /// ask (trainer/cli/loopback_names.cpp), and forked they passed every stress run since
  /// (docs/design.md, "Where a test's time goes").
  bool fork_ranks = true;
  /// A fault-tolerant job's launching: a failed rank ends only its replica, which is started
  /// again (LocalLaunchOptions::replica_restarts; restarted ranks are always executed anew, and
  /// their output is appended to the rank's).
  std::optional<fsdp::LocalLaunchOptions::ReplicaRestarts> replica_restarts;
};

/// `o` with its ranks executed anew rather than forked (RunOptions::fork_ranks).
inline RunOptions executed(RunOptions o) {
  o.fork_ranks = false;
  return o;
}

/// RunOptions with these environment variables (and the default timeout).
inline RunOptions with_env(std::vector<std::pair<std::string, std::string>> vars) {
  RunOptions o;
  o.env = std::move(vars);
  return o;
}

struct RunResult {
  static constexpr int kNotLaunched = -1;

  std::string name;
  int world_size = 0;
  /// Per rank: the exit status, 128 + signal if killed by one, kNotLaunched if absent.
  std::vector<int> exit_codes;
  /// Per rank: stdout and stderr, interleaved as written.
  std::vector<std::string> outputs;
  /// Per rank: seconds from the launch of the run until the rank was reaped.
  std::vector<double> exit_seconds;
  /// Per rank: the process id (0 if absent); all of them are reaped when run_workers returns.
  std::vector<int> pids;
  /// The run hit RunOptions::timeout and the remaining ranks were killed.
  bool timed_out = false;
  /// The ranks were forks of the test binary (else: the binary executed anew).
  bool forked = false;
  /// With replica restarts: how many times each replica was restarted.
  std::vector<int> restarts;
  /// Wall time of the whole run.
  double seconds = 0;

  /// No time-out and every launched rank exited with 0.
  bool ok() const;
  /// A summary, with each failing rank's exit code and the tail of its output.
  std::string describe() const;
  /// The lines ranks printed as evidence ("... OK ..."), e.g. the largest difference seen.
  std::string evidence() const;
};

/// Runs the worker `name` as `world_size` processes and waits for all of them.
RunResult run_workers(const std::string& name, int world_size, RunOptions opts = {});

/// Runs the worker named by FSDP_TEST_WORKER in this process and returns its exit code.
/// Called by harness/main.cpp.
int worker_main(const std::string& name);

namespace detail {

// Throws from its destructor so that WORKER_CHECK(c) << a << b; can collect the message first.
class CheckFailure {
 public:
  CheckFailure(const char* file, int line, const char* condition);
  CheckFailure(const CheckFailure&) = delete;
  CheckFailure& operator=(const CheckFailure&) = delete;
  ~CheckFailure() noexcept(false);

  template <typename T>
  CheckFailure& operator<<(const T& value) {
    message_ << value;
    return *this;
  }

 private:
  std::ostringstream message_;
  int uncaught_;
};

void expect_close(const torch::Tensor& a, const torch::Tensor& b, double rtol, double atol,
                  const char* file, int line, const char* a_text, const char* b_text);

}  // namespace detail
}  // namespace fsdp::test

/// Defines `int name(const fsdp::test::WorkerContext& ctx)` and registers it; the body follows.
#define FSDP_WORKER(name)                                            \
  static int name(const ::fsdp::test::WorkerContext& ctx);           \
  [[maybe_unused]] static const bool fsdp_worker_registered_##name = \
      ::fsdp::test::register_worker(#name, &name);                   \
  static int name([[maybe_unused]] const ::fsdp::test::WorkerContext& ctx)

/// Inside a worker: throws "[rank r] file:line: cond: <streamed message>" when cond is false.
/// The switch keeps a following `else` from binding to the macro's if.
#define WORKER_CHECK(cond) \
  switch (0)               \
  case 0:                  \
  default:                 \
    if (cond) {            \
    } else                 \
      ::fsdp::test::detail::CheckFailure(__FILE__, __LINE__, #cond)

/// Inside a worker: throws, with the largest difference, unless allclose(a, b, rtol, atol).
#define WORKER_EXPECT_CLOSE(a, b, rtol, atol) \
  ::fsdp::test::detail::expect_close((a), (b), (rtol), (atol), __FILE__, __LINE__, #a, #b)

/// In a test: fails, printing every failing rank's exit code and output, unless all ranks
/// exited with 0.
#define EXPECT_WORKERS_OK(result)                              \
  do {                                                         \
    const ::fsdp::test::RunResult& fsdp_result_ = (result);    \
    EXPECT_TRUE(fsdp_result_.ok()) << fsdp_result_.describe(); \
    std::printf("%s", fsdp_result_.evidence().c_str());        \
  } while (0)
