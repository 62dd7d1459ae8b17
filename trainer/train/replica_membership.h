// fsdp.fault_tolerant: the trainer's side of fsdp::ReplicaQuorum (fsdp/distributed/
// replica_quorum.h). Each hybrid_shard block is a replica; this part runs the quorum's protocol
// around the trainer's steps (attempt, vote, reform and attempt again; admit the replicas that
// asked to come back), applies fsdp.membership_schedule, and records every change in the run
// directory's membership.jsonl. What the trainer does on a change (give the units the new
// cross-replica group, move the figures to the live ranks, copy its state to joining ranks) it
// passes in as hooks: the protocol stays here, the training state stays in the Trainer.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fsdp/distributed/process_group.h>
#include <fsdp/distributed/replica_quorum.h>

#include "config/config.h"

namespace fsdp_trainer {

/// What a rank whose replica left the job throws: fsdp-train then exits with kExitCode, and a
/// launcher with replica restarts (--nproc) starts the replica's ranks again.
class LeftTheJob : public std::runtime_error {
 public:
  static constexpr int kExitCode = 75;  // EX_TEMPFAIL: try again
  using std::runtime_error::runtime_error;
};

/// fsdp-train's exit code when no live replica holds the state (fsdp::ReplicaStateLost): the
/// launcher then starts no replica again.
inline constexpr int kStateLostExitCode = 69;  // EX_UNAVAILABLE

/// The first line of an error: collectives' errors run to several.
std::string first_line(const std::exception& e);

class ReplicaMembership {
 public:
  struct Hooks {
    /// After every change of the live replicas: the groups to use are the quorum's now.
    std::function<void(int64_t step)> changed;
    /// After a change that admitted replicas: every live rank passes its state to
    /// quorum().sync_state; the joining ranks (`joining`) then take what they received.
    std::function<void(bool joining)> sync_state;
    /// This rank's replica was dropped by the schedule and waits to be added back: what it
    /// wrote as the lowest live rank is another's to write now.
    std::function<void()> dropped;
  };

  /// Collective over `world` at the job's start; a restarted replica's ranks (`incarnation` >
  /// 0, world without a backend) make their replica group only, and then call join().
  ReplicaMembership(const Config& config, std::shared_ptr<fsdp::ProcessGroup> world,
                    int incarnation, Hooks hooks);

  fsdp::ReplicaQuorum& quorum() { return *quorum_; }
  bool restarted() const { return incarnation_ > 0; }
  /// Outside the membership at the start, to come in through join(): a restarted replica, or
  /// a spare (fsdp.spare_replicas).
  bool joining() const { return joining_; }
  /// Whether this rank writes the run's outputs: the lowest rank training now.
  bool writer() const;

  /// A replica training from the start: records the membership at `first_step` (1, or the
  /// step after the checkpoint resumed from, where membership.jsonl keeps the changes before
  /// it) in membership.jsonl.
  void start(int64_t first_step);
  /// A restarted replica or a spare: asks to come in and waits for the step boundary that
  /// admits it (its state copied from a replica that stayed); returns the step it trains next,
  /// or fsdp::ReplicaQuorum::kFinished when training ended first (a spare never needed).
  /// Throws LeftTheJob if a restarted replica is not admitted within the vote timeout and a
  /// minute.
  int64_t join();
  /// Training is over (a live rank): ranks still waiting in join() stop waiting.
  void finish();
  /// Before step `step`: fsdp.membership_schedule's change at it, if any. Throws LeftTheJob
  /// when the schedule drops this rank's replica (after it waited to be added back, when the
  /// schedule says so, it returns normally from the step it was added at: see resume_step()).
  void before_step(int64_t step);
  /// Runs `attempt` (the step's forward and backward; false or an exception: it failed) until
  /// the live replicas commit step `step`, reforming after each failure. Throws LeftTheJob when
  /// this rank's replica is dropped.
  void commit(int64_t step, const std::function<bool()>& attempt);
  /// After step `step` is committed and applied: admits the replicas that asked to come back
  /// (they train from step + 1).
  void after_step(int64_t step);
  /// Something between steps failed on this rank's groups (a checkpoint's collectives): its
  /// next attempt fails without running, and the live replicas reform.
  void groups_failed() { broken_ = true; }
  /// Set by before_step when the schedule added this replica back after it had been dropped:
  /// the step it trains from (the steps in between are the others'), else -1.
  int64_t resume_step() const { return resume_step_; }

 private:
  // After a change to the quorum's groups (step: the first step they train): the hook, then
  // record().
  void changed(int64_t step, const char* cause);
  // The writer's line of membership.jsonl and of its output.
  void record(int64_t step, const char* cause);
  int rank() const;
  // Asks (or, for the schedule, waits) to come back; the step it trains from.
  int64_t rejoin(bool ask, std::chrono::milliseconds timeout);

  Config config_;
  int incarnation_;
  bool joining_ = false;  // see joining()
  Hooks hooks_;
  std::unique_ptr<fsdp::ReplicaQuorum> quorum_;
  std::map<int64_t, std::vector<int>> schedule_;
  bool broken_ = false;  // an admission or a save failed: the next attempt fails, and reforms
  int64_t resume_step_ = -1;
};

}  // namespace fsdp_trainer
