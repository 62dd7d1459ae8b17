// Joining a job: the launcher's environment, the TCPStore rendezvous, and the c10d backends.
//
// Every step that waits on other processes is bounded by ProcessGroupOptions::timeout and fails
// with one line naming this rank, the address and the ranks that are missing, because a
// distributed job that hangs silently is the most expensive kind of failure to debug.

#include <fsdp/distributed/process_group.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <fsdp/distributed/collectives.h>

#include "collective_check.h"
#include "env_switch.h"
#include "gloo_loop_policy.h"
#include "group_access.h"
#include "peer_progress.h"

namespace fsdp {
namespace {

// ---- Environment ------------------------------------------------------------------------------

const char* env_or_null(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

[[noreturn]] void bad_env(const std::string& what) {
  throw std::runtime_error("invalid launch environment: " + what);
}

int64_t parse_int(const char* name, const std::string& value, int64_t min, int64_t max) {
  int64_t v = 0;
  const char* end = value.data() + value.size();
  auto [ptr, ec] = std::from_chars(value.data(), end, v);
  if (value.empty() || ec == std::errc::invalid_argument || ptr != end) {
    bad_env(std::string(name) + "=\"" + value + "\" is not an integer");
  }
  if (ec == std::errc::result_out_of_range || v < min || v > max) {
    bad_env(std::string(name) + "=" + value + " is out of range [" + std::to_string(min) + ", " +
            std::to_string(max) + "]");
  }
  return v;
}

int env_int(const char* name, int64_t min, int64_t max, int fallback) {
  const char* v = env_or_null(name);
  return v ? static_cast<int>(parse_int(name, v, min, max)) : fallback;
}

int required_env_int(const char* name, const char* because, int64_t min, int64_t max) {
  const char* v = env_or_null(name);
  if (!v)
    bad_env(std::string(name) + " is not set (" + because + ")");
  return static_cast<int>(parse_int(name, v, min, max));
}

constexpr int64_t kMaxRanks = 1 << 24;

// SLURM compresses per-node task counts: "2(x3),1" is 2 tasks on each of 3 nodes, then 1.
std::vector<int> parse_slurm_tasks_per_node(const char* name, const std::string& value) {
  std::vector<int> per_node;
  std::stringstream ss(value);
  std::string item;
  while (std::getline(ss, item, ',')) {
    int64_t repeat = 1;
    std::string count = item;
    if (auto open = item.find('('); open != std::string::npos) {
      if (item.size() < open + 4 || item.compare(open, 2, "(x") != 0 || item.back() != ')') {
        bad_env(std::string(name) + "=\"" + value + "\" is not like \"2(x3),1\"");
      }
      count = item.substr(0, open);
      repeat = parse_int(name, item.substr(open + 2, item.size() - open - 3), 1, kMaxRanks);
    }
    const int64_t tasks = parse_int(name, count, 1, kMaxRanks);
    if (static_cast<int64_t>(per_node.size()) + repeat > kMaxRanks) {
      bad_env(std::string(name) + "=\"" + value + "\" lists too many nodes");
    }
    per_node.insert(per_node.end(), static_cast<size_t>(repeat), static_cast<int>(tasks));
  }
  if (per_node.empty())
    bad_env(std::string(name) + "=\"" + value + "\" is empty");
  return per_node;
}

void check_ranks(const LaunchEnv& env, const char* rank_var, const char* world_var,
                 const char* local_rank_var, const char* local_world_var) {
  if (env.rank >= env.world_size) {
    bad_env(std::string(rank_var) + "=" + std::to_string(env.rank) + " is not below " + world_var +
            "=" + std::to_string(env.world_size));
  }
  if (env.local_rank >= env.local_world_size) {
    bad_env(std::string(local_rank_var) + "=" + std::to_string(env.local_rank) + " is not below " +
            local_world_var + "=" + std::to_string(env.local_world_size));
  }
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

std::string seconds_text(std::chrono::milliseconds t) {
  char buf[32];
  if (t.count() % 1000 == 0) {
    std::snprintf(buf, sizeof buf, "%llds", static_cast<long long>(t.count() / 1000));
  } else {
    std::snprintf(buf, sizeof buf, "%.3gs", static_cast<double>(t.count()) / 1000.0);
  }
  return buf;
}

// "0-3, 5, 7": long lists of missing ranks stay readable on one line.
std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1)
      ++j;
    if (!s.empty())
      s += ", ";
    s += std::to_string(ranks[i]);
    if (j > i)
      s += (j == i + 1 ? ", " : "-") + std::to_string(ranks[j]);
    i = j + 1;
  }
  return s;
}

// c10 errors carry a backtrace and several lines; our messages stay one line.
std::string first_line(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  std::string s = c10_error ? c10_error->what_without_backtrace() : e.what();
  if (auto nl = s.find('\n'); nl != std::string::npos)
    s.resize(nl);
  return s;
}

// ---- Backends ---------------------------------------------------------------------------------

std::shared_ptr<::gloo::transport::Device> gloo_device(const std::string& hostname) {
  // The device starts Gloo's event-loop thread, which inherits this policy (see the header).
  const detail::BatchPolicyForNewThreads batch_loop;
  if (!hostname.empty())
    return c10d::ProcessGroupGloo::createDeviceForHostname(hostname);
  // Same override as PyTorch, for machines whose host name resolves to the wrong interface.
  if (const char* ifname = env_or_null("GLOO_SOCKET_IFNAME")) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

c10::intrusive_ptr<c10d::Backend> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                            int size, const ProcessGroupOptions& options) {
  // The context timeout bounds every collective, so a dead or silent peer fails it.
  auto opts = c10d::ProcessGroupGloo::Options::create(options.timeout());
  opts->devices.push_back(gloo_device(options.gloo_hostname()));
  opts->threads = 1;  // one collective at a time per context: see gloo_lanes
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
}

// The group's backends: gloo_lanes independent Gloo contexts (each over its own prefix of the
// store), or the one backend of any other kind.
std::vector<c10::intrusive_ptr<c10d::Backend>> make_lanes(
    const BackendFactory& factory, const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    const ProcessGroupOptions& options) {
  const int n = options.backend() == "gloo" ? std::max(1, options.gloo_lanes()) : 1;
  std::vector<c10::intrusive_ptr<c10d::Backend>> lanes;
  for (int i = 0; i < n; ++i) {
    c10::intrusive_ptr<c10d::Store> lane_store = store;
    if (i > 0)
      lane_store = c10::make_intrusive<c10d::PrefixStore>("lane" + std::to_string(i), store);
    lanes.push_back(factory(lane_store, rank, size, options));
  }
  return lanes;
}

struct Registry {
  std::mutex mutex;
  std::map<std::string, BackendFactory> factories{{"gloo", make_gloo}};
};

Registry& registry() {
  static Registry r;
  return r;
}

BackendFactory find_backend(const std::string& name) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.factories.find(name);
  if (it != r.factories.end())
    return it->second;
  std::string known;
  for (const auto& [key, _] : r.factories)
    known += (known.empty() ? "" : ", ") + key;
  throw std::runtime_error(
      "unknown process group backend \"" + name + "\" (known: " + known +
      (name == "nccl" ? "; link fsdp::cuda and call register_nccl_backend()" : "") + ")");
}

