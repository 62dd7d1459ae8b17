// See include/fsdp/distributed/local_launch.h.
#include <fsdp/distributed/local_launch.h>

#include <ATen/Parallel.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace fsdp {
namespace {

// The launcher's pid, for die_with_launcher().
constexpr char kLauncherVar[] = "FSDP_LAUNCHER_PID";

double since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int decode_status(int status) {
  if (WIFEXITED(status))
    return WEXITSTATUS(status);
  if (WIFSIGNALED(status))
    return 128 + WTERMSIG(status);
  return 255;
}

std::vector<std::string> rank_environment(const std::map<std::string, std::string>& set) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry(*e);
    const std::string key = entry.substr(0, entry.find('='));
    // A launcher itself run under SLURM or torchrun must not leak its own rank into the ranks.
    if (set.count(key) || key.rfind("SLURM_", 0) == 0 || key == "GROUP_RANK" ||
        key == "TORCHELASTIC_RUN_ID")
      continue;
    env.push_back(std::move(entry));
  }
  for (const auto& [k, v] : set)
    env.push_back(k + "=" + v);
  return env;
}

pid_t spawn(const std::string& exe, const std::vector<std::string>& args,
            const std::vector<std::string>& env, const std::string& log_path, bool append) {
  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attr;
  posix_spawn_file_actions_init(&actions);
  posix_spawnattr_init(&attr);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  if (!log_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_path.c_str(),
                                     O_WRONLY | O_CREAT | (append ? O_APPEND : O_TRUNC), 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  }
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setflags(&attr,
                           POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  std::vector<std::string> argv_store = args.empty() ? std::vector<std::string>{exe} : args;
  std::vector<char*> argv, envp;
  for (auto& a : argv_store)
    argv.push_back(a.data());
  argv.push_back(nullptr);
  for (const auto& e : env)
    envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, exe.c_str(), &actions, &attr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0)
    throw std::runtime_error("cannot start a rank (" + exe + "): " + std::strerror(rc));
  return pid;
}

// In a fork()ed copy of the launcher: becomes the rank that spawn() would have started (its own
// process group, default signals, stdin from /dev/null, its log, exactly its environment, dead
// with the launcher), runs rank_main and exits with its status.
[[noreturn]] void run_forked_rank(const LocalLaunchOptions& o, const std::vector<std::string>& env,
                                  const std::string& log_path, int listen_fd, const int gate[2],
                                  pid_t launcher) {
  ::setpgid(0, 0);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher)  // the launcher died before the prctl
    std::_Exit(1);
  // Wait until the launcher's store is up (the gate's write end closed, in every process):
  // connecting earlier, a rank waited on a listening socket nobody answered yet, and under load
  // ran out of a short rendezvous timeout.
  ::close(gate[1]);
  char byte;
  while (::read(gate[0], &byte, 1) < 0 && errno == EINTR) {
  }
  ::close(gate[0]);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sig != SIGKILL && sig != SIGSTOP)
      ::signal(sig, SIG_DFL);
  }
  ::close(listen_fd);  // the store's socket is the launcher's
  const int in = ::open("/dev/null", O_RDONLY);
  ::dup2(in, STDIN_FILENO);
  ::close(in);
  if (!log_path.empty()) {
    const int out = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (out < 0) {
      std::fprintf(stderr, "cannot open the rank's log %s: %s\n", log_path.c_str(),
                   std::strerror(errno));
      std::_Exit(127);
    }
    ::dup2(out, STDOUT_FILENO);
    ::dup2(out, STDERR_FILENO);
    ::close(out);
  }
  ::clearenv();
  for (const auto& e : env) {
    const size_t eq = e.find('=');
    ::setenv(e.substr(0, eq).c_str(), eq == std::string::npos ? "" : e.c_str() + eq + 1, 1);
  }
  at::set_num_threads(o.threads_per_rank);
  int code = 1;
  try {
    code = o.rank_main();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "a rank ended with an unknown exception\n");
  }
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(code);
}

// Starts one rank: a fork()ed copy running rank_main, or `executable`.
pid_t start_rank(const LocalLaunchOptions& o, bool fork_rank, const std::vector<std::string>& env,
                 const std::string& log_path, int listen_fd, const int gate[2]) {
  if (!fork_rank)
    return spawn(o.executable, o.argv, env, log_path, /*append=*/false);
  const pid_t launcher = ::getpid();
  std::fflush(nullptr);  // or the copy would print what the launcher buffered
  const pid_t pid = ::fork();
  if (pid < 0)
    throw std::runtime_error(std::string("cannot start a rank: fork: ") + std::strerror(errno));
  if (pid == 0)
    run_forked_rank(o, env, log_path, listen_fd, gate, launcher);
  ::setpgid(pid, pid);  // as the child does: whichever runs first, kill(-pid) then reaches it
  return pid;
}

