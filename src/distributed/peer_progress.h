// Who stalled: every rank reports its progress (the last collective it issued and completed on
// each group) to the rendezvous store once a second, so that a rank whose collective fails can
// say which peer never arrived, instead of only that the collective timed out.
//
// The report goes through the store, not the backend, because the backend is exactly what is
// stuck. A rank that is stopped (SIGSTOP) or dead stops reporting, so its last report ages; a
// rank that took another branch keeps reporting, but its collective with the failed one's
// number is a different one. Reading happens on a thread of its own and is abandoned after a
// deadline: when the link to the store is down, the read would block for the store's whole
// timeout. For the same reason the reporting thread is detached, not joined, when the group
// goes away. Private to src/distributed.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fsdp/distributed/flight_recorder.h>

namespace c10d {
class Store;
}

namespace fsdp::detail {

/// A failure's diagnosis found the store out of reach (fsdp::store_out_of_reach()).
void mark_store_out_of_reach();

class PeerProgress {
 public:
  /// Starts reporting this rank's progress every `interval` under "fsdp/progress/<rank>".
  PeerProgress(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
               std::chrono::milliseconds interval);
  /// Stops the reporter without waiting for it (it may be stuck on a dead link).
  ~PeerProgress();
  /// How long a rank's report may stay unchanged before it counts as stopped (several
  /// intervals: a busy rank's reporter may be late).
  std::chrono::milliseconds silent_after() const;
  PeerProgress(const PeerProgress&) = delete;
  PeerProgress& operator=(const PeerProgress&) = delete;

  /// What each of `ranks` (global ranks) last reported, judged against collective `seq` of
  /// `group` described as `description` (see PeerReport::verdict). nullopt when the store did
  /// not answer within `deadline`; then stale() is the last snapshot the reporter read.
  std::optional<std::vector<PeerReport>> read(const std::vector<int>& ranks,
                                              const std::string& group, uint64_t seq,
                                              const std::string& description,
                                              std::chrono::milliseconds deadline) const;
  /// The peers' reports as the reporter read them (at each report until every peer had
  /// reported once: their hosts do not change), judged the same way, their ages counted to
  /// now; ranks never read are "unknown".
  std::vector<PeerReport> stale(const std::vector<int>& ranks, const std::string& group,
                                uint64_t seq, const std::string& description) const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

/// The reporter of this process's latest world group (held weakly: the group owns it), or null
/// (one rank, or no group alive).
std::shared_ptr<PeerProgress> current_peer_progress();
void set_current_peer_progress(std::shared_ptr<PeerProgress> p);

/// One line about the peers of a failed collective, for its error: the ranks that did not reach
/// it or went silent first, with their hosts and last collectives. Also hands the reports to
/// the flight recorder for its dump. "" when there is no reporter.
std::string diagnose_peers(const std::vector<int>& ranks, int my_rank, const RecordTicket& ticket,
                           const std::string& description, std::chrono::milliseconds deadline);

}  // namespace fsdp::detail
