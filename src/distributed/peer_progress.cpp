// The progress reports of peer_progress.h: what goes to the store, how it is read back with a
// deadline, and how a failed collective's peers are judged.
#include "peer_progress.h"

#include <fsdp/distributed/process_group.h>

#include "host_name.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <pthread.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <future>
#include <mutex>
#include <sstream>
#include <thread>

namespace fsdp::detail {

namespace {

using Json = nlohmann::json;

std::string report_key(int rank) {
  return "fsdp/progress/" + std::to_string(rank);
}

// This rank's report: who it is, when, and its progress on every group.
std::string my_report() {
  Json j;
  j["t"] = unix_seconds();
  j["host"] = host_name();
  j["pid"] = static_cast<int>(::getpid());
  Json groups = Json::object();
  for (const auto& [name, p] : FlightRecorder::global().progress())
    groups[name] = {p.issued, p.completed, p.last};
  j["groups"] = std::move(groups);
  return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

// A report older than this is a rank that stopped reporting: stopped, dead or cut off. Several
// intervals, so that a busy rank whose reporter thread was late is not called silent.
double silent_after_s(std::chrono::milliseconds interval) {
  return std::max(0.3, 3.0 * std::chrono::duration<double>(interval).count());
}

// Judges one raw report (or its absence) against collective `seq` of `group`.
PeerReport judge(int rank, const std::string* raw, double now, const std::string& group,
                 uint64_t seq, const std::string& description, double silent_s) {
  PeerReport r;
  r.rank = rank;
  r.verdict = "unknown";
  if (raw == nullptr)
    return r;
  try {
    const Json j = Json::parse(*raw);
    r.heard = true;
    r.host = j.at("host").get<std::string>();
    r.pid = j.at("pid").get<int>();
    r.reported_at = j.at("t").get<double>();
    r.age_s = std::max(0.0, now - r.reported_at);
    if (j.at("groups").contains(group)) {
      const auto& g = j.at("groups").at(group);
      r.issued = g.at(0).get<uint64_t>();
      r.completed = g.at(1).get<uint64_t>();
      r.last = g.at(2).get<std::string>();
    }
  } catch (const std::exception&) {
    r.heard = false;
    return r;
  }
  if (r.age_s > silent_s)
    r.verdict = "silent";
  else if (r.issued < seq)
    r.verdict = "behind";
  else if (r.issued == seq && r.last != description)
    r.verdict = "different";
  else
    r.verdict = "reached";
  return r;
}

std::mutex current_mutex;
std::weak_ptr<PeerProgress> current;  // the world group owns it

}  // namespace

struct PeerProgress::State {
  c10::intrusive_ptr<c10d::Store> base;   // the group's store, as given
  c10::intrusive_ptr<c10d::Store> store;  // the reporter's own connection, once made (mutex)
  int rank = 0;
  int world_size = 1;
  std::chrono::milliseconds interval{1000};
  std::mutex mutex;
  std::condition_variable wake;
  bool stop = false;
  // The peers' raw reports, read by the reporter at every report until every peer has been
  // seen once: what is known of them (their hosts, above all) when the store cannot be
  // reached at a failure.
  std::map<int, std::string> snapshot;
};

namespace {

// Reads every rank's report that exists (a missing key is a rank that never reported; get()
// would wait for it).
std::map<int, std::string> read_reports(c10d::Store& store, const std::vector<int>& ranks) {
  std::map<int, std::string> out;
  for (int r : ranks) {
    const std::string key = report_key(r);
    if (!store.check({key}))
      continue;
    const auto bytes = store.get(key);
    out[r] = std::string(bytes.begin(), bytes.end());
  }
  return out;
}

void report_loop(std::shared_ptr<PeerProgress::State> s) {
  // Named, so that its CPU time can be told apart (bench/step_overheads.py reads it in /proc).
  pthread_setname_np(pthread_self(), "fsdp_progress");
  std::vector<int> everyone(static_cast<size_t>(s->world_size));
  for (int r = 0; r < s->world_size; ++r)
    everyone[static_cast<size_t>(r)] = r;
  // A connection of its own: the reporter's calls then never wait behind the main thread's
  // (the store serialises calls on one connection), nor it behind them. Made here, not by the
  // constructor: under load a connection took the whole 3 s store timeout once, and the rank's
  // first collective, waiting behind it on the main thread, timed out at its peers.
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = s->base->clone();
  } catch (const std::exception&) {
    store = s->base;
  }
  {
    std::lock_guard<std::mutex> lock(s->mutex);
    s->store = store;
  }
  for (;;) {
    try {
      const std::string report = my_report();
      store->set(report_key(s->rank), std::vector<uint8_t>(report.begin(), report.end()));
      // Until every peer has been seen once: afterwards the snapshot is kept as it is, so the
      // store serves O(N) reads per rank over a job, not O(N) every few seconds.
      bool complete = false;
      {
        std::lock_guard<std::mutex> lock(s->mutex);
        complete = s->snapshot.size() == everyone.size();
      }
      if (!complete) {
        auto reports = read_reports(*store, everyone);
        std::lock_guard<std::mutex> lock(s->mutex);
        s->snapshot = std::move(reports);
      }
    } catch (const std::exception&) {
      // The store is gone or unreachable: the job is ending or the link is down. Keep trying
      // until stopped; the collective that fails reports the cause.
    }
    std::unique_lock<std::mutex> lock(s->mutex);
    if (s->wake.wait_for(lock, s->interval, [&] { return s->stop; }))
      return;
  }
}

}  // namespace

PeerProgress::PeerProgress(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                           std::chrono::milliseconds interval)
    : state_(std::make_shared<State>()) {
  state_->base = std::move(store);
  state_->rank = rank;
  state_->world_size = world_size;
  state_->interval = interval;
  std::thread(report_loop, state_).detach();
}

std::chrono::milliseconds PeerProgress::silent_after() const {
  return std::chrono::milliseconds(
      static_cast<int64_t>(std::ceil(1000.0 * silent_after_s(state_->interval))));
}

PeerProgress::~PeerProgress() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->stop = true;
  state_->wake.notify_all();
}

