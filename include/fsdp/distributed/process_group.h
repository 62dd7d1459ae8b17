// Process groups: who this process is, how many there are, and the c10d backend they talk through.
//
// Ranks come from the launcher's environment (torchrun, SLURM, or our own launchers), the
// rendezvous is a c10d TCPStore, and collectives run on a c10d backend: Gloo for CPU tensors,
// NCCL for CUDA tensors (link fsdp::cuda to register it). Every blocking step has a timeout, so
// a rank that never arrives or dies makes the others fail with a message instead of hanging.
#pragma once

#include <torch/arg.h>

#include <c10/core/DeviceType.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fsdp/distributed/comm_stats.h>

namespace c10d {
class Backend;
class Store;
}  // namespace c10d

namespace fsdp {
namespace detail {
class CollectiveCheck;
class PeerProgress;
struct GroupAccess;
}  // namespace detail

/// Where this process sits in the job, read from the environment.
struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  /// torchrun (and our test launcher) host the TCPStore in the agent process: no rank serves it.
  bool agent_store = false;
  /// Our key prefix in a store that outlives restarts (torchrun's agent store): derived from
  /// TORCHELASTIC_RESTART_COUNT as "/worker/attempt_<n>", so a restarted job never sees the
  /// keys of an earlier attempt.
  std::string store_prefix;
  /// "torchrun", "slurm" or "single": which variables were used.
  std::string source = "single";
  /// FSDP_REPLICA_INCARNATION: 0 at the job's start; n > 0 in a process that a fault-tolerant
  /// job's launcher restarted (the n-th time for its replica, fsdp/distributed/replica_quorum.h):
  /// it joins the running job instead of its start, and init_process_group() gives it a world
  /// group without a backend (see ProcessGroup::has_backend).
  int incarnation = 0;
};

/// Reads RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT (torchrun), or
/// SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID/SLURM_NTASKS_PER_NODE/SLURM_LAUNCH_NODE_IPADDR, or
/// defaults to a single process. A malformed value throws, naming the variable.
LaunchEnv launch_env_from_environment();

struct ProcessGroupOptions {
  /// "gloo" (CPU tensors) or "nccl" (CUDA tensors; needs fsdp::cuda linked in).
  TORCH_ARG(std::string, backend) = "gloo";
  /// Bounds the rendezvous and every collective: a missing or dead rank fails the others
  /// after this long.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
  /// Host name or address Gloo binds to; empty: MASTER_ADDR when it is a loopback address,
  /// else this machine's host name.
  TORCH_ARG(std::string, gloo_hostname) = "";
  /// Gloo: independent Gloo contexts ("lanes") per group, each with its own connections and
  /// one worker thread; fsdp's collectives take them in turn, so up to this many run at once
  /// (a prefetched all-gather next to a reduce-scatter, the buckets of one all-gather). One
  /// thread per context, not c10d's several: two all-gathers running on one Gloo context at
  /// once corrupt the heap (measured with torch 2.15: a 3-rank stress of queued
  /// allgather_coalesced calls on 2 threads crashed in about half the runs, and never on
  /// separate contexts). NCCL ignores it.
  TORCH_ARG(int, gloo_lanes) = 2;
  /// Gloo: where the group's tensors live. kCUDA lets several ranks share one GPU (NCCL refuses
  /// two ranks on one device): every collective then moves through host memory
  /// (collectives.h), so it tests placement and stream order on a GPU, not NCCL's speed.
  /// NCCL ignores it (always kCUDA).
  TORCH_ARG(c10::DeviceType, gloo_device) = c10::kCPU;
  /// Debug mode: every this many collectives, the ranks of each group compare (through the
  /// rendezvous store) the sequence of collectives each issued, and every rank throws one
  /// message naming the first collective where they differ and what each rank issued there
  /// (src/distributed/collective_check.h). 1 checks before every collective; 0 is off. When 0,
  /// init_process_group() takes FSDP_CHECK_COLLECTIVES from the environment.
  TORCH_ARG(int, check_collectives) = 0;
  /// Benchmark mode, not training: every collective of the group (and of its subgroups) is
  /// replaced by a local copy of the same bytes, and nothing reaches the backend. all_gather
  /// writes this rank's input into every rank's slot of the output; reduce_scatter copies this
  /// rank's own block of its input into the output (the sum or mean "over one rank");
  /// all_reduce and broadcast leave the tensor as it is. Calls and bytes are counted in
  /// CommStats as usual (the same sizes), sent_bytes stays 0. Barriers stay real (they order
  /// setup: data preparation, checkpoint writes; a training step issues none), send and recv
  /// are refused. The step then does all of its arithmetic and none of its communication:
  /// bench/bounds.py's compute-only step. Results (the loss above all) are not the model's.
  /// When false, init_process_group() takes FSDP_BENCH_LOCAL_COLLECTIVES=1 from the
  /// environment; rank 0 says on stderr that the mode is on.
  TORCH_ARG(bool, bench_local_collectives) = false;
};

