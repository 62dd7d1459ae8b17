// A count of the ranks of a group that reached a point, kept in the group's rendezvous store: any
// thread of a rank may arrive or wait, with no collective. A background thread cannot take part
// in collectives (every rank must issue them in one order, and the main thread is issuing the
// step's); the asynchronous checkpoint's writers use a latch to learn that every rank's file is
// durable before rank 0 commits the index, and pass rank 0 their part of the index through it.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <string>
#include <vector>

namespace c10d {
class Store;
}

namespace fsdp {

class ProcessGroup;

class StoreLatch {
 public:
  /// A latch named `name` (unique in the job: every rank of `group` gives the same) for the
  /// ranks of `group`, on a connection of its own to the group's store. Made on the thread that
  /// owns the group; usable from any one thread after.
  StoreLatch(ProcessGroup& group, const std::string& name);
  ~StoreLatch();
  StoreLatch(const StoreLatch&) = delete;
  StoreLatch& operator=(const StoreLatch&) = delete;

  /// This rank has arrived (call once), leaving `note` (any bytes; small: the store holds it)
  /// for the rank that collects them with take_notes().
  void arrive(const std::string& note = {});
  /// Waits until every rank of the group has arrived; false if `timeout` passed first.
  bool wait(std::chrono::milliseconds timeout);
  /// How many have arrived so far.
  int64_t arrived();
  /// What each rank left when it arrived, by rank, removed from the store (call once, after wait()
  /// returned true).
  std::vector<std::string> take_notes();
  /// Gives up on the latch (wait() returned false): removes the count and the notes left so
  /// far from the store, which would otherwise hold them for the rest of the job.
  void discard();

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  std::string key_;
  int rank_;
  int size_;
};

}  // namespace fsdp
