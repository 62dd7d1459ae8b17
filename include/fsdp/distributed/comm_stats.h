// Counters of the collectives fsdp-cpp issues: how many, how many bytes, how long a rank waited.
//
// Every collective goes through fsdp/distributed/collectives.h (the only code that reaches a
// c10d backend: ProcessGroup does not hand its backend out), which updates the CommStats of its
// ProcessGroup. Tests compare them with the analytic count; the trainer and benchmarks print
// them next to compute time. FSDP_COMM_STATS=0 in the environment turns the counting off (every
// counter stays zero): a switch for measuring its cost (bench/step_overheads.py).
#pragma once

#include <cstdint>
#include <string>

namespace fsdp {

struct CollectiveCounter {
  int64_t calls = 0;
  /// Size of the whole collective buffer: the all-gather output, the reduce-scatter input,
  /// the all-reduce or broadcast tensor.
  int64_t bytes = 0;
  /// Bytes this rank puts on the wire with the algorithm used: (N-1)/N of `bytes` for a
  /// ring all-gather or an all-to-all reduce-scatter, 2(N-1)/N for a ring all-reduce.
  int64_t sent_bytes = 0;
  /// Time the issuing thread spent blocked in wait() (communication that was not hidden).
  double wait_seconds = 0;

  CollectiveCounter& operator+=(const CollectiveCounter& o);
  CollectiveCounter operator-(const CollectiveCounter& o) const;
};

struct CommStats {
  CollectiveCounter all_gather;
  CollectiveCounter reduce_scatter;
  CollectiveCounter all_reduce;
  CollectiveCounter broadcast;
  /// send and recv (save_consolidated streams rows to rank 0): bytes is what this rank sent
  /// plus what it received, sent_bytes what it sent.
  CollectiveCounter point_to_point;
  /// Barriers: calls and wait only (no payload).
  CollectiveCounter barrier;

  void reset() { *this = CommStats{}; }
  CommStats operator-(const CommStats& o) const;
  CommStats& operator+=(const CommStats& o);
  std::string to_string() const;
};

}  // namespace fsdp
