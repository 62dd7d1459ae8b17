// The launcher side (run_workers) and the worker side (worker_main) of the multi-process tests.
//
// The ranks are started, bounded and reaped by the library's local launcher
// (fsdp/distributed/local_launch.h, as fsdp-train --nproc): forks of the test binary running the
// worker where it has no other thread (RunOptions::fork_ranks), else /proc/self/exe
// posix_spawn()ed, each in its own process group so that a kill reaches anything it started, each
// dying with the test binary (die_with_launcher), so that no rank outlives a crashed or killed test
// binary.
#include "harness/multiprocess.h"

#include <fsdp/distributed/local_launch.h>

#include <torch/torch.h>

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

namespace fsdp::test {
namespace {

constexpr char kWorkerVar[] = "FSDP_TEST_WORKER";
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
      // The first lines too: a backtrace can push the error it follows out of the tail.
      const std::string& all = outputs[static_cast<size_t>(r)];
      std::string shown = tail_lines(all, 30);
      if (shown.size() < all.size()) {
        size_t head_end = 0;  // just past the 6th line
        for (int n = 0; n < 6; ++n) {
          const size_t nl = all.find('\n', head_end);
          if (nl == std::string::npos)
            break;
          head_end = nl + 1;
        }
        if (head_end < all.size() - shown.size())
          shown = all.substr(0, head_end) + "...\n" + shown;
      }
      std::istringstream lines(shown);
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

  // The parent plays torchrun's agent (fsdp::launch_local_ranks, as fsdp-train --nproc):
  // it hosts the store and re-executes this binary as the ranks.
  fsdp::LocalLaunchOptions launch;
  launch.nproc = world_size;
  launch.threads_per_rank = 1;
  launch.absent_ranks = opts.absent_ranks;
  launch.replica_restarts = opts.replica_restarts;
  launch.timeout = opts.timeout;
  launch.env = {{kWorkerVar, name}, {kTmpDirVar, tmp_dir}};
  for (const auto& [k, v] : opts.env)
    launch.env[k] = v;
  // Executing /proc/self/exe works even if the binary was rebuilt meanwhile; the arguments are
  // ignored and only make the ranks recognisable in ps.
  launch.argv = {std::filesystem::read_symlink("/proc/self/exe").string(), "--fsdp-worker=" + name};
  launch.log_path = [&](int r) { return tmp_dir + "/rank" + std::to_string(r) + ".log"; };
  // RunOptions::fork_ranks: forked from this process where it has no other thread, the worker
  // starts without loading LibTorch again (fsdp/distributed/local_launch.h).
  if (opts.fork_ranks)
    launch.rank_main = [name] { return worker_main(name); };
  const auto start = std::chrono::steady_clock::now();
  const auto launched = fsdp::launch_local_ranks(launch);
  result.exit_codes = launched.exit_codes;
  result.exit_seconds = launched.exit_seconds;
  result.pids = launched.pids;
  result.timed_out = launched.timed_out;
  result.forked = launched.forked;
  result.restarts = launched.restarts;
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
  // Die with the test binary, even if it is SIGKILLed (or exit if it already died).
  fsdp::die_with_launcher();
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