// ---- Rendezvous -------------------------------------------------------------------------------

std::string joined_key(int rank) {
  return "fsdp/joined/" + std::to_string(rank);
}
const char kGaveUpKey[] = "fsdp/join_gave_up";

// Our own arrival check, before the backend's: the backend would also time out, but with a
// message about keys rather than about ranks. `members` are the global ranks of the group,
// `rank` this process's index into it.
void join_check(c10d::Store& store, int rank, const std::vector<int>& members,
                std::chrono::milliseconds timeout, const std::string& what, bool hosts_store) {
  const int size = static_cast<int>(members.size());
  const std::string me = "[rank " + std::to_string(members[static_cast<size_t>(rank)]) + "] ";
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r)
    keys.push_back(joined_key(r));
  try {
    store.set(keys[static_cast<size_t>(rank)], std::vector<uint8_t>{'1'});
    store.wait(keys, timeout);
    return;
  } catch (const std::exception& e) {
    std::vector<int> missing;
    try {
      for (int r = 0; r < size; ++r) {
        if (!store.check({keys[static_cast<size_t>(r)]})) {
          missing.push_back(members[static_cast<size_t>(r)]);
        }
      }
    } catch (const std::exception&) {
      throw std::runtime_error(
          me + what + " failed: lost the rendezvous store while waiting " +
          "for the other ranks (its host may have failed first): " + first_line(e));
    }
    // Everyone arrived just as the wait gave up: the others' waits succeed, so must ours.
    if (missing.empty())
      return;
    // The rank hosting the store keeps it up a little longer, so that the ranks which did
    // arrive (and time out slightly later) can still read who is missing.
    const int present = size - static_cast<int>(missing.size());
    try {
      if (hosts_store) {
        const auto linger_until =
            std::chrono::steady_clock::now() + std::min(timeout, std::chrono::milliseconds(5000));
        while (store.add(kGaveUpKey, 0) < present - 1 &&
               std::chrono::steady_clock::now() < linger_until) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
      } else {
        store.add(kGaveUpKey, 1);
      }
    } catch (const std::exception&) {
      // Only a courtesy to the other ranks: the message below is what matters.
    }
    throw std::runtime_error(me + what + " failed: rank(s) " + rank_list(missing) + " of " +
                             std::to_string(size) + " did not join within " +
                             seconds_text(timeout));
  }
}

