// Fault tolerance without restarts: the data-parallel replica is the unit of failure. A job of R
// replicas of k ranks each (global ranks r*k .. r*k+k-1 form replica r; hybrid_shard with
// hybrid_shard_size k shards inside a replica and averages across replicas) keeps training when a
// replica loses a rank: the other replicas drop it and go on among themselves, as torchft's
// Manager does with its Lighthouse, here with the job's rendezvous store as the arbiter (it lives
// in the launcher or torchrun's agent, not in a rank, so it outlives any rank).
//
// Per step, the protocol is
//   1. the step's forward and backward on the current groups; a collective that fails (a peer
//      died, or stalled past the timeout) throws, and the engine rolls the pass back;
//   2. commit(step, ok): every rank of the live replicas votes through the store; the step is
//      committed (the optimizer may step) only when all of them voted ok. One "not ok" vote, or a
//      missing one after the timeout, fails it for everyone: the store decides, so no two
//      survivors disagree on whether a step happened, wherever the fault struck;
//   3. after a failed commit, reform(step): the survivors register, wait up to the join window
//      for each other, and the first to write a decision (compare-and-set) fixes the new
//      membership for all: the replicas every rank of which registered. The groups over the
//      live replicas are rebuilt under a new tag (ProcessGroup::members_group; c10d backends, no
//      transport of our own), the step is run again by them: its gradient is the mean over the
//      live replicas' samples. A rank whose replica is not in the decision leaves.
// A replica that left comes back (healing from a peer, not from disk): its ranks ask to rejoin
// (rejoin), the next committed step's outcome admits every replica all of whose ranks asked, the
// live ranks call admit() before their next step, and everyone calls sync_state(): the joining
// ranks receive this index's shards and optimizer state from the rank at the same index of a
// replica that stayed (a broadcast over the cross-replica group) and every member checks a
// checksum of them against the others'.
// set_membership() makes the same changes without a fault (dropping or adding replicas), so that
// a run given the membership schedule of a faulty run (which steps, which replicas) is its
// fault-free reference.
// The state lives only in the live replicas. Every change records the membership in the store;
// once every replica of the last one has lost a process (each has a rank whose process was
// restarted, or the decision kept none), no copy of the state is left, and rejoin() throws
// ReplicaStateLost at once instead of waiting for an admission nobody can give.
#pragma once

#include <torch/arg.h>
#include <torch/types.h>

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace c10d {
class Store;
}

namespace fsdp {

class ProcessGroup;

struct ReplicaQuorumOptions {
  /// Ranks per replica (k): divides the world size.
  TORCH_ARG(int, ranks_per_replica) = 1;
  /// How long commit() waits for a vote that does not come, and reform() for a survivor to
  /// register (a rank stopped, or its collective still waiting on a dead peer): longer than the
  /// process group's collective timeout, so that the ranks stuck in a collective vote "not ok"
  /// before the others give up on them (checked). 0: that timeout plus 30 s.
  TORCH_ARG(std::chrono::milliseconds, vote_timeout) = std::chrono::milliseconds(0);
  /// Without progress reports (FSDP_PEER_PROGRESS=0), how long reform() waits for the
  /// survivors to register before deciding; a survivor later than that is left out (and
  /// leaves). With them (the default) a missing rank is waited for until its reports stop.
  TORCH_ARG(std::chrono::milliseconds, join_window) = std::chrono::seconds(3);
  /// 0 at the job's start. n > 0: this replica's processes were restarted (the n-th time; every
  /// rank of the replica gives the same n, LaunchEnv::incarnation) and join the running job:
  /// the world group is then one without a backend (init_process_group's for such a process),
  /// the quorum starts as a replica that left, and rejoin() asks to come in.
  TORCH_ARG(int, incarnation) = 0;
  /// The most replicas that train at once (0: all of them). Replicas max_live .. R-1 are
  /// spares: they start as replicas that left, wait in rejoin(), and the next committed step
  /// after a live replica has gone admits as many as the membership has room for (lowest
  /// first); a replica that joins a full job waits likewise.
  TORCH_ARG(int, max_live) = 0;
};

/// What rejoin() throws when no live replica holds the state any more: the job cannot go on
/// without a checkpoint (a launcher must not start replicas again for it).
class ReplicaStateLost : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// One membership change: from `step` on, the replicas `live` train (ascending).
struct MembershipChange {
  int64_t step = 0;
  std::vector<int> live;
};

/// Needs a store that no rank serves (fsdp-train --nproc's launcher, torchrun's agent store, the
/// tests' harness: LaunchEnv::agent_store), or the loss of the rank serving it ends the job;
/// and Gloo (CPU tensors).
class ReplicaQuorum {
 public:
  /// Collective over `world`, the world group, all ranks alive: builds each replica's group and
  /// the cross-replica groups (world->block_group(k), world->strided_group(k)), the ones
  /// fully_shard builds for hybrid_shard_size k. With options.incarnation() > 0 (a restarted
  /// replica), collective over this replica's ranks only: builds their replica group and, until
  /// rejoin() admits them, a replicate group of this rank alone (for fully_shard's
  /// replicate_group option; the model is built before rejoin, so the live ranks do not wait).
  /// With spares (options.max_live()), the live replicas' cross-replica groups are made among
  /// themselves, and a spare gets a replicate group of its rank alone, as a restarted one.
  ReplicaQuorum(std::shared_ptr<ProcessGroup> world, ReplicaQuorumOptions options);
  ~ReplicaQuorum();
  ReplicaQuorum(const ReplicaQuorum&) = delete;
  ReplicaQuorum& operator=(const ReplicaQuorum&) = delete;