/// A group of ranks and the c10d backend its collectives run on. Create with
/// init_process_group(); subgroups with new_group(). Thread-compatible, not thread-safe.
/// Its backend is not handed out: every collective goes through fsdp/distributed/collectives.h
/// (all_reduce, all_gather, send, ...), so that comm_stats() counts all the traffic and the
/// collective-sequence check sees every collective.
class ProcessGroup : public std::enable_shared_from_this<ProcessGroup> {
 public:
  /// `lanes`: one or more backends over the same ranks (see ProcessGroupOptions::gloo_lanes);
  /// none for the world group of a process that joins a running job (LaunchEnv::incarnation).
  /// `name`: how the flight recorder names the group (every member must give the same one);
  /// subgroups are named "<parent>/<k>" for the parent's k-th new_group().
  ProcessGroup(c10::intrusive_ptr<c10d::Store> store,
               std::vector<c10::intrusive_ptr<c10d::Backend>> lanes, int rank, int size,
               std::vector<int> global_ranks, ProcessGroupOptions options,
               std::string name = "world");
  ~ProcessGroup();

  int rank() const { return rank_; }
  int size() const { return size_; }
  /// Global rank of each member, in group-rank order.
  const std::vector<int>& global_ranks() const { return global_ranks_; }
  const std::string& backend_name() const { return options_.backend(); }
  /// kCUDA for NCCL, ProcessGroupOptions::gloo_device for Gloo: where tensors handed to
  /// collectives must live.
  c10::DeviceType device_type() const;
  std::chrono::milliseconds timeout() const { return options_.timeout(); }
  int num_lanes() const { return static_cast<int>(lanes_.size()); }
  /// False for the world group of a process that joined a running job (LaunchEnv::incarnation):
  /// the other ranks made their backend long ago, and some may be dead. Such a group only makes
  /// members_group()s (as ReplicaQuorum does); a collective, a barrier or a collective subgroup
  /// on it is refused.
  bool has_backend() const { return !lanes_.empty(); }
  /// "world", or "<parent>/<k>" (see the constructor): the name in flight-recorder dumps.
  const std::string& name() const { return name_; }
  /// Whether the collective-sequence check (ProcessGroupOptions::check_collectives) is on.
  bool checks_collectives() const { return check_ != nullptr; }
  /// Whether collectives are local copies (ProcessGroupOptions::bench_local_collectives).
  bool bench_local_collectives() const { return options_.bench_local_collectives(); }

  /// Counters of every collective issued through fsdp-cpp on this group.
  CommStats& comm_stats() { return stats_; }
  const CommStats& comm_stats() const { return stats_; }

