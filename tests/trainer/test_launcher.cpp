// fsdp-train --nproc's launcher (trainer/cli/launcher.h): how a failed job's output reaches the
// user. The rank that failed first holds the cause; the others fail after it in a collective.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

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

// training.bind_cores: the CPUs split in order among the local ranks, every CPU given once,
// nothing when there are more ranks than CPUs.
TEST(CoreBinding, EachLocalRankGetsItsOwnShareInOrder) {
  using fsdp_trainer::core_share;
  const std::vector<int> two{0, 1}, eight{0, 1, 2, 3, 8, 9, 10, 11};
  EXPECT_EQ(core_share(two, 0, 2), std::vector<int>{0});
  EXPECT_EQ(core_share(two, 1, 2), std::vector<int>{1});
  EXPECT_EQ(core_share(two, 0, 1), two);
  EXPECT_TRUE(core_share(two, 0, 3).empty());
  EXPECT_TRUE(core_share(two, 2, 2).empty());
  EXPECT_EQ(core_share(eight, 1, 2), (std::vector<int>{8, 9, 10, 11}));
  std::vector<int> all;  // 8 CPUs among 3 ranks: 2, 3 and 3 of them, each once
  for (int r = 0; r < 3; ++r) {
    const auto share = core_share(eight, r, 3);
    EXPECT_GE(share.size(), 2u);
    all.insert(all.end(), share.begin(), share.end());
  }
  EXPECT_EQ(all, eight);
  EXPECT_EQ(fsdp_trainer::cpu_list(eight), "0-3,8-11");
  EXPECT_EQ(fsdp_trainer::cpu_list({0, 2, 3}), "0,2-3");
}