  int replica() const { return replica_; }
  int num_replicas() const { return num_replicas_; }
  /// This rank's place in its replica (its shard of every parameter).
  int index() const { return index_; }
  /// How many times the membership changed.
  uint64_t epoch() const { return epoch_; }
  /// The replicas training now, ascending.
  const std::vector<int>& live() const { return live_; }
  /// Whether this rank's replica is out of the membership (it left, or it is a spare or a
  /// restarted replica not admitted yet): rejoin() is its way in.
  bool left() const { return left_; }
  /// Every change so far (the membership schedule), the first being the initial one at step 0.
  const std::vector<MembershipChange>& schedule() const { return schedule_; }

  /// This replica's ranks (the shard group), made anew at every change of the membership:
  /// give it to fsdp::set_shard_group then (a Gloo collective that timed out in the fault has
  /// closed the old group's connections for good).
  const std::shared_ptr<ProcessGroup>& replica_group() const { return replica_group_; }
  /// The ranks at this rank's index in every live replica: the cross-replica all-reduce's group
  /// (give it to fsdp::set_replicate_group after each change). In a restarted replica not yet
  /// admitted: this rank alone.
  const std::shared_ptr<ProcessGroup>& replicate_group() const { return replicate_group_; }
  /// Every rank of the live replicas (for what the job reduces over all of them: a loss).
  const std::shared_ptr<ProcessGroup>& live_group() const { return live_group_; }

  /// Whether step `step` is committed: this rank's part succeeded (`ok`), and so did every
  /// other live rank's. False as soon as one votes not ok, or when a vote is missing after
  /// vote_timeout. Every live rank calls it once per attempt at a step.
  bool commit(int64_t step, bool ok);
  /// After a failed commit: agrees with the other survivors on the replicas still complete and
  /// rebuilds the groups over them. Returns false when this rank's replica is not among them:
  /// it must leave (its groups are dropped). Throws when a rank dies while the groups are made:
  /// the caller then votes the step failed (commit) and reforms again.
  bool reform(int64_t step);
  /// A change without a fault (a schedule): every live rank calls it at the same step with the
  /// same `live` (ascending). Replicas not in it leave (false for their ranks); replicas in it
  /// that are not live are admitted: their ranks wait in rejoin(ask = false), and everyone calls
  /// sync_state() next.
  bool set_membership(const std::vector<int>& live, int64_t step);

