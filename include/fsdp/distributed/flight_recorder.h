// The flight recorder: every rank remembers its last N collectives, so that after a hang or a
// failure one can see where each rank was, which collective the ranks disagreed on, and who
// never arrived.
//
// A timed-out collective says only that it timed out. What one needs to know is which rank did
// not join it and what that rank was doing instead: a rank that stalled, died, or took another
// branch and issued a different collective. PyTorch's NCCL flight recorder
// (TORCH_NCCL_TRACE_BUFFER_SIZE, analysed by torchfrtrace) answers it from per-rank ring
// buffers dumped at the failure; this is the same idea for every backend fsdp-cpp drives.
//
// Every collective goes through fsdp/distributed/collectives.h, which records it here when it is
// issued and moves it through its states as it is waited for. On a failed collective the record
// is dumped (to dump_dir(), when set) together with what the other ranks last reported of
// their progress (see PeerReport), and the error names the ranks that never arrived. A dump can
// also be asked for: dump(), dump_on_signal(SIGUSR1), and the trainer dumps on a failed step.
// fsdp/distributed/flight_analysis.h merges the dumps of a job and names the culprit.
//
// Cost: one record per collective (a few strings, under a mutex), i.e. a few per unit and step;
// measured in bench (docs/multi-node.md, "Flight recorder").
#pragma once

#include <csignal>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace fsdp {

/// Where a recorded collective is. Transitions (FlightRecorder::transition, the one place
/// that changes a state): kIssued -> kWaiting (a thread began waiting for it) -> kCompleted or
/// kFailed. A collective that fails before anyone waits goes kIssued -> kFailed.
enum class CollectiveState { kIssued, kWaiting, kCompleted, kFailed };
const char* to_string(CollectiveState s);

/// One collective as this rank issued it.
struct CollectiveRecord {
  /// This rank's order of issue over all groups (1, 2, ...).
  uint64_t id = 0;
  /// The group: "world", or its parent's name and the subgroup's creation number ("world/3").
  /// Every member names a group the same way.
  std::string group;
  /// The collective's number within its group (1, 2, ...): every rank of the group gives the
  /// same collective the same number, since backends match collectives by order alone. 0 for
  /// point-to-point messages, which are not in the group's common sequence.
  uint64_t seq = 0;
  /// "all-gather", "reduce-scatter", "all-reduce", "broadcast", "barrier", "send", "recv".
  std::string kind;
  /// Who issued it, as passed to the collective ("unit 'h3'"); empty if nobody said.
  std::string context;
  int64_t bytes = 0;
  std::string dtype;
  /// The whole description, as in errors and the collective-sequence check; two ranks that
  /// issue the same collective have the same description.
  std::string description;
  /// Unix time in seconds; 0: not yet. `started` is when a thread began waiting for it: the
  /// moment this rank stood at the collective, whatever the backend did before.
  double issued = 0, started = 0, completed = 0;
  CollectiveState state = CollectiveState::kIssued;
  /// Why it failed (first line of the backend's error).
  std::string error;
};

/// What a peer last reported of its progress (through the rendezvous store, once a second),
/// read when a collective fails. The rank that did not reach the failed collective, or went
/// silent, is the one to look at.
struct PeerReport {
  int rank = 0;
  std::string host;
  int pid = 0;
  /// Whether anything was read from this rank at all.
  bool heard = false;
  /// Seconds between its last report and the moment it was read.
  double age_s = 0;
  /// When it wrote its last report, by its own clock: compared only with its earlier reports
  /// (a reader that sees it unchanged for long enough on its own clock knows the peer stopped,
  /// whatever the two hosts' clocks say).
  double reported_at = 0;
  /// Its progress on the group of the failed collective: the last collective number it issued
  /// and the last it completed, and the description of the last issued.
  uint64_t issued = 0, completed = 0;
  std::string last;
  /// "behind", "silent", "reached" or "unknown": reached = it issued the failed collective too.
  std::string verdict;
};

/// What a collective's waiter needs to find its record again (collectives.h keeps one in each
/// CollectiveWork). id 0: not recorded.
struct RecordTicket {
  uint64_t id = 0;
  std::string group;
  uint64_t seq = 0;
};

/// The process-wide recorder. Thread-safe.
class FlightRecorder {
 public:
  /// The one recorder of this process (never destroyed: threads still reporting at exit may
  /// use it).
  static FlightRecorder& global();

  /// How many records are kept (the oldest go first); 0 turns recording off. Default: 2000, or
  /// FSDP_FLIGHT_RECORDER=<entries> from the environment.
  void set_capacity(size_t entries);
  size_t capacity() const;
  /// Where dumps go (<dir>/rank<R>.json); empty: only dump_to() writes. Default:
  /// FSDP_FLIGHT_RECORDER_DIR from the environment.
  void set_dump_dir(const std::string& dir);
  std::string dump_dir() const;
  /// Who this process is in the job; init_process_group() sets it.
  void set_identity(int rank, int world_size);

  /// The members (global ranks) of a group, for the dumps; ProcessGroup registers itself.
  void register_group(const std::string& name, const std::vector<int>& global_ranks);

  /// Records a collective being issued; fills in id and issued, returns the id.
  uint64_t issue(CollectiveRecord record);
  /// Moves the ticket's record to `to` (see CollectiveState) and stamps the time; a record
  /// that has already left the ring is only counted in the group's progress (from the ticket's
  /// group and number).
  void transition(const RecordTicket& ticket, CollectiveState to, const std::string& error = "");
  /// Per group: the last collective number issued and completed, and the last description.
  struct GroupProgress {
    uint64_t issued = 0, completed = 0;
    std::string last;
  };
  std::map<std::string, GroupProgress> progress() const;

  /// The records kept, oldest first.
  std::vector<CollectiveRecord> records() const;
  /// Attaches the peers' reports read at a failure to the next dumps.
  void set_peer_reports(std::vector<PeerReport> reports);

  /// The dump as JSON: identity, reason, the records and the peer reports.
  std::string to_json(const std::string& reason) const;
  /// Writes to_json(reason) atomically to dump_dir()/rank<R>.json and returns the path; ""
  /// when no dump directory is set. Never throws: a dump is written while something else
  /// already failed (a failure to write is reported on stderr).
  std::string dump(const std::string& reason) noexcept;
  /// Same, to `path`; throws std::runtime_error naming the path if it cannot be written.
  void dump_to(const std::string& path, const std::string& reason) const;
  /// Dumps (to dump_dir()) whenever this process receives `sig`, from a thread of its own (a
  /// signal handler cannot write files safely). Replaces the signal's handler.
  void dump_on_signal(int sig = SIGUSR1);
  /// Dumps (to dump_dir(), when set) before the process terminates on an uncaught exception,
  /// then calls the terminate handler that was there before. Gloo aborts the process this way
  /// when ranks issue collectives of different sizes: the rank that aborts is often one that
  /// did nothing wrong, and its dump is what shows the others' mistake. init_process_group()
  /// installs it once.
  void dump_on_terminate();

 private:
  FlightRecorder();
  void allocate_ring();
  CollectiveRecord* find(uint64_t id);

  mutable std::mutex mutex_;
  size_t capacity_;
  std::vector<CollectiveRecord> ring_;  // ring_[(id - 1) % capacity_]
  uint64_t last_id_ = 0;
  std::map<std::string, GroupProgress> progress_;
  std::vector<PeerReport> peers_;
  std::map<std::string, std::vector<int>> groups_;
  std::string dump_dir_;
  int rank_ = 0, world_size_ = 1;
};

/// Unix time in seconds (what the records hold).
double unix_seconds();

}  // namespace fsdp