// The ranks still running, killed and reaped on every way out of launch_local_ranks.
class Children {
 public:
  void add(pid_t pid) { pids_.push_back(pid); }
  void reaped(pid_t pid) { std::erase(pids_, pid); }
  const std::vector<pid_t>& running() const { return pids_; }
  void kill_all() const {
    for (pid_t pid : pids_) {
      ::kill(-pid, SIGKILL);  // its process group: anything the rank started
      ::kill(pid, SIGKILL);   // in case it was not yet its own group leader
    }
  }
  ~Children() {
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

// What forked ranks wait at until the store is up: a pipe whose write end the launcher closes
// (open() or, on a way out before it, the destructor); each rank then reads end-of-file.
class StoreGate {
 public:
  StoreGate() {
    if (::pipe2(fds_, O_CLOEXEC) != 0)
      throw std::runtime_error(std::string("launch_local_ranks: pipe: ") + std::strerror(errno));
  }
  StoreGate(const StoreGate&) = delete;
  StoreGate& operator=(const StoreGate&) = delete;
  ~StoreGate() {
    open();
    ::close(fds_[0]);
  }
  const int* fds() const { return fds_; }
  void open() {
    if (fds_[1] >= 0)
      ::close(fds_[1]);
    fds_[1] = -1;
  }

 private:
  int fds_[2] = {-1, -1};
};

// LocalLaunchOptions::replica_restarts: each replica's course from a failed rank to its restart.
class ReplicaRestarter {
 public:
  // `first_rank`: this node's first global rank.
  ReplicaRestarter(const LocalLaunchOptions& o, int k, int first_rank, LocalLaunchResult& result)
      : o_(o),
        k_(k),
        first_rank_(first_rank),
        result_(result),
        replicas_(static_cast<size_t>(o.nproc / k)) {
    result_.restarts.assign(replicas_.size(), 0);
  }

  // Whether a replica waits to be restarted (the job is not over while one does).
  bool pending() const {
    return std::any_of(replicas_.begin(), replicas_.end(),
                       [](const Replica& q) { return q.state == State::kRestartAt; });
  }

  // Rank `r` ended with `code`.
  void ended(int r, int code) {
    if (code == 0) {  // the job is ending: a replica that fails now is not started again
      finished_ = true;
      return;
    }
    if (code == o_.replica_restarts->job_over_exit_code && !finished_) {
      finished_ = true;  // the job cannot go on: nothing is started again
      std::fprintf(stderr,
                   "fsdp launch: rank %d ended (exit %d): the job cannot go on, no replica "
                   "is started again\n",
                   first_rank_ + r, code);
    }
    auto& q = replicas_[static_cast<size_t>(r / k_)];
    if (code == o_.replica_restarts->refused_input_exit_code)
      q.refused_input = true;  // this run of the replica
    if (q.state != State::kRunning)
      return;
    q.state = State::kEnding;
    q.kill_at = Clock::now() + o_.replica_restarts->grace;
    const int g = first_rank_ + r / k_ * k_;  // the replica's first global rank
    std::fprintf(stderr, "fsdp launch: rank %d ended (%s %d): replica %d (ranks %d-%d) leaves\n",
                 first_rank_ + r, code > 128 ? "signal" : "exit", code > 128 ? code - 128 : code,
                 g / k_, g, g + k_ - 1);
  }

  // Kills what outstayed its grace and starts what is due: incarnation(replica) numbers the
  // start (-1: not now, the store is out of reach), start(local rank, incarnation) starts a rank
  // and returns its pid.
  template <typename Incarnation, typename Start>
  void poll(Children& children, Incarnation&& incarnation_of, Start&& start) {
    const auto now = Clock::now();
    for (size_t i = 0; i < replicas_.size(); ++i) {
      auto& q = replicas_[i];
      const int first = static_cast<int>(i) * k_;
      if (q.state == State::kEnding) {
        bool running = false;
        for (int r = first; r < first + k_; ++r) {
          const pid_t pid = result_.pids[static_cast<size_t>(r)];
          if (std::count(children.running().begin(), children.running().end(), pid) == 0)
            continue;
          running = true;
          if (now >= q.kill_at) {
            ::kill(-pid, SIGKILL);
            ::kill(pid, SIGKILL);
          }
        }
        if (running)
          continue;
        const int used = result_.restarts[i];
        // A refusal can be a passing read error (EIO on a network file system): the replica
        // is started once more, and not after two runs in a row that refused.
        q.refusals_in_a_row = q.refused_input ? q.refusals_in_a_row + 1 : 0;
        q.refused_input = false;
        const bool refuses = q.refusals_in_a_row >= 2;
        if (finished_ || refuses || used >= o_.replica_restarts->max_restarts) {
          q.state = State::kGone;
          std::fprintf(stderr, "fsdp launch: replica %d not restarted (%s)\n",
                       (first_rank_ + first) / k_,
                       finished_ ? "the job is ending"
                       : refuses ? "its ranks refused their input twice in a row"
                                 : "no restarts left");
          continue;
        }
        q.state = State::kRestartAt;
        q.restart_at = now + o_.replica_restarts->delay;
      }
      if (q.state == State::kRestartAt && now >= q.restart_at) {
        if (finished_) {
          q.state = State::kGone;
          continue;
        }
        const int global = (first_rank_ + first) / k_;
        const int incarnation = incarnation_of(global);
        if (incarnation < 0) {  // tried again in a second
          q.restart_at = now + std::chrono::seconds(1);
          continue;
        }
        ++result_.restarts[i];
        std::string pids;
        for (int r = first; r < first + k_; ++r)
          pids += (r > first ? ", " : "") + std::to_string(start(r, incarnation));
        std::fprintf(stderr, "fsdp launch: replica %d restarted (incarnation %d, pid%s %s)\n",
                     global, incarnation, k_ > 1 ? "s" : "", pids.c_str());
        q.state = State::kRunning;
      }
    }
  }

 private:
  using Clock = std::chrono::steady_clock;
  enum class State { kRunning, kEnding, kRestartAt, kGone };
  struct Replica {
    State state = State::kRunning;
    Clock::time_point kill_at, restart_at;
    bool refused_input = false;  // a rank of this run exited with refused_input_exit_code
    int refusals_in_a_row = 0;   // runs of the replica that refused, the last ones
  };
  const LocalLaunchOptions& o_;
  int k_;
  int first_rank_;
  LocalLaunchResult& result_;
  std::vector<Replica> replicas_;
  bool finished_ = false;
};

}  // namespace

LocalLaunchResult launch_local_ranks(const LocalLaunchOptions& o) {
  if (o.nproc < 1)
    throw std::invalid_argument("launch_local_ranks: nproc must be at least 1");
  const auto n = static_cast<size_t>(o.nproc);
  LocalLaunchResult result;
  result.exit_codes.assign(n, LocalLaunchResult::kNotLaunched);
  result.exit_seconds.assign(n, 0.0);
  result.pids.assign(n, 0);

  const auto& restarting = o.replica_restarts;
  const int k = restarting ? restarting->ranks_per_replica : 1;
  if (restarting && (k < 1 || o.nproc % k != 0)) {
    throw std::invalid_argument("launch_local_ranks: " + std::to_string(k) +
                                " ranks per replica do not divide " + std::to_string(o.nproc));
  }
  const bool multi_node = o.nnodes > 1;
  if (o.nnodes < 1 || o.node_rank < 0 || o.node_rank >= o.nnodes ||
      (multi_node && (o.master_port < 1 || o.master_port > 65535))) {
    throw std::invalid_argument("launch_local_ranks: node " + std::to_string(o.node_rank) + " of " +
                                std::to_string(o.nnodes) + " nodes" +
                                (multi_node ? " needs a master_port" : ""));
  }
  const int first_rank = o.node_rank * o.nproc;
  const int world = o.nnodes * o.nproc;
  const bool serves = o.node_rank == 0;
  // The store lives in node 0's launcher, as in torchrun's agent. One node's ranks are all on
  // this machine, so it listens on loopback only: c10d's TCPStore binds every interface, so it
  // gets a socket bound here instead (masterListenFd); port 0 picks a free port without a race.
  // Several nodes: on master_addr:master_port, where the other nodes reach it.
  c10d::TCPStoreOptions store_opts;
  store_opts.port = static_cast<uint16_t>(o.master_port);
  if (serves) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
      throw std::runtime_error(std::string("launch_local_ranks: socket: ") + std::strerror(errno));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(o.master_port));
    if (multi_node && ::inet_pton(AF_INET, o.master_addr.c_str(), &addr.sin_addr) != 1) {
      ::close(fd);
      throw std::invalid_argument("launch_local_ranks: master_addr '" + o.master_addr +
                                  "' is not an IPv4 address");
    }
    const int one = 1;  // a port a previous job's store left in TIME_WAIT is taken again
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    socklen_t len = sizeof(addr);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(fd, 1024) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      const int err = errno;
      ::close(fd);
      throw std::runtime_error("launch_local_ranks: cannot listen on " +
                               (multi_node ? o.master_addr : std::string("127.0.0.1")) + ":" +
                               std::to_string(o.master_port) + ": " + std::strerror(err));
    }
    store_opts.port = ntohs(addr.sin_port);
    store_opts.masterListenFd = fd;  // the store owns it from here
  }
  store_opts.isServer = serves;
  store_opts.waitWorkers = false;
  if (o.timeout.count() > 0)
    store_opts.timeout = o.timeout;
  const std::string store_addr = multi_node ? o.master_addr : std::string("127.0.0.1");
  // Decided before the store starts its threads. Spawned ranks find the store up; forked ones
  // are started before it (its threads would make the fork unsafe) and wait at the gate until
  // it is. The other nodes' launchers connect to it (for replica restarts' numbering).
  result.forked = o.rank_main && single_threaded() && !multi_node;
  c10::intrusive_ptr<c10d::TCPStore> store;
  if (!result.forked)
    store = c10::make_intrusive<c10d::TCPStore>(store_addr, store_opts);
  // Replica restarts: each start of a replica is numbered in the store (its incarnation), so
  // that a node whose launcher itself was started again (a lost host back) starts its ranks
  // as joining a running job, and no two starts of a replica share a number.
  auto incarnation_of = [&](int replica) -> int {
    try {
      return static_cast<int>(store->add("fsdp/launch/replica" + std::to_string(replica), 1) - 1);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "fsdp launch: the store at %s:%d is out of reach (%s); trying again\n",
                   store_addr.c_str(), static_cast<int>(store_opts.port), e.what());
      return -1;
    }
  };
  std::vector<int> first_incarnation(static_cast<size_t>(o.nproc / k), 0);
  if (restarting && store) {
    for (size_t q = 0; q < first_incarnation.size(); ++q) {
      const int n = incarnation_of((first_rank + static_cast<int>(q) * k) / k);
      if (n < 0)
        throw std::runtime_error("launch_local_ranks: the store cannot be reached");
      first_incarnation[q] = n;
    }
  }

  const auto start = std::chrono::steady_clock::now();
  Children children;
  StoreGate gate;
  auto rank_vars = [&](int r) {
    std::map<std::string, std::string> vars{
        {"RANK", std::to_string(first_rank + r)},
        {"WORLD_SIZE", std::to_string(world)},
        {"LOCAL_RANK", std::to_string(r)},
        {"LOCAL_WORLD_SIZE", std::to_string(o.nproc)},
        {"MASTER_ADDR", store_addr},
        {"MASTER_PORT", std::to_string(store_opts.port)},
        {"TORCHELASTIC_USE_AGENT_STORE", "True"},
        {"TORCHELASTIC_RESTART_COUNT", "0"},
        {"OMP_NUM_THREADS", std::to_string(o.threads_per_rank)},
        {kLauncherVar, std::to_string(::getpid())},
    };
    for (const auto& [key, value] : o.env)
      vars[key] = value;
    return vars;
  };
  for (int r = 0; r < o.nproc; ++r) {
    if (std::find(o.absent_ranks.begin(), o.absent_ranks.end(), r) != o.absent_ranks.end())
      continue;
    const std::string log = o.log_path ? o.log_path(r) : std::string();
    auto vars = rank_vars(r);
    if (const int n = first_incarnation[static_cast<size_t>(r / k)]; n > 0)
      vars["FSDP_REPLICA_INCARNATION"] = std::to_string(n);  // a node back in a running job
    const pid_t pid = start_rank(o, result.forked, rank_environment(vars), log,
                                 store_opts.masterListenFd.value_or(-1), gate.fds());
    children.add(pid);
    result.pids[static_cast<size_t>(r)] = pid;
  }
  if (restarting) {
    // A fault-tolerant job's ranks come and go: which process is which rank, for an operator
    // (and the tests) who stops or kills one. Forked ranks' environments in /proc are the
    // launcher's (the kernel shows a process's environment as it was at exec), without RANK.
    std::string pids;
    for (int r = 0; r < o.nproc; ++r)
      pids += (r > 0 ? ", " : "") + std::to_string(result.pids[static_cast<size_t>(r)]);
    if (o.nproc == 1)
      std::fprintf(stderr, "fsdp launch: rank %d started (pid %s)\n", first_rank, pids.c_str());
    else
      std::fprintf(stderr, "fsdp launch: ranks %d-%d started (pids %s)\n", first_rank,
                   first_rank + o.nproc - 1, pids.c_str());
  }
  if (!store) {
    store = c10::make_intrusive<c10d::TCPStore>(store_addr, store_opts);
    for (size_t q = 0; restarting && q < first_incarnation.size(); ++q)
      incarnation_of((first_rank + static_cast<int>(q) * k) / k);  // first starts: all 0
  }
  gate.open();

  auto rank_of = [&](pid_t pid) {
    return static_cast<size_t>(std::find(result.pids.begin(), result.pids.end(), pid) -
                               result.pids.begin());
  };
  auto record = [&](pid_t pid, int status) {
    const size_t r = rank_of(pid);
    result.exit_codes[r] = decode_status(status);
    result.exit_seconds[r] = since(start);
    children.reaped(pid);
    if (result.exit_codes[r] != 0 && result.first_failed < 0)
      result.first_failed = static_cast<int>(r);
  };
  const auto no_deadline = std::chrono::steady_clock::time_point::max();
  const auto job_deadline = o.timeout.count() > 0 ? start + o.timeout : no_deadline;
  auto kill_deadline = no_deadline;  // set when a rank fails and a grace period applies
  ReplicaRestarter restarter(o, k, first_rank, result);
  while (!children.running().empty() || restarter.pending()) {
    bool reaped_any = false;
    for (pid_t pid : std::vector<pid_t>(children.running())) {
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        const size_t r = rank_of(pid);
        record(pid, status);
        if (restarting)
          restarter.ended(static_cast<int>(r), result.exit_codes[r]);
        reaped_any = true;
      }
    }
    if (restarting) {
      restarter.poll(children, incarnation_of, [&](int r, int incarnation) {
        auto vars = rank_vars(r);
        vars["FSDP_REPLICA_INCARNATION"] = std::to_string(incarnation);
        const std::string log = o.log_path ? o.log_path(r) : std::string();
        const pid_t pid = spawn(o.executable, o.argv, rank_environment(vars), log, /*append=*/true);
        children.add(pid);
        result.pids[static_cast<size_t>(r)] = pid;
        result.exit_codes[static_cast<size_t>(r)] = LocalLaunchResult::kNotLaunched;
        return pid;
      });
    }
    if (children.running().empty() && !restarter.pending())
      break;
    if (!restarting && result.first_failed >= 0 && kill_deadline == no_deadline &&
        o.grace_after_failure.count() >= 0)
      kill_deadline = std::chrono::steady_clock::now() + o.grace_after_failure;
    const auto now = std::chrono::steady_clock::now();
    if (now >= job_deadline || now >= kill_deadline) {
      result.timed_out = now >= job_deadline;
      children.kill_all();
      for (pid_t pid : std::vector<pid_t>(children.running())) {
        int status = 0;
        while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
        }
        record(pid, status);
      }
      break;
    }
    if (!reaped_any)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  // Several nodes: node 0's store serves the others' ranks until they are done too (each
  // launcher counts itself out), or for `linger` at most (a node that never comes back).
  if (multi_node) {
    try {
      store->add("fsdp/launch/done", 1);
      const auto until = std::chrono::steady_clock::now() + o.linger;
      while (serves && store->add("fsdp/launch/done", 0) < o.nnodes &&
             std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    } catch (const std::exception&) {
      // node 0 gone: nothing to wait for
    }
  }
  result.seconds = since(start);
  return result;
}

bool single_threaded() {
  std::error_code ec;
  int threads = 0;
  for (std::filesystem::directory_iterator it("/proc/self/task", ec), end; !ec && it != end;
       it.increment(ec))
    ++threads;
  return !ec && threads == 1;
}

void die_with_launcher() {
  const char* launcher = std::getenv(kLauncherVar);
  if (!launcher)
    return;
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  // The launcher may have died between our spawn and the prctl.
  if (std::to_string(::getppid()) != launcher)
    std::_Exit(1);
}

}  // namespace fsdp