  // ---- Healing ----
  /// The replicas the last committed step admitted (all of whose ranks asked to rejoin): the
  /// live ranks call admit() before their next step.
  const std::vector<int>& admitted() const { return admitted_; }
  /// Live ranks, after a commit that admitted replicas: the groups include them from
  /// `next_step` on. Then sync_state().
  void admit(int64_t next_step);
  /// A rank whose replica left comes back: with `ask`, it asks to be admitted (rejoin requests
  /// are taken by the next committed step); without, it waits for a set_membership() that
  /// adds its replica. Returns the step it trains from next, -1 if not admitted within
  /// `timeout`, or kFinished once the live ranks called finish(). Then sync_state(). Throws
  /// ReplicaStateLost as soon as state_lost() says so.
  int64_t rejoin(std::chrono::milliseconds timeout, bool ask = true);
  static constexpr int64_t kFinished = -2;
  /// Live ranks, once training is over: ranks still waiting in rejoin() (spares never needed,
  /// restarted replicas not admitted yet) return kFinished at once instead of -1 at their
  /// timeout.
  void finish();

  /// What the job fixed at its start and a restarted replica cannot measure again with the
  /// others (the compute dtype chosen from every rank's matmul speeds): the first incarnation
  /// publishes it under `name` (any of its ranks; the same value from each), and a restarted
  /// rank reads it (waiting at most the store's timeout for it).
  void publish(const std::string& name, const std::string& value);
  std::string published(const std::string& name) const;
  /// Whether no live replica holds the state: the last recorded membership kept none, or every
  /// replica in it has a rank whose process was restarted and not admitted since. Fills `why`.
  bool state_lost(std::string* why = nullptr) const;
  /// After a change that admitted replicas (admit, rejoin, set_membership): `tensors` (this
  /// rank's shards and whatever else a replica holds the same, optimizer state included) and
  /// `blob` (may be null) of the rank at this index in the first replica that stayed go to every
  /// member of replicate_group() (a broadcast, in place; the admitted ranks' are overwritten);
  /// then each member's checksum of them is compared over the group, and a difference throws
  /// naming the tensor. `held`: what every member holds already and is not copied (the frozen
  /// weights a fine-tuning job reads from its model file), compared the same way. Members pass
  /// tensors of the same shapes in the same order.
  void sync_state(const std::vector<torch::Tensor>& tensors, std::string* blob,
                  const std::vector<torch::Tensor>& held = {});

 private:
  // commit()'s vote under the keys `base`.
  bool vote(const std::string& base, const std::vector<int>& voters, bool ok);
  // Whether `ranks` (all of them, or any) stopped reporting their progress: a report unchanged
  // for PeerProgress::silent_after() on this rank's own clock since it was first seen (never
  // comparing two hosts' clocks). False without reports.
  bool stopped(const std::vector<int>& ranks, bool all);
  // To membership `live` from `step` on (a new epoch); admits the replicas not live yet.
  bool change(const std::vector<int>& live, int64_t step);
  // The replicas not live all of whose ranks asked to rejoin.
  std::vector<int> join_requests() const;
  // The groups over `live` under `tag`; false (groups dropped) when this replica is not in it.
  bool rebuild(std::vector<int> live, int64_t step, const std::string& tag);
  // Records `live` as the membership of epoch_ in the store (kept when a later epoch's is
  // there already): what state_lost() reads.
  void record_membership(const std::vector<int>& live, int64_t step);
  std::vector<int> ranks_of(const std::vector<int>& replicas) const;
  // How many replicas may train at once (ReplicaQuorumOptions::max_live), and the ones that
  // do at the job's start: 0 .. most_live() - 1.
  int most_live() const;
  std::vector<int> first_live() const;

  std::shared_ptr<ProcessGroup> world_;
  ReplicaQuorumOptions options_;
  c10::intrusive_ptr<c10d::Store> store_;
  int k_;
  int num_replicas_;
  int replica_;
  int index_;
  uint64_t epoch_ = 0;
  std::vector<int> live_;
  std::vector<MembershipChange> schedule_;
  std::shared_ptr<ProcessGroup> replica_group_, replicate_group_, live_group_;
  bool left_ = false;
  uint64_t left_at_epoch_ = 0;         // admissions of this epoch or before are stale
  std::deque<std::string> old_votes_;  // the lowest live rank's last votes' keys, to delete
  // Per rank: its last report's own timestamp, and when this rank saw it change.
  std::map<int, std::pair<double, std::chrono::steady_clock::time_point>> last_report_;
  std::vector<int> admitted_;
  // The replicas of the last change that stayed (the sources of sync_state).
  std::vector<int> stayed_;
};

}  // namespace fsdp
