// The trace recorder (include/fsdp/core/trace.h): per-thread buffers, tracks, start/stop.
//
// Invariants: every buffer ever created stays registered (threads come and go, their buffers
// are shared with the registry), so collect() sees the spans of threads that have ended. A
// buffer holds the spans of one generation (one start()) only: a span of a newer generation
// empties it first, one of an older generation is dropped, both decided under the buffer's
// mutex, so a span that raced a start() never lands in the new recording.
#include <fsdp/core/trace.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>

namespace fsdp::trace {

namespace detail {
std::atomic<bool> g_enabled{false};
std::atomic<uint64_t> g_generation{0};
}  // namespace detail

namespace {

std::atomic<int64_t> g_step{-1};

struct Buffer {
  std::mutex mutex;
  int tid = 0;
  std::string name;
  bool is_track = false;
  std::vector<Event> events;
  int64_t last_end_ns = 0;  // tracks: where the next span may start at the earliest
  uint64_t generation = 0;  // of the spans in `events`
};

// Under b.mutex: whether a span of `generation` may be appended to `b` (see the invariants).
bool admit(Buffer& b, uint64_t generation) {
  if (generation < b.generation)
    return false;
  if (generation > b.generation) {
    b.events.clear();
    b.last_end_ns = 0;
    b.generation = generation;
  }
  return true;
}

// Every buffer, in order of creation (a thread's on its first span or name, a track's on its
// first span). Process-wide like the memory counters: ranks are processes.
struct Registry {
  std::mutex mutex;
  std::vector<std::shared_ptr<Buffer>> buffers;
  int next_tid = 1;

  std::shared_ptr<Buffer> add(std::string name, bool is_track) {
    std::lock_guard<std::mutex> lock(mutex);
    return add_locked(std::move(name), is_track);
  }
  std::shared_ptr<Buffer> add_locked(std::string name, bool is_track) {
    auto b = std::make_shared<Buffer>();
    b->tid = next_tid++;
    b->name = name.empty() ? "thread " + std::to_string(b->tid) : std::move(name);
    b->is_track = is_track;
    buffers.push_back(b);
    return b;
  }
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: threads may record during exit
  return *r;
}

Buffer& this_thread() {
  thread_local std::shared_ptr<Buffer> buffer = registry().add("", false);
  return *buffer;
}

bool recording_since(uint64_t generation) {
  return enabled() && detail::g_generation.load(std::memory_order_relaxed) == generation;
}

}  // namespace

int64_t now_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void start() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  // A new generation (buffers of earlier ones empty themselves on their next span, and
  // collect() skips them): spans opened under an earlier recording are not recorded in this one.
  detail::g_generation.fetch_add(1, std::memory_order_relaxed);
  detail::g_enabled.store(true, std::memory_order_release);
}

void stop() {
  detail::g_enabled.store(false, std::memory_order_release);
}

std::vector<ThreadSpans> collect() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<ThreadSpans> out;
  const uint64_t current = detail::g_generation.load(std::memory_order_relaxed);
  for (auto& b : r.buffers) {
    std::lock_guard<std::mutex> l(b->mutex);
    if (b->events.empty() || b->generation != current)
      continue;
    ThreadSpans t;
    t.tid = b->tid;
    t.name = b->name;
    t.is_track = b->is_track;
    t.events = std::move(b->events);
    b->events.clear();
    out.push_back(std::move(t));
  }
  return out;
}

void set_step(int64_t step) {
  g_step.store(step, std::memory_order_relaxed);
}

int64_t current_step() {
  return g_step.load(std::memory_order_relaxed);
}

void set_thread_name(std::string name) {
  auto& b = this_thread();
  std::lock_guard<std::mutex> lock(b.mutex);
  b.name = std::move(name);
}

void end(Mark& mark, const char* kind, std::string_view label, std::string_view subject,
         int64_t bytes) noexcept {
  const Mark m = mark;
  mark = Mark{};
  if (!m.active() || !recording_since(m.generation))
    return;
  // Called from destructors and hooks: a failed allocation loses the span, never the step.
  try {
    Event e;
    e.end_ns = now_ns();
    e.begin_ns = m.begin_ns;
    e.kind = kind;
    e.name.reserve(label.size() + 1 + subject.size());
    e.name.append(label);
    if (!subject.empty()) {
      e.name += ' ';
      e.name.append(subject);
    }
    e.subject = subject;
    e.bytes = bytes;
    e.step = current_step();
    auto& b = this_thread();
    std::lock_guard<std::mutex> lock(b.mutex);
    if (admit(b, m.generation))
      b.events.push_back(std::move(e));
  } catch (...) {
  }
}

void record_on_track(std::string_view track, uint64_t generation, const char* kind,
                     std::string name, std::string subject, int64_t bytes, int64_t begin_ns,
                     int64_t end_ns) noexcept {
  if (!recording_since(generation))
    return;
  try {
    std::shared_ptr<Buffer> buffer;
    {
      auto& r = registry();
      std::lock_guard<std::mutex> lock(r.mutex);
      for (auto& b : r.buffers) {
        if (b->is_track && b->name == track) {
          buffer = b;
          break;
        }
      }
      if (!buffer)
        buffer = r.add_locked(std::string(track), true);
    }
    std::lock_guard<std::mutex> lock(buffer->mutex);
    if (!admit(*buffer, generation))
      return;
    Event e;
    // A track's work runs one item at a time: what was issued while the previous item ran
    // starts when that one ended.
    e.begin_ns = std::min(std::max(begin_ns, buffer->last_end_ns), end_ns);
    e.end_ns = end_ns;
    buffer->last_end_ns = std::max(buffer->last_end_ns, end_ns);
    e.kind = kind;
    e.name = std::move(name);
    e.subject = std::move(subject);
    e.bytes = bytes;
    e.step = current_step();
    buffer->events.push_back(std::move(e));
  } catch (...) {
  }
}

}  // namespace fsdp::trace
