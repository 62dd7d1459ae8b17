// What only the collectives layer may touch in a ProcessGroup: its c10d backend (lanes), its
// rendezvous store and the collective-sequence check. Private to src/distributed: everything
// else, in the library and above it, talks through fsdp/distributed/collectives.h, so that
// CommStats counts all the traffic and the check sees every collective.
#pragma once

#include <fsdp/distributed/process_group.h>

namespace fsdp::detail {

class CollectiveCheck;
class PeerProgress;

struct GroupAccess {
  static c10d::Backend& next_lane(ProcessGroup& g) { return g.next_lane(); }
  /// Point-to-point messages and barriers take the first lane: send/recv pairs match by
  /// (peer, tag) on one backend, so both sides must use the same one whatever else was issued.
  static c10d::Backend& first_lane(ProcessGroup& g) { return g.first_lane(); }
  /// Which of `g`'s lanes `lane` is (0, 1, ...), for the trace's lane tracks.
  static int lane_index(const ProcessGroup& g, const c10d::Backend& lane) {
    for (size_t i = 0; i < g.lanes_.size(); ++i) {
      if (g.lanes_[i].get() == &lane)
        return static_cast<int>(i);
    }
    return -1;
  }
  static CollectiveCheck* check(ProcessGroup& g) { return g.check_.get(); }
  static const c10::intrusive_ptr<c10d::Store>& store(ProcessGroup& g) { return g.store_; }
  /// The number of the collective about to be issued on `g` (1, 2, ...).
  static uint64_t next_sequence(ProcessGroup& g) { return ++g.sequence_; }
  static void set_progress(ProcessGroup& g, std::shared_ptr<PeerProgress> p) {
    g.progress_ = std::move(p);
  }
};

}  // namespace fsdp::detail
