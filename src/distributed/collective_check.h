// Debug mode: proves that every rank of a group issues the same collectives in the same order,
// and names the first one where they do not.
//
// Backends match collectives by their order alone. A rank that issues one more or one fewer
// (a unit called on one rank only, a data-dependent branch), or the same one with other sizes,
// hangs the job or corrupts data far from the cause. With ProcessGroupOptions::
// check_collectives(N) (or FSDP_CHECK_COLLECTIVES=N), each rank describes every collective it
// is about to issue on the group (kind, sizes, dtype, the unit that issues it) and, before every
// N-th, publishes the descriptions since the previous check in the group's rendezvous store and
// compares them with the other ranks'. The exchange goes through the store, not the backend, so
// it works even when the backends' sequences already disagree. On a difference every rank
// throws one message naming the collective's number and what each rank issues there; a rank
// that does not arrive within the group's timeout is named too.
//
// N = 1 checks before every collective, so a divergence is reported before the diverging
// collective runs. Larger N costs one store round trip per N collectives, but a diverging
// collective among the unchecked ones may fail or hang before the check (it then still fails
// after the backend's timeout, without the diagnosis).
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace c10d {
class Store;
}

namespace fsdp::detail {

class CollectiveCheck {
 public:
  CollectiveCheck(c10::intrusive_ptr<c10d::Store> store, int rank, std::vector<int> global_ranks,
                  int every, std::chrono::milliseconds timeout);

  /// Records the collective this rank is about to issue; every `every`-th call compares the
  /// sequence with the other ranks' (blocking) and throws on a difference.
  void before(std::string description);

 private:
  void exchange();
  std::string key(uint64_t round, int rank) const;

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  std::vector<int> global_ranks_;
  int every_;
  std::chrono::milliseconds timeout_;
  uint64_t count_ = 0;  // collectives recorded so far
  uint64_t round_ = 0;  // exchanges so far
  std::vector<std::string> pending_;
};

/// FSDP_CHECK_COLLECTIVES from the environment (0 when unset); a bad value throws.
int check_collectives_from_environment();

}  // namespace fsdp::detail