// Whether something accepts TCP connections at host:port before `deadline`. TCPStore's own
// connect loop retries with a full timeout per attempt plus back-off, so a missing server makes
// it give up only after up to about twice the timeout (logging a backtrace per attempt);
// probing first keeps the bound at the timeout. `error` gets the last failure that was not a
// plain refusal or time-out (an unresolvable host, say).
bool wait_until_reachable(const std::string& host, int port,
                          std::chrono::steady_clock::time_point deadline, std::string& error) {
  using Clock = std::chrono::steady_clock;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const std::string service = std::to_string(port);
  while (true) {
    addrinfo* list = nullptr;
    if (const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &list); rc != 0) {
      error = "cannot resolve " + host + ": " + ::gai_strerror(rc);
    } else {
      for (addrinfo* ai = list; ai != nullptr; ai = ai->ai_next) {
        const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                                ai->ai_protocol);
        if (fd < 0)
          continue;
        int err = 0;
        if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
          err = errno;
          if (err == EINPROGRESS) {
            const auto left =
                std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
            pollfd p{fd, POLLOUT, 0};
            const int wait_ms = static_cast<int>(std::clamp<int64_t>(left.count(), 0, 1000));
            socklen_t len = sizeof err;
            if (::poll(&p, 1, wait_ms) != 1) {
              err = ETIMEDOUT;
            } else if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) {
              err = errno;
            }
          }
        }
        ::close(fd);
        if (err == 0) {
          ::freeaddrinfo(list);
          return true;
        }
        if (err != ECONNREFUSED && err != ETIMEDOUT)
          error = std::strerror(err);
      }
      ::freeaddrinfo(list);
    }
    const auto now = Clock::now();
    if (now >= deadline)
      return false;
    // The server is usually just starting: poll often, but without hammering a busy host.
    std::this_thread::sleep_for(
        std::min<Clock::duration>(std::chrono::milliseconds(100), deadline - now));
  }
}

c10::intrusive_ptr<c10d::TCPStore> connect_store(const LaunchEnv& env, bool server,
                                                 std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions o;
  o.port = static_cast<std::uint16_t>(env.master_port);
  o.isServer = server;
  // TCPStore's own worker count check would fail first with a less useful message.
  o.numWorkers = std::nullopt;
  o.waitWorkers = false;
  o.timeout = timeout;
  // A second init_process_group in the process shares rank 0's server instead of failing to
  // bind its port again.
  o.multiTenant = true;
  const std::string where = env.master_addr + ":" + std::to_string(env.master_port);
  const std::string me = "[rank " + std::to_string(env.rank) + "] ";
  const std::string unreachable =
      me + "cannot reach the rendezvous store at " + where + " within " + seconds_text(timeout) +
      " (is rank 0 / the launcher running? check MASTER_ADDR/MASTER_PORT)";
  if (!server) {
    std::string error;
    if (!wait_until_reachable(env.master_addr, env.master_port,
                              std::chrono::steady_clock::now() + timeout, error)) {
      throw std::runtime_error(unreachable + (error.empty() ? "" : ": " + error));
    }
  }
  try {
    return c10::make_intrusive<c10d::TCPStore>(env.master_addr, o);
  } catch (const std::exception& e) {
    if (server) {
      throw std::runtime_error(me + "cannot serve the rendezvous store on port " +
                               std::to_string(env.master_port) +
                               " (is MASTER_PORT in use?): " + first_line(e));
    }
    // Reachable a moment ago: the server went away, or the port is not a TCPStore.
    throw std::runtime_error(unreachable + ": " + first_line(e));
  }
}

}  // namespace

