// See launcher.h. Ranks are posix_spawn()ed (never fork without exec: LibTorch runs threads),
// each in its own process group so that stopping a rank stops anything it started.
#include "launcher.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace fsdp_trainer {
namespace {

constexpr char kLauncherVar[] = "FSDP_TRAIN_LAUNCHER_PID";

std::string read_tail(const std::string& path, size_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return s.size() > max_bytes ? "..." + s.substr(s.size() - max_bytes) : s;
}

pid_t spawn_rank(const std::vector<std::string>& args, const std::vector<std::string>& env_extra,
                 const std::string& log_path) {
  std::vector<std::string> env_store;
  for (char** e = environ; *e; ++e) {
    const std::string kv(*e);
    const auto key = kv.substr(0, kv.find('='));
    bool overridden = false;
    for (const auto& x : env_extra)
      overridden = overridden || x.rfind(key + "=", 0) == 0;
    if (!overridden)
      env_store.push_back(kv);
  }
  env_store.insert(env_store.end(), env_extra.begin(), env_extra.end());
  std::vector<char*> envp, argv;
  for (auto& s : env_store)
    envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe";
  std::vector<std::string> argv_store{"fsdp-train"};
  argv_store.insert(argv_store.end(), args.begin(), args.end());
  for (auto& s : argv_store)
    argv.push_back(s.data());
  argv.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attr;
  posix_spawn_file_actions_init(&actions);
  posix_spawnattr_init(&attr);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  if (!log_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_path.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  }
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, exe.c_str(), &actions, &attr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0)
    throw std::runtime_error(std::string("cannot start a rank: ") + std::strerror(rc));
  return pid;
}

int exit_code_of(int status) {
  if (WIFEXITED(status))
    return WEXITSTATUS(status);
  if (WIFSIGNALED(status))
    return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace

void die_with_launcher() {
  const char* launcher = std::getenv(kLauncherVar);
  if (!launcher)
    return;
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  // The launcher may have died between our spawn and the prctl.
  if (std::to_string(::getppid()) != launcher)
    std::_Exit(1);
}

int launch_local(int nproc, const std::vector<std::string>& args, int threads_per_rank) {
  // The store lives here, as in torchrun's agent: port 0 picks a free port without a race.
  c10d::TCPStoreOptions store_opts;
  store_opts.port = 0;
  store_opts.isServer = true;
  store_opts.waitWorkers = false;
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", store_opts);
  const auto logs =
      std::filesystem::temp_directory_path() / ("fsdp-train-" + std::to_string(::getpid()));
  std::filesystem::create_directories(logs);

  std::vector<pid_t> pids(nproc, 0);
  std::vector<std::string> log_paths(nproc);
  for (int r = 0; r < nproc; ++r) {
    // Rank 0 speaks to the user directly; the others write to a log shown only if they fail.
    if (r > 0)
      log_paths[r] = (logs / ("rank" + std::to_string(r) + ".log")).string();
    pids[r] =
        spawn_rank(args,
                   {"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(nproc),
                    "LOCAL_RANK=" + std::to_string(r), "LOCAL_WORLD_SIZE=" + std::to_string(nproc),
                    "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(store->getPort()),
                    "TORCHELASTIC_USE_AGENT_STORE=True", "TORCHELASTIC_RESTART_COUNT=0",
                    "OMP_NUM_THREADS=" + std::to_string(threads_per_rank),
                    std::string(kLauncherVar) + "=" + std::to_string(::getpid())},
                   log_paths[r]);
  }

  int job_code = 0, first_failed = -1, running = nproc;
  std::vector<int> codes(nproc, -1);
  auto deadline = std::chrono::steady_clock::time_point::max();
  while (running > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (int r = 0; r < nproc; ++r) {
        if (pids[r] != pid)
          continue;
        codes[r] = exit_code_of(status);
        pids[r] = 0;
        --running;
        if (codes[r] != 0 && first_failed < 0) {
          first_failed = r;
          job_code = codes[r];
          // The others notice a dead peer on their next collective; give them a moment to say
          // so, then stop them.
          deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        }
      }
      continue;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      for (auto p : pids) {
        if (p > 0)
          ::kill(-p, SIGKILL);
      }
      deadline = std::chrono::steady_clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int r = 1; r < nproc; ++r) {
    if (codes[r] == 0)
      continue;
    std::string tail = read_tail(log_paths[r], 4000);
    std::fprintf(stderr, "[rank %d] exited with code %d%s\n", r, codes[r],
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
