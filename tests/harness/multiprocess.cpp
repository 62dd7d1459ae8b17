// The launcher side (run_workers) and the worker side (worker_main) of the multi-process tests.
//
// The parent never forks without exec: it posix_spawn()s /proc/self/exe, which is safe in a
// process that already runs LibTorch and TCPStore threads. Every child gets its own process
// group so that a kill reaches anything it started, and asks the kernel to kill it if the parent
// dies, so that no rank outlives a crashed or killed test binary.
#include "harness/multiprocess.h"

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace fsdp::test {
namespace {

constexpr char kWorkerVar[] = "FSDP_TEST_WORKER";
constexpr char kParentVar[] = "FSDP_TEST_PARENT_PID";
constexpr char kTmpDirVar[] = "FSDP_TEST_TMPDIR";

std::map<std::string, WorkerFn>& workers() {
  static std::map<std::string, WorkerFn> w;
  return w;
}

// The rank of this worker process, for the "[rank r]" prefix of check failures.
int g_worker_rank = -1;

std::string rank_prefix() {
  return g_worker_rank >= 0 ? "[rank " + std::to_string(g_worker_rank) + "] " : "";
}

const char* base_name(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string tail_lines(const std::string& s, int lines) {
  size_t pos = s.size();
  if (pos > 0 && s[pos - 1] == '\n')
    --pos;
  for (int n = 0; n < lines && pos > 0; ++n) {
    pos = s.rfind('\n', pos - 1);
    if (pos == std::string::npos)
      return s;
  }
  return pos == 0 ? s : s.substr(pos + 1);
}

double since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Children still running, killed on every way out of run_workers (a gtest ASSERT, an
// exception); a crash of the parent is covered by the children's parent-death signal.
class ChildGuard {
 public:
  void add(pid_t pid) { pids_.push_back(pid); }
  void reaped(pid_t pid) { pids_.erase(std::remove(pids_.begin(), pids_.end(), pid), pids_.end()); }
  void kill_all() {
    for (pid_t pid : pids_) {
      ::kill(-pid, SIGKILL);  // its process group: anything the rank started
      ::kill(pid, SIGKILL);   // in case it was not yet its own group leader
    }
  }
  ~ChildGuard() {
    kill_all();
    for (pid_t pid : pids_) {
      int status = 0;
      while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
    }
  }

 private:
  std::vector<pid_t> pids_;
};

// The run's logs and shared files; kept for inspection when FSDP_TEST_KEEP_LOGS is set.
struct TmpDir {
  std::string path;
  TmpDir() {
    path = (std::filesystem::temp_directory_path() / "fsdp-test-XXXXXX").string();
    if (::mkdtemp(path.data()) == nullptr) {
      throw std::runtime_error("mkdtemp: " + std::string(std::strerror(errno)));
    }
  }
  ~TmpDir() {
    if (std::getenv("FSDP_TEST_KEEP_LOGS") != nullptr) {
      std::fprintf(stderr, "worker logs kept in %s\n", path.c_str());
      return;
    }
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TmpDir(const TmpDir&) = delete;
  TmpDir& operator=(const TmpDir&) = delete;
};

int decode_status(int status) {
  if (WIFEXITED(status))
    return WEXITSTATUS(status);
  if (WIFSIGNALED(status))
    return 128 + WTERMSIG(status);
  return 255;
}

std::vector<std::string> child_environment(const std::map<std::string, std::string>& set) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry(*e);
    const std::string key = entry.substr(0, entry.find('='));
    // A test binary run under SLURM or torchrun must not leak its own rank into the workers.
    if (set.count(key) || key.rfind("SLURM_", 0) == 0 || key == "GROUP_RANK" ||
        key == "LOCAL_RANK" || key == "TORCHELASTIC_RUN_ID") {
      continue;
    }
    env.push_back(std::move(entry));
  }
  for (const auto& [k, v] : set)
    env.push_back(k + "=" + v);
  return env;
}

pid_t spawn_rank(const std::vector<std::string>& env, const std::string& log_path,
                 const std::string& label) {
  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attr;
  posix_spawn_file_actions_init(&actions);
  posix_spawnattr_init(&attr);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  // Own process group; default signal dispositions and an empty mask, whatever the parent
  // (gtest, ctest) has set.
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setflags(&attr,
                           POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);

  std::vector<char*> envp;
  for (const auto& e : env)
    envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  // Executing /proc/self/exe works even if the binary was rebuilt meanwhile; the arguments
  // are ignored and only make the ranks recognisable in ps.
  char exe[] = "/proc/self/exe";
  std::string arg0 = std::filesystem::read_symlink(exe).string();
  std::string arg1 = label;
  char* argv[] = {arg0.data(), arg1.data(), nullptr};
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, exe, &actions, &attr, argv, envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0)
    throw std::runtime_error(std::string("posix_spawn: ") + std::strerror(rc));
  return pid;
}

}  // namespace

// ---- WorkerContext ----------------------------------------------------------------------------

std::string WorkerContext::env(const char* var, const std::string& fallback) const {
  const char* v = std::getenv(var);
  return v ? std::string(v) : fallback;
}

int64_t WorkerContext::env_int(const char* var, int64_t fallback) const {
  const char* v = std::getenv(var);
  if (!v)
    return fallback;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  if (*v == '\0' || *end != '\0') {
    throw std::runtime_error(rank_prefix() + var + "=\"" + v + "\" is not an integer");
  }
  return x;
}

double WorkerContext::env_double(const char* var, double fallback) const {
  const char* v = std::getenv(var);
  if (!v)
    return fallback;
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  if (*v == '\0' || *end != '\0') {
    throw std::runtime_error(rank_prefix() + var + "=\"" + v + "\" is not a number");
  }
  return x;
}

bool register_worker(const char* name, WorkerFn fn) {
  auto [it, inserted] = workers().emplace(name, fn);
  if (!inserted) {
    std::fprintf(stderr, "FSDP_WORKER(%s) is defined twice\n", name);
    std::abort();
  }
  return true;
}

// ---- RunResult --------------------------------------------------------------------------------

bool RunResult::ok() const {
  if (timed_out || static_cast<int>(exit_codes.size()) != world_size)
    return false;
  for (int code : exit_codes) {
    if (code != 0 && code != kNotLaunched)
      return false;
  }
  return true;
}

std::string RunResult::evidence() const {
  std::ostringstream os;
  for (const auto& out : outputs) {
    std::istringstream lines(out);
    std::string line;
    while (std::getline(lines, line)) {
      if (line.find(" OK") != std::string::npos)
        os << "  " << line << "\n";
    }
  }
  return os.str();
}

std::string RunResult::describe() const {
  std::ostringstream os;
  os << "worker \"" << name << "\" on " << world_size << " rank(s), " << seconds << " s";
  if (timed_out)
    os << ", TIMED OUT (remaining ranks were killed)";
  os << "\n";
  for (int r = 0; r < static_cast<int>(exit_codes.size()); ++r) {
    const int code = exit_codes[static_cast<size_t>(r)];
    if (code == kNotLaunched) {
      os << "  rank " << r << ": not launched\n";
      continue;
    }
    os << "  rank " << r << ": ";
    if (code > 128 && code < 128 + 65) {
      os << "killed by signal " << code - 128 << " (" << strsignal(code - 128) << ")";
    } else {
      os << "exit code " << code;
    }
    os << " after " << exit_seconds[static_cast<size_t>(r)] << " s\n";
    // On a time-out the ranks that did not fail are the interesting ones too.
    if (code != 0 || timed_out) {
      const std::string tail = tail_lines(outputs[static_cast<size_t>(r)], 30);
      std::istringstream lines(tail);
      std::string l;
      while (std::getline(lines, l))
        os << "    | " << l << "\n";
    }
  }
  return os.str();
}

// ---- run_workers ------------------------------------------------------------------------------

RunResult run_workers(const std::string& name, int world_size, RunOptions opts) {
  if (!workers().count(name))
    throw std::invalid_argument("no FSDP_WORKER named " + name);
  if (world_size < 1)
    throw std::invalid_argument("run_workers: world_size < 1");

  RunResult result;
  result.name = name;
  result.world_size = world_size;
  result.exit_codes.assign(static_cast<size_t>(world_size), RunResult::kNotLaunched);
  result.outputs.assign(static_cast<size_t>(world_size), "");
  result.exit_seconds.assign(static_cast<size_t>(world_size), 0.0);
  result.pids.assign(static_cast<size_t>(world_size), 0);

  TmpDir tmp;
  const std::string& tmp_dir = tmp.path;

  // The parent plays torchrun's agent: it hosts the store and the ranks connect as clients.
  c10d::TCPStoreOptions store_opts;
  store_opts.port = 0;
  store_opts.isServer = true;
  store_opts.waitWorkers = false;
  store_opts.timeout = opts.timeout;
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", store_opts);

  const auto start = std::chrono::steady_clock::now();
  {
    ChildGuard guard;
    std::vector<pid_t> running;
    for (int r = 0; r < world_size; ++r) {
      if (std::find(opts.absent_ranks.begin(), opts.absent_ranks.end(), r) !=
          opts.absent_ranks.end()) {
        continue;
      }
      std::map<std::string, std::string> vars{
          {"RANK", std::to_string(r)},
          {"WORLD_SIZE", std::to_string(world_size)},
          {"LOCAL_RANK", std::to_string(r)},
          {"LOCAL_WORLD_SIZE", std::to_string(world_size)},
          {"MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", std::to_string(store->getPort())},
          {"TORCHELASTIC_USE_AGENT_STORE", "True"},
          {"TORCHELASTIC_RESTART_COUNT", "0"},
          {"OMP_NUM_THREADS", "1"},
          {kWorkerVar, name},
          {kParentVar, std::to_string(::getpid())},
          {kTmpDirVar, tmp_dir},
      };
      for (const auto& [k, v] : opts.env)
        vars[k] = v;
      const std::string log = tmp_dir + "/rank" + std::to_string(r) + ".log";
      const pid_t pid = spawn_rank(child_environment(vars), log,
                                   "--fsdp-worker=" + name + ":rank" + std::to_string(r));
      guard.add(pid);
      running.push_back(pid);
      result.pids[static_cast<size_t>(r)] = pid;
    }

    auto rank_of = [&](pid_t pid) {
      return static_cast<size_t>(std::find(result.pids.begin(), result.pids.end(), pid) -
                                 result.pids.begin());
    };
    const auto deadline = start + opts.timeout;
    while (!running.empty()) {
      bool reaped_any = false;
      for (size_t i = 0; i < running.size();) {
        int status = 0;
        const pid_t pid = running[i];
        if (::waitpid(pid, &status, WNOHANG) == pid) {
          result.exit_codes[rank_of(pid)] = decode_status(status);
          result.exit_seconds[rank_of(pid)] = since(start);
          guard.reaped(pid);
          running.erase(running.begin() + static_cast<std::ptrdiff_t>(i));
          reaped_any = true;
        } else {
          ++i;
        }
      }
      if (running.empty())
        break;
      if (std::chrono::steady_clock::now() >= deadline) {
        result.timed_out = true;
        guard.kill_all();
        for (pid_t pid : running) {
          int status = 0;
          while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
          }
          result.exit_codes[rank_of(pid)] = decode_status(status);
          result.exit_seconds[rank_of(pid)] = since(start);
          guard.reaped(pid);
        }
        running.clear();
        break;
      }
      if (!reaped_any)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  result.seconds = since(start);

  for (int r = 0; r < world_size; ++r) {
    if (result.pids[static_cast<size_t>(r)] != 0) {
      result.outputs[static_cast<size_t>(r)] =
          read_file(tmp_dir + "/rank" + std::to_string(r) + ".log");
    }
  }
  return result;
}

// ---- The worker side --------------------------------------------------------------------------

int worker_main(const std::string& name) {
  // Die with the test binary, even if it is SIGKILLed; then check it did not already die
  // between our exec and this call.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (const char* parent = std::getenv(kParentVar)) {
    if (std::to_string(::getppid()) != parent)
      return 1;
  }
  WorkerContext ctx;
  ctx.name = name;
  const char* rank = std::getenv("RANK");
  const char* world = std::getenv("WORLD_SIZE");
  ctx.rank = rank ? std::atoi(rank) : 0;
  ctx.world_size = world ? std::atoi(world) : 1;
  if (const char* dir = std::getenv(kTmpDirVar))
    ctx.tmp_dir = dir;
  g_worker_rank = ctx.rank;

  auto it = workers().find(name);
  if (it == workers().end()) {
    std::fprintf(stderr, "[rank %d] no FSDP_WORKER named \"%s\" in this binary\n", ctx.rank,
                 name.c_str());
    return 2;
  }
  // Lines reach the log as they are written, so a rank that is killed still shows its last words.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  torch::set_num_threads(1);
  int code = 1;
  try {
    code = it->second(ctx);
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    // Our own messages already carry the rank; c10's do not.
    std::fprintf(stderr, "%s%s\n", msg.rfind("[rank ", 0) == 0 ? "" : rank_prefix().c_str(),
                 msg.c_str());
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    std::fprintf(stderr, "%s%s\n", msg.rfind("[rank ", 0) == 0 ? "" : rank_prefix().c_str(),
                 msg.c_str());
  }
  std::fflush(stdout);
  std::fflush(stderr);
  return code;
}

// ---- Checks -----------------------------------------------------------------------------------

namespace detail {

CheckFailure::CheckFailure(const char* file, int line, const char* condition)
    : uncaught_(std::uncaught_exceptions()) {
  message_ << rank_prefix() << base_name(file) << ":" << line << ": " << condition << ": ";
}

CheckFailure::~CheckFailure() noexcept(false) {
  // Never throw while another exception unwinds (that would terminate).
  if (std::uncaught_exceptions() > uncaught_)
    return;
  throw std::runtime_error(message_.str());
}

void expect_close(const torch::Tensor& a, const torch::Tensor& b, double rtol, double atol,
                  const char* file, int line, const char* a_text, const char* b_text) {
  auto fail = [&](const std::string& why) {
    std::ostringstream os;
    os << rank_prefix() << base_name(file) << ":" << line << ": " << a_text << " vs " << b_text
       << ": " << why;
    throw std::runtime_error(os.str());
  };
  if (!a.defined() || !b.defined())
    fail("undefined tensor");
  if (a.sizes() != b.sizes()) {
    std::ostringstream os;
    os << "sizes differ: " << a.sizes() << " vs " << b.sizes();
    fail(os.str());
  }
  if (a.numel() == 0)
    return;
  // In double on the CPU so that mixed dtypes compare and the printed difference is exact.
  auto x = a.detach().to(torch::kCPU, torch::kDouble);
  auto y = b.detach().to(torch::kCPU, torch::kDouble);
  if (torch::allclose(x, y, rtol, atol))
    return;
  auto diff = (x - y).abs().reshape({-1});
  // NaN in either makes the difference NaN: report it as infinitely far.
  diff = torch::where(torch::isnan(diff), torch::full_like(diff, INFINITY), diff);
  const int64_t at = diff.argmax().item<int64_t>();
  const auto bad = (diff > atol + rtol * y.abs().reshape({-1})).sum().item<int64_t>();
  std::ostringstream os;
  os << "not close (rtol " << rtol << ", atol " << atol
     << "): max |a - b| = " << diff[at].item<double>() << " at flat index " << at
     << " (a = " << x.reshape({-1})[at].item<double>()
     << ", b = " << y.reshape({-1})[at].item<double>() << "); " << bad << " of " << diff.numel()
     << " elements out of tolerance";
  fail(os.str());
}

}  // namespace detail
}  // namespace fsdp::test