// ---- Public API -------------------------------------------------------------------------------

LaunchEnv launch_env_from_environment() {
  LaunchEnv env;
  if (env_or_null("RANK") || env_or_null("WORLD_SIZE")) {
    env.source = "torchrun";
    env.world_size = required_env_int("WORLD_SIZE", "RANK is set", 1, kMaxRanks);
    env.rank = required_env_int("RANK", "WORLD_SIZE is set", 0, kMaxRanks);
    // Launchers other than torchrun may set only the global variables: one node.
    env.local_world_size = env_int("LOCAL_WORLD_SIZE", 1, kMaxRanks, env.world_size);
    env.local_rank = env_int("LOCAL_RANK", 0, kMaxRanks, env.rank);
    if (const char* a = env_or_null("MASTER_ADDR"))
      env.master_addr = a;
    env.master_port = env_int("MASTER_PORT", 1, 65535, env.master_port);
    check_ranks(env, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
    // torchrun's agent serves the store at MASTER_ADDR:MASTER_PORT and sets exactly "True".
    const char* agent = env_or_null("TORCHELASTIC_USE_AGENT_STORE");
    env.agent_store = agent != nullptr && std::string(agent) == "True";
    if (env.agent_store) {
      // The agent's store outlives a restart of the workers; keys of an earlier attempt must
      // not satisfy this one's rendezvous.
      env.store_prefix =
          "/worker/attempt_" + std::to_string(env_int("TORCHELASTIC_RESTART_COUNT", 0, 1 << 30, 0));
    }
  } else if (env_or_null("SLURM_PROCID")) {
    env.source = "slurm";
    env.world_size = required_env_int("SLURM_NTASKS", "SLURM_PROCID is set", 1, kMaxRanks);
    env.rank = required_env_int("SLURM_PROCID", "", 0, kMaxRanks);
    env.local_rank = env_int("SLURM_LOCALID", 0, kMaxRanks, 0);
    const char* per_node_var = env_or_null("SLURM_NTASKS_PER_NODE")  ? "SLURM_NTASKS_PER_NODE"
                               : env_or_null("SLURM_TASKS_PER_NODE") ? "SLURM_TASKS_PER_NODE"
                                                                     : nullptr;
    if (per_node_var) {
      auto per_node = parse_slurm_tasks_per_node(per_node_var, std::getenv(per_node_var));
      // A single value applies to every node; a list is indexed by this node.
      int node = per_node.size() == 1 ? 0 : env_int("SLURM_NODEID", 0, kMaxRanks, 0);
      if (node >= static_cast<int>(per_node.size())) {
        bad_env("SLURM_NODEID=" + std::to_string(node) + " but " + per_node_var + "=\"" +
                std::getenv(per_node_var) + "\" lists " + std::to_string(per_node.size()) +
                " node(s)");
      }
      env.local_world_size = per_node[static_cast<size_t>(node)];
    } else {
      // srun always sets SLURM_TASKS_PER_NODE; this only keeps hand-made environments valid.
      env.local_world_size = env.local_rank + 1;
    }
    if (const char* a = env_or_null("MASTER_ADDR")) {
      env.master_addr = a;
    } else if (const char* a = env_or_null("SLURM_LAUNCH_NODE_IPADDR")) {
      env.master_addr = a;
    }
    // Two jobs sharing a node must not pick the same default port.
    const int job = env_int("SLURM_JOB_ID", 0, INT32_MAX, -1);
    const int default_port = job >= 0 ? 20000 + job % 10000 : env.master_port;
    env.master_port = env_int("MASTER_PORT", 1, 65535, default_port);
    check_ranks(env, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                per_node_var ? per_node_var : "SLURM_NTASKS_PER_NODE");
  }
  env.incarnation = env_int("FSDP_REPLICA_INCARNATION", 0, 1 << 30, 0);
  return env;
}

void register_backend(const std::string& name, BackendFactory factory) {
  if (!factory)
    throw std::invalid_argument("register_backend(\"" + name + "\"): empty factory");
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.factories[name] = std::move(factory);
}

std::shared_ptr<ProcessGroup> init_process_group(const LaunchEnv& env,
                                                 const ProcessGroupOptions& options) {
  // Resolve the backend first: a typo should fail before anything waits on other ranks.
  BackendFactory factory = find_backend(options.backend());
  // A write to the socket of a peer that died raises SIGPIPE, whose default action kills this
  // rank silently; ignored, the write fails and the collective reports which peer is gone.
  // Only the default is replaced: an application's own handler stays.
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL)
    std::signal(SIGPIPE, SIG_IGN);
  ProcessGroupOptions opts = options;
  if (opts.gloo_hostname().empty() && is_loopback(env.master_addr)) {
    opts.gloo_hostname(env.master_addr);
  }
  if (opts.check_collectives() == 0)
    opts.check_collectives(detail::check_collectives_from_environment());
  if (!opts.bench_local_collectives())
    opts.bench_local_collectives(detail::env_switch("FSDP_BENCH_LOCAL_COLLECTIVES"));
  if (opts.bench_local_collectives() && env.rank == 0) {
    std::fprintf(stderr,
                 "fsdp: benchmark mode (bench_local_collectives): every collective is a local "
                 "copy of its bytes, nothing is communicated; results are not the model's\n");
  }
  // FSDP_FLIGHT_RECORDER_DUMP_AT_EXIT=1: dump the flight recorder (to its dump directory) when
  // the process exits normally too, not only on a failure: bench/bounds.py replays a run's
  // collectives from these dumps.
  if (detail::env_switch("FSDP_FLIGHT_RECORDER_DUMP_AT_EXIT")) {
    static std::once_flag registered;
    // Both ways a process may end normally: exit() (main returning), and quick_exit(), which
    // skips static destructors (fsdp-train ends so).
    std::call_once(registered, [] {
      std::atexit([] { FlightRecorder::global().dump("process exit"); });
      std::at_quick_exit([] { FlightRecorder::global().dump("process exit"); });
    });
  }
  std::vector<int> world(static_cast<size_t>(env.world_size));
  for (int r = 0; r < env.world_size; ++r)
    world[static_cast<size_t>(r)] = r;

  // A restarted process of a fault-tolerant job joins it running: the others made the world's
  // backend (and passed its rendezvous) long ago, so this one makes neither.
  const bool joining = env.incarnation > 0;
  if (joining && (env.world_size == 1 || !env.agent_store)) {
    throw std::invalid_argument(
        "[rank " + std::to_string(env.rank) +
        "] FSDP_REPLICA_INCARNATION is set: a process restarted into a running job needs the "
        "job's store served by its launcher (TORCHELASTIC_USE_AGENT_STORE=True), not by a rank");
  }
  c10::intrusive_ptr<c10d::Store> store;
  if (env.world_size == 1) {
    store = c10::make_intrusive<c10d::HashStore>();
  } else {
    const bool server = env.rank == 0 && !env.agent_store;
    store = connect_store(env, server, opts.timeout());
    if (!env.store_prefix.empty()) {
      store = c10::make_intrusive<c10d::PrefixStore>(env.store_prefix, store);
    }
    // A second group in the same job (a test that re-initialises, say) must not find the
    // first one's keys: they would pass its join check and hand Gloo stale addresses.
    static std::atomic<int> joins{0};
    store = c10::make_intrusive<c10d::PrefixStore>("fsdp/init" + std::to_string(joins++), store);
    if (!joining) {
      join_check(*store, env.rank, world, opts.timeout(),
                 "rendezvous at " + env.master_addr + ":" + std::to_string(env.master_port),
                 server);
    }
  }
  auto backend_store = c10::make_intrusive<c10d::PrefixStore>("fsdp/world", store);
  std::vector<c10::intrusive_ptr<c10d::Backend>> lanes;
  try {
    if (!joining)
      lanes = make_lanes(factory, backend_store, env.rank, env.world_size, opts);
  } catch (const std::exception& e) {
    throw std::runtime_error("[rank " + std::to_string(env.rank) + "] creating the " +
                             opts.backend() + " backend over " + std::to_string(env.world_size) +
                             " ranks failed: " + first_line(e));
  }
  auto group = std::make_shared<ProcessGroup>(store, std::move(lanes), env.rank, env.world_size,
                                              world, opts);
  FlightRecorder::global().set_identity(env.rank, env.world_size);
  FlightRecorder::global().dump_on_terminate();
  // FSDP_PEER_PROGRESS=0 turns the reports off, for bench/step_overheads.py to measure what they
  // cost (docs/step_overheads.md); a failed collective's error then says only that it timed out.
  if (env.world_size > 1 && detail::env_switch("FSDP_PEER_PROGRESS", true)) {
    // Reports often enough that a peer stopped for a fraction of the timeout is seen as silent
    // when a collective times out (peer_progress.h), and no more than once a second.
    const auto interval = std::clamp(opts.timeout() / 10, std::chrono::milliseconds(100),
                                     std::chrono::milliseconds(1000));
    auto progress =
        std::make_shared<detail::PeerProgress>(store, env.rank, env.world_size, interval);
    detail::set_current_peer_progress(progress);
    detail::GroupAccess::set_progress(*group, std::move(progress));
  }
  return group;
}

