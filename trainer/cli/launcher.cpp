// See launcher.h. The ranks are started and reaped by the library's local launcher
// (fsdp/distributed/local_launch.h), which the multi-process tests use too; what is fsdp-train's
// own is how their output reaches the user.
#include "launcher.h"

#include "program_file.h"

#include <unistd.h>

#include <algorithm>
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

// Prints a failed rank's output, each line prefixed with the rank; returns its non-empty lines.
std::vector<std::string> print_rank_output(int rank, int code, const std::string& tail) {
  std::fprintf(stderr, "[rank %d] exited with code %d%s\n", rank, code,
               tail.empty() ? "" : ", its output:");
  std::vector<std::string> lines;
  size_t start = 0;
  while (start < tail.size()) {
    const size_t end = tail.find('\n', start);
    auto line = tail.substr(start, end == std::string::npos ? std::string::npos : end - start);
    // fsdp-train's own errors name their rank already (train_main.cpp's rank_prefix): once is
    // enough.
    const std::string prefix = "[rank " + std::to_string(rank) + "] ";
    if (line.rfind(prefix, 0) == 0)
      line.erase(0, prefix.size());
    std::fprintf(stderr, "%s%s\n", prefix.c_str(), line.c_str());
    if (!line.empty())
      lines.push_back(line);
    if (end == std::string::npos)
      break;
    start = end + 1;
  }
  return lines;
}

}  // namespace

int launch_local(int nproc, const std::vector<std::string>& args, int threads_per_rank,
                 std::function<int()> rank_main,
                 std::optional<fsdp::LocalLaunchOptions::ReplicaRestarts> restarts,
                 const Nodes& nodes) {
  const auto logs =
      std::filesystem::temp_directory_path() / ("fsdp-train-" + std::to_string(::getpid()));
  std::filesystem::create_directories(logs);
  fsdp::LocalLaunchOptions o;
  o.executable = program_file();
  o.argv = {"fsdp-train"};
  o.argv.insert(o.argv.end(), args.begin(), args.end());
  o.nproc = nproc;
  o.threads_per_rank = threads_per_rank;
  o.rank_main = std::move(rank_main);
  // Rank 0 speaks to the user directly; the others write to a log shown only if they fail.
  // With fault tolerance every rank speaks: the one that writes the run's lines is the lowest
  // live rank, and while replica 0 is out it is another (each line is written whole, and the
  // others write only what concerns them: a failed step, a return).
  o.log_path = [&](int r) {
    return r == 0 || restarts ? std::string()
                              : (logs / ("rank" + std::to_string(r) + ".log")).string();
  };
  // The others notice a dead peer on their next collective; give them a moment to say so,
  // then stop them.
  o.grace_after_failure = std::chrono::seconds(5);
  o.replica_restarts = restarts;
  o.nnodes = nodes.nnodes;
  o.node_rank = nodes.node_rank;
  if (nodes.nnodes > 1) {
    o.master_addr = nodes.master_addr;
    o.master_port = nodes.master_port;
  }
  const auto result = fsdp::launch_local_ranks(o);
  int first = result.first_failed;
  int job_code = first < 0 ? 0 : result.exit_codes[static_cast<size_t>(first)];
  if (restarts) {
    std::string counts;
    for (size_t i = 0; i < result.restarts.size(); ++i)
      counts.append(i ? ", " : "").append(std::to_string(result.restarts[i]));
    std::fprintf(stderr, "fsdp-train: restarts of replicas 0..%zu: %s\n",
                 result.restarts.size() - 1, counts.c_str());
    // Fault tolerance: the job trained if a rank finished; the faults are its business. The
    // ranks whose last run failed are shown below.
    if (std::count(result.exit_codes.begin(), result.exit_codes.end(), 0) > 0) {
      job_code = 0;
      first = -1;
    }
    // No live replica held the state any more (fsdp::ReplicaStateLost): that is the job's end
    // and its cause, not the fault before it.
    const auto lost =
        std::find(result.exit_codes.begin(), result.exit_codes.end(), restarts->job_over_exit_code);
    if (job_code != 0 && restarts->job_over_exit_code >= 0 && lost != result.exit_codes.end()) {
      job_code = restarts->job_over_exit_code;
      first = static_cast<int>(lost - result.exit_codes.begin());
    }
  }
  // The rank that failed first holds the cause (a file it could not read, a bad value); the
  // others then fail in their next collective ("a peer may have died"), rank 0 on the terminal
  // already. So its output comes first, and the job's last line names it and its last line.
  std::vector<int> failed;
  if (first > 0)
    failed.push_back(first);
  for (int r = 1; r < nproc; ++r)
    if (r != first && result.exit_codes[static_cast<size_t>(r)] != 0)
      failed.push_back(r);  // with restarts: the last run of the rank failed
  std::string cause;
  for (const int r : failed) {
    const auto lines = print_rank_output(r, result.exit_codes[static_cast<size_t>(r)],
                                         read_tail(o.log_path(r), 4000));
    if (r == first && !lines.empty())
      cause = lines.back();
  }
  if (first > 0) {  // rank 0's own failure is already the first thing on the terminal
    std::fprintf(stderr, "fsdp-train: rank %d failed first (exit code %d)%s%s\n", first, job_code,
                 cause.empty() ? "" : ": ", cause.c_str());
  }
  std::filesystem::remove_all(logs);
  return job_code;
}

}  // namespace fsdp_trainer
