// The ring of collectives, its states, and its dumps (flight_recorder.h).
#include <fsdp/distributed/flight_recorder.h>

#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <thread>

#include <fsdp/core/durable_file.h>

#include "host_name.h"

namespace fsdp {

namespace {

using Json = nlohmann::json;

constexpr size_t kDefaultCapacity = 2000;

size_t capacity_from_environment() {
  const char* v = std::getenv("FSDP_FLIGHT_RECORDER");
  if (v == nullptr || *v == '\0')
    return kDefaultCapacity;
  size_t n = 0;
  const char* end = v + std::char_traits<char>::length(v);
  auto [ptr, ec] = std::from_chars(v, end, n);
  if (ec != std::errc() || ptr != end || n > (size_t{1} << 24)) {
    // Read when the first collective is recorded, which must not throw for a diagnostic.
    std::fprintf(stderr,
                 "fsdp: FSDP_FLIGHT_RECORDER=\"%s\" is not a number of entries in [0, 16777216]; "
                 "using %zu\n",
                 v, kDefaultCapacity);
    return kDefaultCapacity;
  }
  return n;
}

std::string dir_from_environment() {
  const char* v = std::getenv("FSDP_FLIGHT_RECORDER_DIR");
  return v ? v : "";
}

// The state machine of a record, in one place: which moves are allowed.
bool allowed(CollectiveState from, CollectiveState to) {
  switch (from) {
    case CollectiveState::kIssued:
      return to == CollectiveState::kWaiting || to == CollectiveState::kFailed;
    case CollectiveState::kWaiting:
      return to == CollectiveState::kCompleted || to == CollectiveState::kFailed;
    case CollectiveState::kCompleted:
    case CollectiveState::kFailed:
      return false;
  }
  return false;
}

// The signal handler's side of dump_on_signal(): one byte down a pipe, the only thing a
// handler may safely do here; a thread reads it and dumps.
int signal_pipe[2] = {-1, -1};
void on_dump_signal(int) {
  const char byte = 1;
  [[maybe_unused]] ssize_t n = ::write(signal_pipe[1], &byte, 1);
}

}  // namespace

const char* to_string(CollectiveState s) {
  switch (s) {
    case CollectiveState::kIssued:
      return "issued";
    case CollectiveState::kWaiting:
      return "waiting";
    case CollectiveState::kCompleted:
      return "completed";
    case CollectiveState::kFailed:
      return "failed";
  }
  return "?";
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

FlightRecorder::FlightRecorder()
    : capacity_(capacity_from_environment()), dump_dir_(dir_from_environment()) {}

FlightRecorder& FlightRecorder::global() {
  static FlightRecorder* recorder = new FlightRecorder();  // leaked on purpose (see header)
  return *recorder;
}

void FlightRecorder::set_capacity(size_t entries) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Keep the newest records that still fit, in order.
  std::vector<CollectiveRecord> kept;
  const size_t have = ring_.size() == capacity_ ? std::min<uint64_t>(last_id_, capacity_) : 0;
  for (uint64_t id = last_id_ - have + 1; id <= last_id_ && have > 0; ++id) {
    auto& r = ring_[(id - 1) % capacity_];
    if (r.id == id)
      kept.push_back(std::move(r));
  }
  capacity_ = entries;
  allocate_ring();
  for (auto& r : kept) {
    if (entries > 0 && r.id + entries > last_id_)
      ring_[(r.id - 1) % entries] = std::move(r);
  }
}

size_t FlightRecorder::capacity() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return capacity_;
}

void FlightRecorder::set_dump_dir(const std::string& dir) {
  std::lock_guard<std::mutex> lock(mutex_);
  dump_dir_ = dir;
}

std::string FlightRecorder::dump_dir() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return dump_dir_;
}

void FlightRecorder::set_identity(int rank, int world_size) {
  std::lock_guard<std::mutex> lock(mutex_);
  rank_ = rank;
  world_size_ = world_size;
}