  /// A group over `ranks` (group ranks of this group, ascending). Every member of this group
  /// must call it with the same arguments, in the same order; non-members get nullptr.
  std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks);
  /// A group over `ranks` (group ranks of this group, ascending, this rank among them) that only
  /// its members create: the others need not call it, and may be dead (fault tolerance rebuilds
  /// the groups of the replicas still alive). Every member gives the same `tag`, used once in
  /// the job's store (an epoch, a step); the group is named "<this group>/<tag>".
  std::shared_ptr<ProcessGroup> members_group(const std::vector<int>& ranks,
                                              const std::string& tag);

  /// The subgroup of `block_size` consecutive ranks that holds this rank: ranks
  /// [r / block_size * block_size, ... + block_size). With ranks placed node by node, one
  /// block is one node when block_size is the ranks per node. Collective the first time
  /// (every rank creates every block, in the same order); cached after. block_size must
  /// divide size(); block_size == size() returns this group itself.
  std::shared_ptr<ProcessGroup> block_group(int block_size);
  /// The subgroup of the ranks at the same position in every block of `block_size`: ranks
  /// {r % block_size, r % block_size + block_size, ...}. Same rules as block_group();
  /// block_size == size() gives a group of one rank (this one).
  std::shared_ptr<ProcessGroup> strided_group(int block_size);

  /// Blocks until every rank of the group arrives (bounded by timeout()).
  void barrier();

 private:
  std::shared_ptr<ProcessGroup> subgroup(const std::vector<int>& ranks, const std::string& prefix,
                                         const std::string& what, const std::string& name);
  // The backend, the lanes, the store and the check are for src/distributed alone
  // (src/distributed/group_access.h).
  friend struct detail::GroupAccess;
  c10d::Backend& first_lane() const;
  /// The lane for the next collective, in turn. Every rank issues the same collectives on a
  /// group in the same order, so every rank picks the same lane for each of them.
  c10d::Backend& next_lane();
  // Throws, naming `what`, on a group without a backend.
  void require_backend(const char* what) const;

  c10::intrusive_ptr<c10d::Store> store_;
  std::vector<c10::intrusive_ptr<c10d::Backend>> lanes_;
  size_t next_lane_ = 0;
  // Collectives issued on this group (point-to-point excluded): the number every member gives
  // the same collective in the flight recorder.
  uint64_t sequence_ = 0;
  std::string name_;
  // The world group's progress reporter (src/distributed/peer_progress.h); null elsewhere.
  std::shared_ptr<detail::PeerProgress> progress_;
  int rank_;
  int size_;
  std::vector<int> global_ranks_;
  ProcessGroupOptions options_;
  CommStats stats_;
  std::unique_ptr<detail::CollectiveCheck> check_;
  int subgroups_created_ = 0;
  std::map<std::pair<int, bool>, std::shared_ptr<ProcessGroup>> splits_;
};

/// Joins the job described by `env` and returns the world group. Fails with one clear
/// message (which ranks did not arrive, which address could not be reached) after
/// options.timeout().
std::shared_ptr<ProcessGroup> init_process_group(const LaunchEnv& env,
                                                 const ProcessGroupOptions& options = {});
/// Same, with the environment read by launch_env_from_environment().
std::shared_ptr<ProcessGroup> init_process_group(const ProcessGroupOptions& options = {});

/// A group of `size` ranks in which this process plays rank `rank` alone, connected to nobody:
/// its collectives are local copies (ProcessGroupOptions::bench_local_collectives), counted in
/// its CommStats with the sizes the real group's would have; barriers, subgroups and
/// point-to-point are refused. It lets one process build and run what one rank of a group would
/// (the planner measures a tensor-parallel rank's part of a model with it: its shapes, its
/// activations, its collectives' calls and bytes); the values it computes are not the group's.
/// Ranks in `global_ranks()` are 0..size-1.
std::shared_ptr<ProcessGroup> local_group(int size, int rank, const std::string& name = "local");

/// Whether a collective of this process failed with the job's store out of reach (the failure's
/// diagnosis could not read the peers' reports: this host is cut off from the rendezvous host).
/// A launcher agent waiting on that store cannot learn that the job is over (see
/// cut_off_torchrun_agent).
bool store_out_of_reach();

/// Under torchrun, once store_out_of_reach(): the pid of this rank's torchrun agent (its
/// parent), which would otherwise wait on the unreachable store for ever (torch 2.15's agent
/// retries its rendezvous reads after a link cut and notices its failed workers only between
/// them); 0 where there is none to end (not cut off, not under torchrun, or the parent is not
/// torchrun, or the store at MASTER_ADDR:MASTER_PORT accepts a connection again within 2 s).
int cut_off_torchrun_agent();

/// Ends torchrun agent `pid` (from cut_off_torchrun_agent; call it from the main thread, once
/// this rank has said why it fails). First it waits, at most `siblings_grace`, until each of the
/// agent's other workers (this host's other ranks) has exited or is here too (its process named
/// "fsdp-cut-off"): the agent stops its workers when it ends, and a rank still writing its own
/// error would lose it. Then SIGTERM, after which the agent stops its workers, this rank
/// included, and exits; if it has not within `grace` (its handler runs only between its store
/// calls, and a call may retry without end), SIGKILL.
void end_torchrun_agent(int pid, std::chrono::milliseconds grace = std::chrono::seconds(5),
                        std::chrono::milliseconds siblings_grace = std::chrono::seconds(10));

/// Creates a backend for a named c10d backend; fsdp::cuda registers "nccl".
using BackendFactory = std::function<c10::intrusive_ptr<c10d::Backend>(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    const ProcessGroupOptions& options)>;
void register_backend(const std::string& name, BackendFactory factory);

}  // namespace fsdp
