// See launcher.h. The ranks are started and reaped by the library's local launcher
// (fsdp/distributed/local_launch.h), which the multi-process tests use too; what is fsdp-train's
// own is how their output reaches the user.
#include "launcher.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <utility>

#include <fsdp/distributed/local_launch.h>

namespace fsdp_trainer {
namespace {

std::string read_tail(const std::string& path, size_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return s.size() > max_bytes ? "..." + s.substr(s.size() - max_bytes) : s;
}

}  // namespace

int launch_local(int nproc, const std::vector<std::string>& args, int threads_per_rank,
                 std::function<int()> rank_main) {
  const auto logs =
      std::filesystem::temp_directory_path() / ("fsdp-train-" + std::to_string(::getpid()));
  std::filesystem::create_directories(logs);
  fsdp::LocalLaunchOptions o;
  o.argv = {"fsdp-train"};
  o.argv.insert(o.argv.end(), args.begin(), args.end());
  o.nproc = nproc;
  o.threads_per_rank = threads_per_rank;
  o.rank_main = std::move(rank_main);
  // Rank 0 speaks to the user directly; the others write to a log shown only if they fail.
  o.log_path = [&](int r) {
    return r == 0 ? std::string() : (logs / ("rank" + std::to_string(r) + ".log")).string();
  };
  // The others notice a dead peer on their next collective; give them a moment to say so,
  // then stop them.
  o.grace_after_failure = std::chrono::seconds(5);
  const auto result = fsdp::launch_local_ranks(o);
  const std::vector<int>& codes = result.exit_codes;
  const int job_code =
      result.first_failed < 0 ? 0 : codes[static_cast<size_t>(result.first_failed)];
  for (int r = 1; r < nproc; ++r) {
    if (codes[static_cast<size_t>(r)] == 0)
      continue;
    std::string tail = read_tail(o.log_path(r), 4000);
    std::fprintf(stderr, "[rank %d] exited with code %d%s\n", r, codes[static_cast<size_t>(r)],
                 tail.empty() ? "" : ", its output:");
    size_t start = 0;
    while (start < tail.size()) {
      const size_t end = tail.find('\n', start);
      std::fprintf(
          stderr, "[rank %d] %s\n", r,
          tail.substr(start, end == std::string::npos ? std::string::npos : end - start).c_str());
      if (end == std::string::npos)
        break;
      start = end + 1;
    }
  }
  std::filesystem::remove_all(logs);
  return job_code;
}

}  // namespace fsdp_trainer
