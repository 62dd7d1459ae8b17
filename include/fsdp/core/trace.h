// The trace recorder: timed spans of what each thread of this rank did (a unit's forward, an
// all-gather's wait, the optimizer, data loading), for a timeline of a few steps.
//
// Off by default, and nearly free when off: opening a span costs one relaxed atomic load.
// start() clears what was recorded and turns recording on; stop() turns it off; collect() hands
// the spans over, grouped by thread. fsdp/observe/chrome_trace.h writes them as a Chrome trace
// (Perfetto, chrome://tracing, Holistic Trace Analysis); fsdp-train does both around the steps
// of logging.trace_steps.
//
// Why in core: the spans are opened where the work happens, in the engine (a unit's hooks) and
// in distributed (every collective passes through collectives.h), and both sit below observe.
// The recorder needs nothing but the clock; the file format lives in observe.
//
// Each thread appends to a buffer of its own (registered once per thread, under a mutex), so
// threads never contend on a hot lock; collect() takes every buffer's lock once. A span is
// recorded when it ends, and only if recording has been on, without a restart, since it began:
// every span of a recording lies inside it, and none crosses a start().
//
// Tracks: spans that belong to no thread of ours (a collective's transfer on a Gloo lane,
// measured from its issue to the backend's completion callback) go to a named track instead,
// which a viewer shows as a thread of its own. A track's spans are sequential by construction:
// a span starts no earlier than the previous one on its track ended.
//
//   fsdp::trace::start();
//   { fsdp::trace::Span s("data", "data"); batch = next_batch(); }
//   ...
//   fsdp::trace::stop();
//   auto threads = fsdp::trace::collect();
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fsdp::trace {

namespace detail {
extern std::atomic<bool> g_enabled;
extern std::atomic<uint64_t> g_generation;
}  // namespace detail

/// Whether spans are being recorded now (one load; acquire, so that a thread that sees
/// recording on also sees the generation start() made: a plain load on x86).
inline bool enabled() noexcept {
  return detail::g_enabled.load(std::memory_order_acquire);
}

/// Nanoseconds on the steady clock (the time base of every span).
int64_t now_ns() noexcept;

/// One finished span.
struct Event {
  /// What kind of work, from a small fixed set ("forward", "backward", "recompute",
  /// "all_gather_issue", "all_gather_wait", "reduce_scatter_issue", "reduce_scatter_wait",
  /// "all_reduce_issue", "all_reduce_wait", "transfer", "optimizer", "data", "metrics",
  /// "step", ...): a static string.
  const char* kind = "";
  /// "forward h3", "all-gather wait unit 'h3'": what a viewer shows on the box.
  std::string name;
  /// Whom it was for: the unit ("h3"), the collective's context ("unit 'h3'"), or empty.
  std::string subject;
  /// Bytes moved, for collectives; -1 otherwise.
  int64_t bytes = -1;
  int64_t begin_ns = 0;
  int64_t end_ns = 0;
  /// set_step() when the span ended (-1: none set).
  int64_t step = -1;
};

/// The spans of one thread (or track), in the order they ended.
struct ThreadSpans {
  /// Small numbers in order of first use in the process, stable across recordings.
  int tid = 0;
  /// set_thread_name(), a track's name, or "thread <tid>".
  std::string name;
  bool is_track = false;
  std::vector<Event> events;
};

/// Clears every buffer and starts recording.
void start();
/// Stops recording; spans still open will not be recorded.
void stop();
/// The spans recorded since start(), per thread and track (those with none are left out); the
/// buffers are emptied.
std::vector<ThreadSpans> collect();

/// The step spans are tagged with from now on (the trainer's optimizer step; -1: none).
void set_step(int64_t step);
int64_t current_step();

/// Names the calling thread in traces ("main", "data loader"); recorded even while off.
void set_thread_name(std::string name);

/// The beginning of a span whose end is in another function (a unit's forward starts in its
/// pre-forward and ends in its post-forward). Inert when recording was off.
struct Mark {
  int64_t begin_ns = -1;
  uint64_t generation = 0;
  bool active() const { return begin_ns >= 0; }
};
inline Mark begin() noexcept {
  if (!enabled())
    return {};
  return Mark{now_ns(), detail::g_generation.load(std::memory_order_relaxed)};
}
/// Records the span from `mark` to now on the calling thread, named "<label> <subject>" (or
/// "<label>"), if recording has been on since the mark. Resets the mark.
void end(Mark& mark, const char* kind, std::string_view label, std::string_view subject = {},
         int64_t bytes = -1) noexcept;

/// Records a span on the named track, from `begin_ns` (moved to the end of the track's previous
/// span if that is later) to `end_ns`, if recording has been on since `generation`.
void record_on_track(std::string_view track, uint64_t generation, const char* kind,
                     std::string name, std::string subject, int64_t bytes, int64_t begin_ns,
                     int64_t end_ns) noexcept;
inline uint64_t generation() noexcept {
  return detail::g_generation.load(std::memory_order_relaxed);
}

/// A span over a scope on the calling thread. `label` and `subject` must outlive the span (the
/// name is composed only when the span is recorded).
class Span {
 public:
  Span(const char* kind, std::string_view label, std::string_view subject = {},
       int64_t bytes = -1) noexcept
      : mark_(begin()), kind_(kind), label_(label), subject_(subject), bytes_(bytes) {}
  ~Span() {
    if (mark_.active())
      end(mark_, kind_, label_, subject_, bytes_);
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;
  /// The bytes, once known.
  void set_bytes(int64_t bytes) noexcept { bytes_ = bytes; }

 private:
  Mark mark_;
  const char* kind_;
  std::string_view label_, subject_;
  int64_t bytes_;
};

}  // namespace fsdp::trace