void FlightRecorder::register_group(const std::string& name, const std::vector<int>& global_ranks) {
  std::lock_guard<std::mutex> lock(mutex_);
  groups_[name] = global_ranks;
}

uint64_t FlightRecorder::issue(CollectiveRecord record) {
  std::lock_guard<std::mutex> lock(mutex_);
  record.id = ++last_id_;
  record.issued = unix_seconds();
  record.state = CollectiveState::kIssued;
  if (record.seq > 0) {
    auto& p = progress_[record.group];
    p.issued = std::max(p.issued, record.seq);
    p.last = record.description;
  }
  if (capacity_ > 0) {
    if (ring_.size() != capacity_)
      allocate_ring();
    // Copied into the slot's own strings, not moved: a moved-in string would bring the
    // caller's freshly allocated buffer, and thousands of small buffers allocated between a
    // step's tensors and kept for minutes pin the heap around the freed tensors (glibc cannot
    // return that memory): the ranks' resident memory grew 100 MiB over 200 steps that way.
    ring_[(record.id - 1) % capacity_] = record;
  }
  return last_id_;
}

void FlightRecorder::allocate_ring() {
  // Every slot's strings allocated at once, large enough for the usual record, so that
  // recording allocates nothing of its own afterwards (see issue()).
  ring_.assign(capacity_, CollectiveRecord{});
  for (auto& slot : ring_) {  // (a copy would not keep a reserved capacity)
    slot.group.reserve(32);
    slot.kind.reserve(16);
    slot.context.reserve(64);
    slot.dtype.reserve(16);
    slot.description.reserve(192);
  }
}

CollectiveRecord* FlightRecorder::find(uint64_t id) {
  if (capacity_ == 0 || id == 0 || ring_.size() != capacity_)
    return nullptr;
  auto& r = ring_[(id - 1) % capacity_];
  return r.id == id ? &r : nullptr;
}

void FlightRecorder::transition(const RecordTicket& ticket, CollectiveState to,
                                const std::string& error) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (to == CollectiveState::kCompleted && ticket.seq > 0) {
    auto& p = progress_[ticket.group];
    p.completed = std::max(p.completed, ticket.seq);
  }
  CollectiveRecord* r = find(ticket.id);
  if (r == nullptr)
    return;
  // Invariant: a record only moves forward (see CollectiveState). A wait that is retried on
  // an already finished record is a no-op, not an error: the collective's outcome stands.
  if (!allowed(r->state, to))
    return;
  const double now = unix_seconds();
  r->state = to;
  if (to == CollectiveState::kWaiting)
    r->started = now;
  else
    r->completed = now;
  if (to == CollectiveState::kFailed)
    r->error = error.substr(0, error.find('\n'));
}

std::map<std::string, FlightRecorder::GroupProgress> FlightRecorder::progress() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return progress_;
}

std::vector<CollectiveRecord> FlightRecorder::records() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<CollectiveRecord> out;
  if (capacity_ == 0 || ring_.size() != capacity_)
    return out;
  const uint64_t have = std::min<uint64_t>(last_id_, capacity_);
  for (uint64_t id = last_id_ - have + 1; id <= last_id_; ++id) {
    const auto& r = ring_[(id - 1) % capacity_];
    if (r.id == id)
      out.push_back(r);
  }
  return out;
}

void FlightRecorder::set_peer_reports(std::vector<PeerReport> reports) {
  std::lock_guard<std::mutex> lock(mutex_);
  peers_ = std::move(reports);
}

