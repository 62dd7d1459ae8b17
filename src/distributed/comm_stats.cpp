// Arithmetic and printing of the collective counters (include/fsdp/distributed/comm_stats.h).
//
// Differences of snapshots give per-step numbers; to_string() is what the trainer, the
// benchmarks and failing tests print, so it stays one line per collective kind.
#include <fsdp/distributed/comm_stats.h>

#include <cstdio>

namespace fsdp {
namespace {

// Bytes in binary units, so that shard sizes (powers of two) read as round numbers.
std::string human_bytes(int64_t bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int unit = 0;
  while ((v >= 1024 || v <= -1024) && unit < 4) {
    v /= 1024;
    ++unit;
  }
  char buf[32];
  if (unit == 0) {
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
  } else {
    std::snprintf(buf, sizeof buf, "%.2f %s", v, kUnits[unit]);
  }
  return buf;
}

std::string line(const char* kind, const CollectiveCounter& c) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%-14s %6lld calls  %12s  sent %12s  wait %9.4f s\n", kind,
                static_cast<long long>(c.calls), human_bytes(c.bytes).c_str(),
                human_bytes(c.sent_bytes).c_str(), c.wait_seconds);
  return buf;
}

}  // namespace

CollectiveCounter& CollectiveCounter::operator+=(const CollectiveCounter& o) {
  calls += o.calls;
  bytes += o.bytes;
  sent_bytes += o.sent_bytes;
  wait_seconds += o.wait_seconds;
  return *this;
}

CollectiveCounter CollectiveCounter::operator-(const CollectiveCounter& o) const {
  CollectiveCounter d;
  d.calls = calls - o.calls;
  d.bytes = bytes - o.bytes;
  d.sent_bytes = sent_bytes - o.sent_bytes;
  d.wait_seconds = wait_seconds - o.wait_seconds;
  return d;
}

CommStats CommStats::operator-(const CommStats& o) const {
  CommStats d;
  d.all_gather = all_gather - o.all_gather;
  d.reduce_scatter = reduce_scatter - o.reduce_scatter;
  d.all_reduce = all_reduce - o.all_reduce;
  d.broadcast = broadcast - o.broadcast;
  d.point_to_point = point_to_point - o.point_to_point;
  d.barrier = barrier - o.barrier;
  return d;
}

CommStats& CommStats::operator+=(const CommStats& o) {
  all_gather += o.all_gather;
  reduce_scatter += o.reduce_scatter;
  all_reduce += o.all_reduce;
  broadcast += o.broadcast;
  point_to_point += o.point_to_point;
  barrier += o.barrier;
  return *this;
}

std::string CommStats::to_string() const {
  std::string s;
  s += line("all_gather", all_gather);
  s += line("reduce_scatter", reduce_scatter);
  s += line("all_reduce", all_reduce);
  s += line("broadcast", broadcast);
  // Only when used: most steps have neither, and the table stays as it was for them.
  if (point_to_point.calls > 0)
    s += line("point_to_point", point_to_point);
  if (barrier.calls > 0)
    s += line("barrier", barrier);
  s.pop_back();  // no trailing newline: callers decide how the block ends
  return s;
}

}  // namespace fsdp
