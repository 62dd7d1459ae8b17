// fsdp-train --nproc's launcher (trainer/cli/launcher.h): how a failed job's output reaches the
// user. The rank that failed first holds the cause; the others fail after it in a collective.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sched.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "cli/core_binding.h"
#include "cli/launcher.h"
#include "harness/files.h"

namespace {

// What `fn` writes to this process's stderr (its ranks' included: they inherit it).
template <typename Fn>
std::string stderr_of(Fn&& fn, const std::string& file) {
  std::fflush(stderr);
  const int saved = ::dup(2);
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ::dup2(fd, 2);
  ::close(fd);
  fn();
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(saved);
  return fsdp::test::file_bytes(file);
}

TEST(Launcher, TheRankThatFailedFirstIsShownFirstAndNamedLast) {
  fsdp::test::TempDir dir("launcher");
  int code = -1;
  const std::string out = stderr_of(
      [&] {
        code = fsdp_trainer::launch_local(3, {"--unused"}, 1, [] {
          const int rank = std::atoi(std::getenv("RANK"));
          if (rank == 2) {  // prefixed as fsdp-train's errors are: shown prefixed once
            std::fprintf(stderr, "[rank 2] config error: data/x.bin: cannot open\n");
            return 2;
          }
          // The others fail afterwards, as a collective with a dead peer does.
          std::this_thread::sleep_for(std::chrono::milliseconds(500));
          std::fprintf(stderr, "rank %d: barrier failed, a peer may have died\n", rank);
          return 1;
        });
      },
      dir.path() + "/stderr");
  EXPECT_EQ(code, 2) << out;  // the first failure's code
  const auto cause = out.find("[rank 2] exited with code 2");
  const auto consequence = out.find("[rank 1] exited with code 1");
  ASSERT_NE(cause, std::string::npos) << out;
  ASSERT_NE(consequence, std::string::npos) << out;
  EXPECT_LT(cause, consequence) << out;
  EXPECT_NE(out.find("\n[rank 2] config error: data/x.bin: cannot open\n"), std::string::npos)
      << out;
  EXPECT_EQ(out.find("[rank 2] [rank 2]"), std::string::npos) << out;
  const std::string last =
      "fsdp-train: rank 2 failed first (exit code 2): config error: data/x.bin: cannot open\n";
  ASSERT_GE(out.size(), last.size()) << out;
  EXPECT_EQ(out.substr(out.size() - last.size()), last) << out;
}

TEST(Launcher, ASucceedingJobSaysNothingOfItsRanks) {
  fsdp::test::TempDir dir("launcher");
  int code = -1;
  const std::string out =
      stderr_of([&] { code = fsdp_trainer::launch_local(2, {"--unused"}, 1, [] { return 0; }); },
                dir.path() + "/stderr");
  EXPECT_EQ(code, 0);
  EXPECT_EQ(out, "");
}

}  // namespace

// training.bind_cores: whole cores split in order, the same number to each local rank (the
// remainder unused), every hardware thread of a core to the same rank, nothing when there are
// more ranks than cores.
TEST(CoreBinding, EachLocalRankGetsItsOwnWholeCoresInOrder) {
  using fsdp_trainer::core_share;
  const std::vector<std::vector<int>> two{{0}, {1}}, three{{0}, {1}, {2}};
  EXPECT_EQ(core_share(two, 0, 2), std::vector<int>{0});
  EXPECT_EQ(core_share(two, 1, 2), std::vector<int>{1});
  EXPECT_EQ(core_share(two, 0, 1), (std::vector<int>{0, 1}));
  EXPECT_TRUE(core_share(two, 0, 3).empty());
  EXPECT_TRUE(core_share(two, 2, 2).empty());
  EXPECT_EQ(core_share(three, 1, 2), std::vector<int>{1});  // core 2 left over
  // 4 cores of 2 hardware threads numbered as Linux does (c and c + 4): rank 0 gets both threads
  // of cores 0 and 1, never a sibling of rank 1's.
  const std::vector<std::vector<int>> smt{{0, 4}, {1, 5}, {2, 6}, {3, 7}};
  EXPECT_EQ(core_share(smt, 0, 2), (std::vector<int>{0, 1, 4, 5}));
  EXPECT_EQ(core_share(smt, 1, 2), (std::vector<int>{2, 3, 6, 7}));
  EXPECT_EQ(fsdp_trainer::cpu_list({0, 1, 2, 3, 8, 9, 10, 11}), "0-3,8-11");
  EXPECT_EQ(fsdp_trainer::cpu_list({0, 2, 3}), "0,2-3");
  // This machine's cores hold each CPU once.
  std::vector<int> cpus;
  for (int c = 0; c < 4; ++c)
    cpus.push_back(c);
  std::vector<int> seen;
  for (const auto& core : fsdp_trainer::physical_cores(cpus))
    seen.insert(seen.end(), core.begin(), core.end());
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, cpus);
}

// bind_to_cores sets the mask of a thread that existed before it and of one started after it
// (in a child process, so that this one keeps its CPUs).
TEST(CoreBinding, EveryThreadBeforeAndAfterTakesTheShare) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  ASSERT_EQ(::sched_getaffinity(0, sizeof allowed, &allowed), 0);
  if (CPU_COUNT(&allowed) < 2)
    GTEST_SKIP() << "one CPU: nothing to split";
  const pid_t child = ::fork();
  if (child == 0) {
    std::atomic<bool> stop{false};
    std::atomic<pid_t> early_tid{0};
    std::thread early([&] {
      early_tid = static_cast<pid_t>(::syscall(SYS_gettid));
      while (!stop)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    });
    while (early_tid == 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::vector<int> share;
    const std::string said = fsdp_trainer::bind_to_cores(1, 2, &share);
    cpu_set_t want;
    CPU_ZERO(&want);
    for (int c : share)
      CPU_SET(c, &want);
    cpu_set_t early_mask, late_mask;
    CPU_ZERO(&early_mask);
    CPU_ZERO(&late_mask);
    const bool early_ok = ::sched_getaffinity(early_tid, sizeof early_mask, &early_mask) == 0 &&
                          CPU_EQUAL(&early_mask, &want);
    bool late_ok = false;
    std::thread late([&] {
      late_ok =
          ::sched_getaffinity(0, sizeof late_mask, &late_mask) == 0 && CPU_EQUAL(&late_mask, &want);
    });
    late.join();
    stop = true;
    early.join();
    const bool said_ok =
        said.rfind("on CPUs ", 0) == 0 && !share.empty() && CPU_COUNT(&want) < CPU_COUNT(&allowed);
    ::_exit(said_ok && early_ok && late_ok ? 0 : 1 + said_ok + 2 * early_ok + 4 * late_ok);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1 + said ok + 2 x earlier thread ok + 4 x later one ok";
}