std::shared_ptr<ProcessGroup> init_process_group(const ProcessGroupOptions& options) {
  return init_process_group(launch_env_from_environment(), options);
}

std::shared_ptr<ProcessGroup> local_group(int size, int rank, const std::string& name) {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "local_group: rank ", rank, " of size ", size);
  std::vector<int> ranks(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r)
    ranks[static_cast<size_t>(r)] = r;
  return std::make_shared<ProcessGroup>(nullptr, std::vector<c10::intrusive_ptr<c10d::Backend>>{},
                                        rank, size, std::move(ranks),
                                        ProcessGroupOptions().bench_local_collectives(true), name);
}

ProcessGroup::ProcessGroup(c10::intrusive_ptr<c10d::Store> store,
                           std::vector<c10::intrusive_ptr<c10d::Backend>> lanes, int rank, int size,
                           std::vector<int> global_ranks, ProcessGroupOptions options,
                           std::string name)
    : store_(std::move(store)),
      lanes_(std::move(lanes)),
      name_(std::move(name)),
      rank_(rank),
      size_(size),
      global_ranks_(std::move(global_ranks)),
      options_(std::move(options)) {
  TORCH_CHECK(std::all_of(lanes_.begin(), lanes_.end(), [](const auto& b) { return bool(b); }),
              "ProcessGroup: a null backend");
  TORCH_CHECK(size_ >= 1 && rank_ >= 0 && rank_ < size_, "ProcessGroup: rank ", rank_, " of size ",
              size_);
  TORCH_CHECK(static_cast<int>(global_ranks_.size()) == size_, "ProcessGroup: global_ranks has ",
              global_ranks_.size(), " entries for size ", size_);
  TORCH_CHECK(options_.check_collectives() >= 0, "ProcessGroupOptions::check_collectives must be ",
              ">= 0, got ", options_.check_collectives());
  FlightRecorder::global().register_group(name_, global_ranks_);

  if (options_.check_collectives() > 0 && size_ > 1) {
    check_ = std::make_unique<detail::CollectiveCheck>(
        store_, rank_, global_ranks_, options_.check_collectives(), options_.timeout());
  }
}

