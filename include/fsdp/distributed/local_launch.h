// Launching the ranks of a job on this machine, the way torchrun's agent does: the launcher
// hosts the rendezvous TCPStore and starts N processes with torchrun's environment, then reaps
// them. fsdp-train --nproc and the multi-process tests both launch through it, so one
// implementation decides what a rank inherits and guarantees that no process outlives a job.
//
// A rank is either posix_spawn()ed (a new program) or, where the caller gives the rank's work as
// a function (rank_main) and the launcher has no thread but its own, fork()ed without exec: the
// copy skips loading LibTorch and registering its operators again, about 0.25 s of CPU per rank
// on our 2-core machines, most of a small job's start. With any other thread alive (LibTorch's
// intra-op pool, a store's threads) a fork could copy a lock held by a thread that the child
// does not have, so the rank is spawned instead; the store's threads start after the forks,
// and a forked rank waits until the store is up before it runs.
// Either way each rank leads its own process group, so that stopping a rank stops anything it
// started, with default signal dispositions and an empty signal mask whatever the launcher has
// set (CTest, GoogleTest), and dies with its launcher, even a SIGKILLed one (a spawned rank
// calls die_with_launcher() first thing; a forked one has it done before rank_main runs).
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

struct LocalLaunchOptions {
  /// The program of every rank and its arguments (argv[0] first: it only names the process).
  std::string executable = "/proc/self/exe";
  std::vector<std::string> argv;
  int nproc = 1;
  /// OMP_NUM_THREADS of each rank.
  int threads_per_rank = 1;
  /// Extra environment of every rank (overrides the launcher's own and torchrun's).
  std::map<std::string, std::string> env;
  /// Ranks not started (tests of a rank that never arrives); their exit code is kNotLaunched.
  std::vector<int> absent_ranks;
  /// Where rank r's stdout and stderr go; an empty path (or no function) inherits the
  /// launcher's.
  std::function<std::string(int rank)> log_path;
  /// The rank's work, run in a fork()ed copy of the launcher instead of starting `executable`
  /// (see above): it sees the rank's environment through getenv, OMP_NUM_THREADS applied with
  /// at::set_num_threads, and its return value is the rank's exit status (an exception: 1).
  /// The copy then ends with std::_Exit after flushing stdio (no atexit handler, no static
  /// destructor); a rank_main that wants them ends the process itself with std::exit, as a
  /// main() returning would. Empty, or with other threads alive, the rank runs `executable`.
  std::function<int()> rank_main;
  /// Several nodes, one launcher each (as torchrun's agents with --nnodes): node `node_rank` of
  /// `nnodes` starts global ranks node_rank * nproc ... + nproc - 1 (WORLD_SIZE nnodes * nproc);
  /// node 0's launcher serves the store on master_addr:master_port (an address of its own on
  /// the nodes' network), and the other nodes' ranks and launchers connect to it. After its own
  /// ranks ended, node 0's launcher keeps serving until every node's launcher is done, for
  /// `linger` at most. One node: loopback and a free port.
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  std::chrono::milliseconds linger{std::chrono::seconds(60)};
  /// Bounds the whole job: then every rank still running is killed (zero: no bound).
  std::chrono::milliseconds timeout{0};
  /// After the first rank fails, the others have this long to notice a dead peer and exit on
  /// their own before they are killed (negative: they are waited for, up to `timeout`).
  /// Not with replica restarts, where a failure ends only its replica.
  std::chrono::milliseconds grace_after_failure{-1};

  /// A fault-tolerant job's launching (fsdp/distributed/replica_quorum.h): a rank that ends with
  /// anything but 0 ends only its replica (its `ranks_per_replica` consecutive ranks), whose
  /// other ranks get `grace` to leave on their own (a replica that lost a rank leaves the job)
  /// before they are killed; `delay` after the last of them ended, the replica's ranks start
  /// again, spawned (never forked: the store's threads run by then), with
  /// FSDP_REPLICA_INCARNATION=n for its n-th start (counted in the store, so that a node's
  /// launcher started again, a lost host back, starts its ranks as joining too), and join the
  /// running job. At most `max_restarts` per replica by this launcher; the other replicas run on
  /// throughout, and the job ends when every rank has ended. Replicas lie within a node. The
  /// launcher names each rank's process on stderr as it starts it ("fsdp launch: ranks 0-3
  /// started (pids ...)", "... replica 1 restarted (incarnation 1, pid ...)").
  struct ReplicaRestarts {
    int ranks_per_replica = 1;
    int max_restarts = 3;
    std::chrono::milliseconds grace{std::chrono::seconds(30)};
    std::chrono::milliseconds delay{0};
    /// A rank that exits with this code says the job cannot go on (no live replica holds the
    /// state, ReplicaStateLost): no replica is started again, and the job ends as its ranks do.
    /// -1: none.
    int job_over_exit_code = -1;
    /// A rank that exits with this code refused its input (a config or a file): its replica is
    /// started once more (the refusal may have been a passing read error), and not after two
    /// runs in a row that refused. -1: none.
    int refused_input_exit_code = -1;
  };
  std::optional<ReplicaRestarts> replica_restarts;
};

struct LocalLaunchResult {
  static constexpr int kNotLaunched = -1;
  /// Per rank: the exit status, 128 + the signal if one killed it, kNotLaunched if absent.
  std::vector<int> exit_codes;
  /// Per rank: seconds from the launch until the rank was reaped.
  std::vector<double> exit_seconds;
  /// Per rank: the process id (0 if absent). Every one has been reaped.
  std::vector<int> pids;
  /// The ranks were fork()ed copies running rank_main (else: spawned executables).
  bool forked = false;
  /// The first rank (in the order they exited) that failed, or -1.
  int first_failed = -1;
  /// With replica restarts: how many times each replica was restarted.
  std::vector<int> restarts;
  /// `timeout` was reached and the remaining ranks were killed.
  bool timed_out = false;
  double seconds = 0;
};

/// Hosts a TCPStore on a free loopback port and runs options.nproc ranks with RANK,
/// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
/// TORCHELASTIC_USE_AGENT_STORE=True (the store is the launcher's, as under torchrun),
/// TORCHELASTIC_RESTART_COUNT=0 and OMP_NUM_THREADS set, and the launcher's own rank variables
/// (SLURM_*, GROUP_RANK, TORCHELASTIC_RUN_ID) removed. Returns when every rank has exited;
/// on any way out (an exception too) the ranks still running are killed and reaped.
LocalLaunchResult launch_local_ranks(const LocalLaunchOptions& options);

/// Whether this process runs no thread but the calling one: only then does a fork() copy all of
/// it (launch_local_ranks forks its ranks only then).
bool single_threaded();

/// In a rank started by launch_local_ranks: dies with the launcher (SIGKILL on its death), and
/// exits at once if the launcher already died. Does nothing in a process it did not start.
void die_with_launcher();

}  // namespace fsdp
