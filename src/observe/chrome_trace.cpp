// See chrome_trace.h. Field names follow Kineto's traces (what Holistic Trace Analysis parses);
// everything fsdp-specific goes in "args".
#include <fsdp/observe/chrome_trace.h>

#include <fsdp/core/durable_file.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <stdexcept>

namespace fsdp {
namespace {

// Microseconds with nanosecond resolution (Chrome's unit is the microsecond; fractions are
// allowed, and short spans such as a collective's issue would round to nothing otherwise).
double micros(int64_t ns) {
  return static_cast<double>(ns) / 1000.0;
}

}  // namespace

std::string chrome_trace(const std::vector<trace::ThreadSpans>& threads, int rank, int world_size) {
  using nlohmann::json;
  json events = json::array();
  events.push_back({{"ph", "M"},
                    {"name", "process_name"},
                    {"pid", rank},
                    {"tid", 0},
                    {"args", {{"name", "rank " + std::to_string(rank)}}}});
  events.push_back({{"ph", "M"},
                    {"name", "process_sort_index"},
                    {"pid", rank},
                    {"tid", 0},
                    {"args", {{"sort_index", rank}}}});
  for (const auto& t : threads) {
    events.push_back({{"ph", "M"},
                      {"name", "thread_name"},
                      {"pid", rank},
                      {"tid", t.tid},
                      {"args", {{"name", t.name}}}});
    // Threads first, then tracks, each in order of first use.
    events.push_back({{"ph", "M"},
                      {"name", "thread_sort_index"},
                      {"pid", rank},
                      {"tid", t.tid},
                      {"args", {{"sort_index", t.tid + (t.is_track ? 1000 : 0)}}}});
    std::vector<const trace::Event*> sorted;
    sorted.reserve(t.events.size());
    for (const auto& e : t.events)
      sorted.push_back(&e);
    // By start, the longer first: a span precedes the spans it encloses.
    std::stable_sort(sorted.begin(), sorted.end(), [](const auto* a, const auto* b) {
      if (a->begin_ns != b->begin_ns)
        return a->begin_ns < b->begin_ns;
      return a->end_ns > b->end_ns;
    });
    for (const auto* e : sorted) {
      json args = {{"kind", e->kind}};
      if (e->step >= 0)
        args["step"] = e->step;
      if (!e->subject.empty())
        args["for"] = e->subject;
      if (e->bytes >= 0)
        args["bytes"] = e->bytes;
      events.push_back({{"ph", "X"},
                        {"cat", "user_annotation"},
                        {"name", e->name},
                        {"pid", rank},
                        {"tid", t.tid},
                        {"ts", micros(e->begin_ns)},
                        {"dur", micros(std::max<int64_t>(0, e->end_ns - e->begin_ns))},
                        {"args", std::move(args)}});
    }
  }
  // Written by hand around the events, one per line, in Kineto's layout: Holistic Trace
  // Analysis finds a file's rank by matching `"rank": <n>` (with the space) in its text, line by
  // line, before it parses anything, so distributedInfo comes first and spaced that way.
  std::string out = "{\"distributedInfo\": {\"rank\": " + std::to_string(rank) +
                    ", \"world_size\": " + std::to_string(world_size) +
                    "},\n\"schemaVersion\": 1,\n\"displayTimeUnit\": \"ms\",\n\"traceEvents\": [\n";
  for (size_t i = 0; i < events.size(); ++i) {
    // Names come from user code (unit names): bytes that are not UTF-8 become U+FFFD rather
    // than a nlohmann type error.
    out += events[i].dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    out += i + 1 < events.size() ? ",\n" : "\n";
  }
  out += "]}\n";
  return out;
}

void write_chrome_trace(const std::string& path, const std::vector<trace::ThreadSpans>& threads,
                        int rank, int world_size) {
  const auto parent = std::filesystem::path(path).parent_path();
  std::error_code ec;
  if (!parent.empty())
    std::filesystem::create_directories(parent, ec);
  if (ec)
    throw std::runtime_error(path + ": cannot create its directory: " + ec.message());
  write_file_atomic(path, chrome_trace(threads, rank, world_size));
}

}  // namespace fsdp