std::optional<std::vector<PeerReport>> PeerProgress::read(
    const std::vector<int>& ranks, const std::string& group, uint64_t seq,
    const std::string& description, std::chrono::milliseconds deadline) const {
  // On a thread of its own, abandoned after the deadline (see the header); the promise keeps
  // what it needs alive.
  auto result = std::make_shared<std::promise<std::map<int, std::string>>>();
  auto future = result->get_future();
  c10::intrusive_ptr<c10d::Store> store;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    store = state_->store ? state_->store : state_->base;  // before the reporter's connection
  }
  std::thread([store = std::move(store), ranks, result] {
    try {
      result->set_value(read_reports(*store, ranks));
    } catch (...) {
      result->set_exception(std::current_exception());
    }
  }).detach();
  if (future.wait_for(deadline) != std::future_status::ready)
    return std::nullopt;
  std::map<int, std::string> raw;
  try {
    raw = future.get();
  } catch (const std::exception&) {
    return std::nullopt;
  }
  const double now = unix_seconds();
  const double silent = silent_after_s(state_->interval);
  std::vector<PeerReport> out;
  for (int r : ranks) {
    auto it = raw.find(r);
    out.push_back(
        judge(r, it == raw.end() ? nullptr : &it->second, now, group, seq, description, silent));
  }
  return out;
}

std::vector<PeerReport> PeerProgress::stale(const std::vector<int>& ranks, const std::string& group,
                                            uint64_t seq, const std::string& description) const {
  std::map<int, std::string> raw;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    raw = state_->snapshot;
  }
  const double now = unix_seconds();
  std::vector<PeerReport> out;
  for (int r : ranks) {
    auto it = raw.find(r);
    // Ages as of now: how old what is known of each peer is.
    out.push_back(judge(r, it == raw.end() ? nullptr : &it->second, now, group, seq, description,
                        silent_after_s(state_->interval)));
  }
  return out;
}