std::string FlightRecorder::to_json(const std::string& reason) const {
  const auto recs = records();
  std::lock_guard<std::mutex> lock(mutex_);
  Json j;
  j["format"] = "fsdp-cpp flight recorder";
  j["version"] = 1;
  j["rank"] = rank_;
  j["world_size"] = world_size_;
  j["host"] = detail::host_name();
  j["pid"] = static_cast<int>(::getpid());
  j["time"] = unix_seconds();
  j["reason"] = reason;
  j["capacity"] = capacity_;
  j["records_dropped"] = last_id_ - recs.size();
  Json entries = Json::array();
  for (const auto& r : recs) {
    entries.push_back({{"id", r.id},
                       {"group", r.group},
                       {"seq", r.seq},
                       {"kind", r.kind},
                       {"context", r.context},
                       {"bytes", r.bytes},
                       {"dtype", r.dtype},
                       {"description", r.description},
                       {"issued", r.issued},
                       {"started", r.started},
                       {"completed", r.completed},
                       {"state", to_string(r.state)},
                       {"error", r.error}});
  }
  j["records"] = std::move(entries);
  Json progress = Json::object();
  for (const auto& [group, p] : progress_)
    progress[group] = {{"issued", p.issued}, {"completed", p.completed}, {"last", p.last}};
  j["progress"] = std::move(progress);
  j["groups"] = groups_;
  Json peers = Json::array();
  for (const auto& p : peers_) {
    peers.push_back({{"rank", p.rank},
                     {"host", p.host},
                     {"pid", p.pid},
                     {"heard", p.heard},
                     {"age_s", p.age_s},
                     {"issued", p.issued},
                     {"completed", p.completed},
                     {"last", p.last},
                     {"verdict", p.verdict}});
  }
  j["peers"] = std::move(peers);
  // Replacement of invalid UTF-8 (a unit name is user text) instead of an exception.
  return j.dump(1, ' ', false, Json::error_handler_t::replace) + "\n";
}

void FlightRecorder::dump_to(const std::string& path, const std::string& reason) const {
  const std::string text = to_json(reason);
  const auto dir = std::filesystem::path(path).parent_path();
  std::error_code ec;
  if (!dir.empty())
    std::filesystem::create_directories(dir, ec);
  write_file_atomic(path, text);
}

std::string FlightRecorder::dump(const std::string& reason) noexcept {
  try {
    std::string dir;
    int rank = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      dir = dump_dir_;
      rank = rank_;
    }
    if (dir.empty())
      return "";
    const std::string path =
        (std::filesystem::path(dir) / ("rank" + std::to_string(rank) + ".json")).string();
    dump_to(path, reason);
    return path;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp: flight recorder dump failed: %s\n", e.what());
    return "";
  }
}

void FlightRecorder::dump_on_signal(int sig) {
  static std::once_flag started;
  std::call_once(started, [this] {
    if (::pipe2(signal_pipe, O_CLOEXEC) != 0)
      throw std::runtime_error("flight recorder: cannot create the signal pipe");
    // Detached: it lives as long as the process, blocked in read() between signals.
    std::thread([this] {
      char byte;
      while (::read(signal_pipe[0], &byte, 1) == 1) {
        const std::string path = dump("signal");
        if (!path.empty())
          std::fprintf(stderr, "fsdp: flight recorder dumped to %s\n", path.c_str());
      }
    }).detach();
  });
  struct sigaction action {};
  action.sa_handler = on_dump_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  if (::sigaction(sig, &action, nullptr) != 0)
    throw std::runtime_error("flight recorder: cannot install the handler of signal " +
                             std::to_string(sig));
}

namespace {
std::terminate_handler previous_terminate = nullptr;

[[noreturn]] void dump_then_terminate() {
  std::string why = "terminated";
  if (auto e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      why += ": " + std::string(ex.what()).substr(0, 300);
    } catch (...) {
      why += " by a non-standard exception";
    }
  }
  // On a thread of its own with a deadline: the thread that terminates may hold the recorder's
  // lock, and a dump must never turn an abort into a hang.
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::thread([why, done] {
    FlightRecorder::global().dump(why);
    done->store(true);
  }).detach();
  for (int i = 0; i < 200 && !done->load(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (previous_terminate)
    previous_terminate();
  std::abort();
}
}  // namespace

void FlightRecorder::dump_on_terminate() {
  static std::once_flag installed;
  std::call_once(installed, [] { previous_terminate = std::set_terminate(dump_then_terminate); });
}

}  // namespace fsdp