ProcessGroup::~ProcessGroup() {
  // NCCL: end the communicators here, as Python's destroy_process_group() does (c10d warns
  // about, and leaks, a ProcessGroupNCCL destroyed without it). Gloo has nothing to end.
  // While an exception unwinds (a failed step: a peer may be dead), abort instead: shutdown()
  // waits for the outstanding work, which may never end, and the error would never be shown.
  if (options_.backend() != "nccl")
    return;
  const bool failing = std::uncaught_exceptions() > 0;
  for (auto& lane : lanes_) {
    try {
      if (failing)
        lane->abort();
      else
        lane->shutdown();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[rank %d] fsdp: ending NCCL group '%s': %s\n", global_ranks_.at(rank_),
                   name_.c_str(), e.what());
    }
  }
}

c10::DeviceType ProcessGroup::device_type() const {
  return options_.backend() == "nccl" ? c10::kCUDA : options_.gloo_device();
}

namespace {
// Ascending group ranks in [0, size), at least one.
void check_ranks(const std::vector<int>& ranks, int size, int me, const char* what) {
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= size || (i > 0 && ranks[i] <= ranks[i - 1])) {
      throw std::invalid_argument("[rank " + std::to_string(me) + "] " + what +
                                  ": ranks must be ascending group ranks in [0, " +
                                  std::to_string(size) + "), got " + rank_list(ranks));
    }
  }
  if (ranks.empty())
    throw std::invalid_argument("[rank " + std::to_string(me) + "] " + what + ": no ranks");
}
}  // namespace