std::shared_ptr<PeerProgress> current_peer_progress() {
  std::lock_guard<std::mutex> lock(current_mutex);
  return current.lock();
}

void set_current_peer_progress(std::shared_ptr<PeerProgress> p) {
  std::lock_guard<std::mutex> lock(current_mutex);
  current = std::move(p);
}

namespace {
std::atomic<bool> store_lost{false};
}  // namespace

void mark_store_out_of_reach() {
  store_lost = true;
}

std::string diagnose_peers(const std::vector<int>& ranks, int my_rank, const RecordTicket& ticket,
                           const std::string& description, std::chrono::milliseconds deadline) {
  auto progress = current_peer_progress();
  if (!progress || ticket.seq == 0)
    return "";
  std::vector<int> peers;
  for (int r : ranks) {
    if (r != my_rank)
      peers.push_back(r);
  }
  auto reports = progress->read(peers, ticket.group, ticket.seq, description, deadline);
  std::ostringstream out;
  const std::string where = "#" + std::to_string(ticket.seq) + " of group '" + ticket.group + "'";
  bool store_down = false;
  if (!reports) {
    store_down = true;
    mark_store_out_of_reach();
    reports = progress->stale(peers, ticket.group, ticket.seq, description);
  }
  FlightRecorder::global().set_peer_reports(*reports);
  auto host_of = [](const PeerReport& p) { return p.host.empty() ? std::string("?") : p.host; };
  std::vector<std::string> culprits, others;
  const std::string my_host = host_name();
  for (const auto& p : *reports) {
    // Cut off from the store, this rank cannot tell who else is; the peers on its own host
    // are not the ones it lost (they share its side of the link).
    if (store_down && p.heard && p.host == my_host)
      continue;
    std::ostringstream line;
    line << "rank " << p.rank << " (host " << host_of(p);
    if (p.pid)
      line << ", pid " << p.pid;
    line << ")";
    if (store_down) {
      // Everything known is older than the failure: every peer is a candidate.
      if (p.heard)
        line << ", its report " << static_cast<int>(p.age_s * 10) / 10.0
             << " s before the failure: issued #" << p.issued;
      culprits.push_back(line.str());
      continue;
    }
    if (p.verdict == "silent") {
      line << " silent for " << static_cast<int>(p.age_s * 10) / 10.0 << " s (stopped, dead or "
           << "cut off); its last report: issued #" << p.issued << ", completed #" << p.completed;
      if (!p.last.empty())
        line << " (" << p.last << ")";
      culprits.push_back(line.str());
    } else if (p.verdict == "behind") {
      line << " had not reached it at its last report (" << static_cast<int>(p.age_s * 10) / 10.0
           << " s ago): issued #" << p.issued << " (" << p.last << ")";
      culprits.push_back(line.str());
    } else if (p.verdict == "different") {
      line << " issued another collective as #" << p.issued << ": " << p.last;
      culprits.push_back(line.str());
    } else if (p.verdict == "unknown") {
      line << " never reported (died early, or never started)";
      culprits.push_back(line.str());
    } else {
      others.push_back(std::to_string(p.rank));
    }
  }
  if (store_down) {
    out << "the rendezvous store did not answer within " << deadline.count()
        << " ms (this host may be cut off from it); the peers this rank lost: ";
  } else if (culprits.empty()) {
    out << "every peer reached " << where << " (a transfer failed between ranks that all "
        << "arrived: a link, or a peer that died during it); peers: ";
  } else {
    out << "at " << where << ": ";
  }
  for (size_t i = 0; i < culprits.size(); ++i)
    out << (i ? "; " : "") << culprits[i];
  if (!others.empty()) {
    out << (culprits.empty() ? "" : "; ") << "reached it: rank";
    out << (others.size() > 1 ? "s " : " ");
    for (size_t i = 0; i < others.size(); ++i)
      out << (i ? "," : "") << others[i];
  }
  return out.str();
}

}  // namespace fsdp::detail

namespace fsdp {

bool store_out_of_reach() {
  return detail::store_lost;
}

}  // namespace fsdp