void ProcessGroup::require_backend(const char* what) const {
  if (!lanes_.empty())
    return;
  if (options_.bench_local_collectives() && !store_) {
    throw std::logic_error(std::string(what) + " on group '" + name_ +
                           "', a local group (fsdp::local_group): it is connected to no other "
                           "process, and only its collectives have a local equivalent");
  }
  throw std::logic_error("[rank " + std::to_string(global_ranks_[static_cast<size_t>(rank_)]) +
                         "] " + what + " on group '" + name_ +
                         "', which has no backend: this process joined a running job "
                         "(FSDP_REPLICA_INCARNATION), whose groups come from members_group()");
}

c10d::Backend& ProcessGroup::first_lane() const {
  require_backend("a collective");
  return *lanes_.front();
}

c10d::Backend& ProcessGroup::next_lane() {
  require_backend("a collective");
  return *lanes_[next_lane_++ % lanes_.size()];
}

std::shared_ptr<ProcessGroup> ProcessGroup::new_group(const std::vector<int>& ranks) {
  require_backend("new_group");
  // Counted before any check, so that every member numbers its groups the same way even when
  // it is not in this one.
  const int k = subgroups_created_++;
  check_ranks(ranks, size_, global_ranks_[static_cast<size_t>(rank_)], "new_group");
  if (std::find(ranks.begin(), ranks.end(), rank_) == ranks.end())
    return nullptr;
  return subgroup(ranks, "fsdp/group" + std::to_string(k), "new_group #" + std::to_string(k),
                  name_ + "/" + std::to_string(k));
}

std::shared_ptr<ProcessGroup> ProcessGroup::members_group(const std::vector<int>& ranks,
                                                          const std::string& tag) {
  const int me = global_ranks_[static_cast<size_t>(rank_)];
  check_ranks(ranks, size_, me, "members_group");
  if (std::find(ranks.begin(), ranks.end(), rank_) == ranks.end()) {
    throw std::invalid_argument("[rank " + std::to_string(me) + "] members_group '" + tag +
                                "': this rank is not among " + rank_list(ranks));
  }
  return subgroup(ranks, "fsdp/members/" + tag, "members_group '" + tag + "'", name_ + "/" + tag);
}

std::shared_ptr<ProcessGroup> ProcessGroup::subgroup(const std::vector<int>& ranks,
                                                     const std::string& prefix,
                                                     const std::string& what,
                                                     const std::string& name) {
  const int me = global_ranks_[static_cast<size_t>(rank_)];
  const int sub_rank =
      static_cast<int>(std::find(ranks.begin(), ranks.end(), rank_) - ranks.begin());
  const int sub_size = static_cast<int>(ranks.size());
  std::vector<int> members;
  for (int r : ranks)
    members.push_back(global_ranks_[static_cast<size_t>(r)]);
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::PrefixStore>(prefix, store_);
  join_check(*store, sub_rank, members, options_.timeout(),
             what + " over global ranks " + rank_list(members),
             /*hosts_store=*/false);
  auto backend_store = c10::make_intrusive<c10d::PrefixStore>("backend", store);
  std::vector<c10::intrusive_ptr<c10d::Backend>> lanes;
  try {
    lanes =
        make_lanes(find_backend(options_.backend()), backend_store, sub_rank, sub_size, options_);
  } catch (const std::exception& e) {
    throw std::runtime_error("[rank " + std::to_string(me) + "] creating the " +
                             options_.backend() + " backend of " + what +
                             " failed: " + first_line(e));
  }
  return std::make_shared<ProcessGroup>(store, std::move(lanes), sub_rank, sub_size,
                                        std::move(members), options_, name);
}

namespace {
void check_block_size(int block_size, int size, int me, const char* what) {
  if (block_size < 1 || size % block_size != 0) {
    throw std::invalid_argument("[rank " + std::to_string(me) + "] " + what + ": " +
                                std::to_string(block_size) + " does not divide the group's " +
                                std::to_string(size) + " ranks");
  }
}
}  // namespace

std::shared_ptr<ProcessGroup> ProcessGroup::block_group(int block_size) {
  const int me = global_ranks_[static_cast<size_t>(rank_)];
  check_block_size(block_size, size_, me, "block_group");
  if (block_size == size_)
    return shared_from_this();
  auto& cached = splits_[{block_size, false}];
  if (!cached) {
    for (int first = 0; first < size_; first += block_size) {
      std::vector<int> ranks(static_cast<size_t>(block_size));
      std::iota(ranks.begin(), ranks.end(), first);
      if (auto g = new_group(ranks))
        cached = std::move(g);
    }
  }
  return cached;
}

std::shared_ptr<ProcessGroup> ProcessGroup::strided_group(int block_size) {
  const int me = global_ranks_[static_cast<size_t>(rank_)];
  check_block_size(block_size, size_, me, "strided_group");
  if (block_size == 1)
    return shared_from_this();
  auto& cached = splits_[{block_size, true}];
  if (!cached) {
    for (int offset = 0; offset < block_size; ++offset) {
      std::vector<int> ranks;
      for (int r = offset; r < size_; r += block_size)
        ranks.push_back(r);
      if (auto g = new_group(ranks))
        cached = std::move(g);
    }
  }
  return cached;
}

void ProcessGroup::barrier() {
  fsdp::barrier(*this)->wait();
}

int cut_off_torchrun_agent() {
  if (!store_out_of_reach() || std::getenv("TORCHELASTIC_RUN_ID") == nullptr)
    return 0;
  const pid_t parent = ::getppid();
  if (parent <= 1)
    return 0;
  std::ifstream in("/proc/" + std::to_string(parent) + "/cmdline", std::ios::binary);
  const std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // torchrun's script (argv[1] after the interpreter, or argv[0]), or `python -m
  // torch.distributed.run`: an agent, not a shell, a wrapper script or SLURM.
  std::vector<std::string> argv;
  for (size_t at = 0; at < cmdline.size() && argv.size() < 3;) {
    const size_t end = cmdline.find('\0', at);
    argv.push_back(cmdline.substr(at, end == std::string::npos ? std::string::npos : end - at));
    at = end == std::string::npos ? cmdline.size() : end + 1;
  }
  const auto base = [](const std::string& path) { return path.substr(path.rfind('/') + 1); };
  const bool agent = (!argv.empty() && base(argv[0]) == "torchrun") ||
                     (argv.size() >= 2 && base(argv[1]) == "torchrun") ||
                     (argv.size() >= 3 && argv[1] == "-m" && argv[2] == "torch.distributed.run");
  if (!agent)
    return 0;
  // A store that answers again (the link came back): the agent can go on, and restart the
  // workers if it may.
  const char* addr = std::getenv("MASTER_ADDR");
  const char* port = std::getenv("MASTER_PORT");
  std::string error;
  if (addr != nullptr && port != nullptr &&
      wait_until_reachable(addr, std::atoi(port),
                           std::chrono::steady_clock::now() + std::chrono::seconds(2), error))
    return 0;
  return static_cast<int>(parent);
}

namespace {

constexpr char kCutOffName[] = "fsdp-cut-off";

// The other children of `parent` that are neither gone nor named kCutOffName.
int busy_siblings(pid_t parent) {
  int busy = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename().string();
    pid_t pid = 0;
    const auto [end, err] = std::from_chars(name.data(), name.data() + name.size(), pid);
    if (err != std::errc() || end != name.data() + name.size() || pid == ::getpid())
      continue;
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    if (!std::getline(stat, line))
      continue;
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses; the last ')' ends it.
    const auto close = line.rfind(')');
    const auto open = line.find('(');
    if (close == std::string::npos || open == std::string::npos)
      continue;
    std::istringstream rest(line.substr(close + 1));
    char state = 0;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid != parent || state == 'Z')
      continue;
    if (line.substr(open + 1, close - open - 1) != kCutOffName)
      ++busy;
  }
  return busy;
}

}  // namespace

void end_torchrun_agent(int pid, std::chrono::milliseconds grace,
                        std::chrono::milliseconds siblings_grace) {
  const auto agent = static_cast<pid_t>(pid);
  if (agent <= 1 || ::getppid() != agent)
    return;
  ::prctl(PR_SET_NAME, kCutOffName);
  const auto waiting = [agent](std::chrono::milliseconds limit, auto&& done) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (::getppid() == agent && !done() && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
  };
  waiting(siblings_grace, [agent] { return busy_siblings(agent) == 0; });
  if (::getppid() != agent || ::kill(agent, SIGTERM) != 0)
    return;
  // Its SIGTERM handler stops this process too, normally well within the grace.
  waiting(grace, [] { return false; });
  if (::getppid() == agent)
    ::kill(agent, SIGKILL);
}

}  // namespace fsdp
