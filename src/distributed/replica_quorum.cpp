// See include/fsdp/distributed/replica_quorum.h.
#include <fsdp/distributed/replica_quorum.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <c10/util/Exception.h>

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <thread>

#include <fsdp/distributed/collectives.h>
#include <fsdp/distributed/process_group.h>

#include "group_access.h"
#include "peer_progress.h"

namespace fsdp {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<uint8_t> bytes_of(const std::string& s) {
  return {s.begin(), s.end()};
}

// Built by appending: GCC 12 warns (falsely, -Wstringop-overflow) on `"literal" + std::string`.
std::string encode(const std::vector<int>& replicas) {
  std::string out = "[";
  for (size_t i = 0; i < replicas.size(); ++i) {
    if (i > 0)
      out += ',';
    out += std::to_string(replicas[i]);
  }
  out += ']';
  return out;
}

// "e3": an epoch's tag and the prefix of its keys.
std::string epoch_tag(uint64_t epoch) {
  std::string out = "e";
  out += std::to_string(epoch);
  return out;
}

// The decision's replicas, as encode() wrote them (the store holds only what ranks wrote).
std::vector<int> decode(const std::vector<uint8_t>& raw) {
  const std::string s(raw.begin(), raw.end());
  TORCH_CHECK(s.size() >= 2 && s.front() == '[' && s.back() == ']',
              "fsdp::ReplicaQuorum: a malformed membership decision in the store: '", s, "'");
  std::vector<int> out;
  size_t at = 1;
  while (at < s.size() - 1) {
    const size_t end = std::min(s.find(',', at), s.size() - 1);
    out.push_back(std::stoi(s.substr(at, end - at)));
    at = end + 1;
  }
  return out;
}

// A tensor's bytes hashed with XXH3 (as checkpoints are), as an int64: compared, never
// interpreted.
int64_t checksum(const torch::Tensor& t) {
  const auto c = t.contiguous().cpu();
  const uint64_t h = XXH3_64bits(c.data_ptr(), c.numel() * c.element_size());
  int64_t out;
  std::memcpy(&out, &h, sizeof out);
  return out;
}

// For each of `values`, whether every member of `group` holds the same (their max and min
// agree): one all-reduce each way, in the order every member calls it.
std::vector<bool> agreed(ProcessGroup& group, const std::vector<int64_t>& values,
                         const std::string& what) {
  auto high = torch::tensor(values, torch::kLong), low = high.clone();
  all_reduce(group, high, ReduceOp::kMax, what)->wait();
  all_reduce(group, low, ReduceOp::kMin, what)->wait();
  std::vector<bool> out(values.size());
  for (size_t i = 0; i < values.size(); ++i)
    out[i] = high.data_ptr<int64_t>()[i] == low.data_ptr<int64_t>()[i];
  return out;
}

// Short sleeps first (a vote usually completes within a millisecond of the last rank's), then
// longer ones, so that a wait of seconds costs the store a few hundred requests, not millions.
class Backoff {
 public:
  void wait() {
    std::this_thread::sleep_for(delay_);
    delay_ = std::min(delay_ * 2, std::chrono::microseconds(20000));
  }

 private:
  std::chrono::microseconds delay_{50};
};

}  // namespace

ReplicaQuorum::ReplicaQuorum(std::shared_ptr<ProcessGroup> world, ReplicaQuorumOptions options)
    : world_(std::move(world)), options_(options), k_(options.ranks_per_replica()) {
  TORCH_CHECK(world_, "fsdp::ReplicaQuorum: no process group");
  const int n = world_->size();
  TORCH_CHECK(k_ >= 1 && n % k_ == 0, "fsdp::ReplicaQuorum: ", k_,
              " ranks per replica do not divide the job's ", n, " ranks");
  // The progress reports and the store's keys speak of global ranks.
  for (int r = 0; r < n; ++r) {
    TORCH_CHECK(world_->global_ranks()[static_cast<size_t>(r)] == r,
                "fsdp::ReplicaQuorum: give it the world group (init_process_group's)");
  }
  const bool restarted = options_.incarnation() > 0;
  TORCH_CHECK(options_.incarnation() >= 0 && restarted == !world_->has_backend(),
              "fsdp::ReplicaQuorum: incarnation ", options_.incarnation(),
              restarted ? " (a restarted replica) needs the world group of a process that joins a "
                          "running job (FSDP_REPLICA_INCARNATION set)"
                        : " (the job's start) needs a world group with a backend");
  // NCCL's watchdog ends the process on a failed collective, and an NCCL communicator with a
  // dead peer may not shut down: survivors would not survive.
  TORCH_CHECK(world_->backend_name() == "gloo", "fsdp::ReplicaQuorum: Gloo only so far, not ",
              world_->backend_name());
  // Ranks stuck in a collective with a dead peer vote when it times out: the others must wait
  // longer than that for their votes.
  if (options_.vote_timeout().count() == 0)
    options_.vote_timeout(world_->timeout() + std::chrono::seconds(30));
  TORCH_CHECK(options_.vote_timeout() > world_->timeout(), "fsdp::ReplicaQuorum: vote_timeout (",
              options_.vote_timeout().count(), " ms) must exceed the group's collective timeout (",
              world_->timeout().count(), " ms)");
  num_replicas_ = n / k_;
  replica_ = world_->rank() / k_;
  index_ = world_->rank() % k_;
  store_ = c10::make_intrusive<c10d::PrefixStore>("fsdp/ft", detail::GroupAccess::store(*world_));
  if (restarted) {
    // An admission left for this rank's previous process (it asked, then died) is not this
    // one's: this one asks anew in rejoin().
    const std::string me = std::to_string(world_->rank());
    store_->deleteKey("admitted/" + me);
    // Until admitted: the process this one replaces is gone, whatever its rank's progress
    // reports (this one's now) say; reform() need not wait for it.
    store_->set("restarted/" + me, bytes_of(std::to_string(options_.incarnation())));
    std::string tag = "replica";  // appended: GCC 12 warns falsely on "literal" + string
    tag += std::to_string(replica_);
    tag += "/incarnation";
    tag += std::to_string(options_.incarnation());
    replica_group_ = world_->members_group(ranks_of({replica_}), tag);
    replicate_group_ = world_->members_group({world_->rank()}, tag + "/alone" + me);
    left_ = true;
    return;
  }
  TORCH_CHECK(options_.max_live() >= 0, "fsdp::ReplicaQuorum: max_live ", options_.max_live(),
              " is negative");
  replica_group_ = world_->block_group(k_);
  replicate_group_ = world_->strided_group(k_);
  std::vector<int> live = first_live();
  if (static_cast<int>(live.size()) == num_replicas_) {
    live_group_ = world_;
    live_ = std::move(live);
    schedule_.push_back({0, live_});
    return;
  }
  // Spares: the live replicas' groups among themselves (members_group: only members take
  // part); a spare waits in rejoin() with a replicate group of its rank alone.
  if (!rebuild(live, 0, "spares")) {
    std::string tag = "spare";  // appended: GCC 12 warns falsely on "literal" + string
    tag += std::to_string(world_->rank());
    replicate_group_ = world_->members_group({world_->rank()}, tag);
  }
}

ReplicaQuorum::~ReplicaQuorum() = default;

int ReplicaQuorum::most_live() const {
  return options_.max_live() > 0 ? std::min(options_.max_live(), num_replicas_) : num_replicas_;
}

std::vector<int> ReplicaQuorum::first_live() const {
  std::vector<int> live;
  for (int r = 0; r < most_live(); ++r)
    live.push_back(r);
  return live;
}

std::vector<int> ReplicaQuorum::ranks_of(const std::vector<int>& replicas) const {
  std::vector<int> ranks;
  for (int r : replicas) {
    for (int i = 0; i < k_; ++i)
      ranks.push_back(r * k_ + i);
  }
  return ranks;
}

std::vector<int> ReplicaQuorum::join_requests() const {
  std::vector<int> out;
  const int most = most_live();
  for (int r = 0; r < num_replicas_ && static_cast<int>(live_.size() + out.size()) < most; ++r) {
    if (std::find(live_.begin(), live_.end(), r) != live_.end())
      continue;
    std::vector<std::string> keys;
    for (int rank : ranks_of({r}))
      keys.push_back("join/" + std::to_string(rank));
    if (store_->check(keys))
      out.push_back(r);
  }
  return out;
}

bool ReplicaQuorum::commit(int64_t step, bool ok) {
  TORCH_CHECK(!left_, "fsdp::ReplicaQuorum: this rank left the job");
  std::string base = epoch_tag(epoch_);
  base += "/s";
  base += std::to_string(step);
  base += '/';
  const auto voters = ranks_of(live_);
  const bool committed = vote(base, voters, ok);
  // The keys of the vote two votes back: every live rank has finished that one (it voted in the
  // last). One rank deletes them, so the store does not grow with the steps; a rank stopped
  // since then that comes back finds no outcome and fails its vote at the timeout.
  if (world_->rank() == voters.front()) {
    old_votes_.push_back(base);
    if (old_votes_.size() > 2) {
      for (const char* key : {"ok", "fail", "outcome"})
        store_->deleteKey(old_votes_.front() + key);
      old_votes_.pop_front();
    }
  }
  return committed;
}

bool ReplicaQuorum::vote(const std::string& base, const std::vector<int>& voters, bool ok) {
  store_->add(base + (ok ? "ok" : "fail"), 1);
  // The outcome is the first one written: a rank that saw every vote writes "commit", one that
  // saw a failed vote, a silent voter or the deadline writes "fail". A rank stopped past the
  // deadline that comes back and votes ok reads "fail", so no two ranks disagree.
  const auto decide = [&](const std::string& outcome) {
    const auto v = store_->compareSet(base + "outcome", {}, bytes_of(outcome));
    const std::string decided(v.begin(), v.end());
    if (decided.rfind("commit", 0) != 0)
      return false;
    admitted_ = decided.size() > 6 ? decode(bytes_of(decided.substr(6))) : std::vector<int>{};
    return true;
  };
  const auto start = Clock::now();
  auto next_look = start + std::chrono::milliseconds(250);
  Backoff backoff;
  while (true) {
    if (store_->add(base + "ok", 0) >= static_cast<int64_t>(voters.size())) {
      // Each rank votes once: all of them said ok. The replicas asking to rejoin come in with
      // the next step.
      const auto joining = join_requests();
      return decide(joining.empty() ? std::string("commit") : "commit" + encode(joining));
    }
    if (store_->add(base + "fail", 0) > 0 || store_->check({base + "outcome"}))
      return decide("fail");
    const auto now = Clock::now();
    if (now - start > options_.vote_timeout())
      return decide("fail");
    if (now >= next_look) {  // a look at the reports costs a thread: 4 a second
      next_look = now + std::chrono::milliseconds(250);
      if (stopped(voters, /*all=*/false))  // a voter that stopped reporting will not vote
        return decide("fail");
    }
    backoff.wait();
  }
}

bool ReplicaQuorum::stopped(const std::vector<int>& ranks, bool all) {
  const auto progress = detail::current_peer_progress();
  if (!progress)
    return false;
  const auto reports = progress->read(ranks, "", 0, "", std::chrono::milliseconds(1000));
  if (!reports)
    return false;  // the store did not answer in time: nothing learnt
  const auto now = Clock::now();
  size_t stopped = 0;
  for (const auto& p : *reports) {
    if (!p.heard)
      continue;  // never reported: unknown, not stopped
    auto it = last_report_.find(p.rank);
    if (it == last_report_.end() || it->second.first != p.reported_at) {
      last_report_[p.rank] = {p.reported_at, now};
      continue;
    }
    if (now - it->second.second > progress->silent_after())
      ++stopped;
  }
  return all ? stopped == ranks.size() : stopped > 0;
}

bool ReplicaQuorum::reform(int64_t step) {
  TORCH_CHECK(!left_, "fsdp::ReplicaQuorum: this rank left the job");
  const std::string base = epoch_tag(epoch_) + "/reform/";
  const auto key = [&](int rank) { return base + "r" + std::to_string(rank); };
  // Whether this replica can go on: every rank of it has arrived here (each out of its failed
  // collective: one waiting on a dead rank of another replica arrives a collective timeout
  // later). Its group's connections may have broken with the fault (a Gloo collective that
  // timed out closes them for good), but rebuild() makes the replica a new group. A rank of a
  // replica that is not whole (a peer silent, restarted, or not arrived within the vote
  // timeout) registers "0": its replica is left out, and the others need not wait for it.
  bool whole = true;
  if (k_ > 1) {
    const auto arrived = [&](int rank) { return base + "a" + std::to_string(rank); };
    store_->set(arrived(world_->rank()), bytes_of("1"));
    std::vector<int> peers;
    for (int r : ranks_of({replica_}))
      if (r != world_->rank())
        peers.push_back(r);
    const auto start = Clock::now();
    auto next_look = start;
    while (true) {
      std::vector<int> missing;
      for (int r : peers)
        if (!store_->check({arrived(r)}))
          missing.push_back(r);
      if (missing.empty())
        break;
      const auto now = Clock::now();
      bool gone = store_->check({base + "decision"}) || now - start > options_.vote_timeout();
      for (int r : missing)
        gone = gone || store_->check({"restarted/" + std::to_string(r)});
      if (!gone && now >= next_look) {
        next_look = now + std::chrono::milliseconds(250);
        gone = stopped(missing, /*all=*/false);
      }
      if (gone) {
        whole = false;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  store_->set(key(world_->rank()), bytes_of(whole ? "1" : "0"));
  // Wait for every rank of the live replicas to register, or to be known dead: its progress
  // reports stopped (peer_progress.h: a stopped, dead or cut-off process stops reporting; one
  // that is computing or stuck in a collective goes on, and registers once that fails).
  // Without reports, the join window bounds the wait instead.
  const auto expected = ranks_of(live_);
  const bool reports = detail::current_peer_progress() != nullptr;
  const auto start = Clock::now();
  auto next_look = start;
  std::vector<int> present;
  while (true) {
    present.clear();
    std::vector<int> missing;
    for (int r : expected)
      (store_->check({key(r)}) ? present : missing).push_back(r);
    // Once a survivor has decided, the others follow at once: the groups of the decision are
    // being made, and their makers wait only a collective timeout for every member.
    if (missing.empty() || store_->check({base + "decision"}))
      break;
    const auto now = Clock::now();
    if (now - start > options_.vote_timeout() || (!reports && now - start > options_.join_window()))
      break;
    if (now >= next_look) {
      next_look = now + std::chrono::milliseconds(250);
      // A rank whose process was restarted will not register; the others are waited for
      // until their reports stop.
      std::vector<int> silent;
      for (int r : missing) {
        if (!store_->check({"restarted/" + std::to_string(r)}))
          silent.push_back(r);
      }
      if (silent.empty() || stopped(silent, /*all=*/true))
        break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // The replicas every rank of which registered; the first decision written is everyone's.
  std::vector<int> view;
  for (int r : live_) {
    bool complete = true;
    for (int i = 0; i < k_ && complete; ++i) {
      const int rank = r * k_ + i;
      complete = std::count(present.begin(), present.end(), rank) > 0 &&
                 store_->get(key(rank)) == bytes_of("1");
    }
    if (complete)
      view.push_back(r);
  }
  const auto decided = decode(store_->compareSet(base + "decision", {}, bytes_of(encode(view))));
  ++epoch_;
  return rebuild(decided, step, epoch_tag(epoch_));
}

bool ReplicaQuorum::set_membership(const std::vector<int>& live, int64_t step) {
  TORCH_CHECK(!left_, "fsdp::ReplicaQuorum: this rank left the job");
  for (size_t i = 0; i < live.size(); ++i) {
    TORCH_CHECK(live[i] >= 0 && live[i] < num_replicas_ && (i == 0 || live[i] > live[i - 1]),
                "fsdp::ReplicaQuorum: the membership ", encode(live),
                " is not ascending replicas of ", num_replicas_);
  }
  return change(live, step);
}

void ReplicaQuorum::admit(int64_t next_step) {
  TORCH_CHECK(!left_ && !admitted_.empty(), "fsdp::ReplicaQuorum::admit: nothing was admitted");
  std::vector<int> live = live_;
  live.insert(live.end(), admitted_.begin(), admitted_.end());
  std::sort(live.begin(), live.end());
  live.erase(std::unique(live.begin(), live.end()), live.end());
  admitted_.clear();
  change(live, next_step);
}

bool ReplicaQuorum::change(const std::vector<int>& live, int64_t step) {
  // Who stays is who has the state; the joining ranks learn the change from their keys.
  stayed_.clear();
  std::vector<int> joining;
  for (int r : live)
    (std::count(live_.begin(), live_.end(), r) ? stayed_ : joining).push_back(r);
  TORCH_CHECK(!stayed_.empty(), "fsdp::ReplicaQuorum: the membership ", encode(live),
              " keeps none of the live replicas ", encode(live_));
  ++epoch_;
  // One writer (the first rank of the first replica that stays), so that a joining rank that
  // read and deleted its key never sees it written again.
  if (!joining.empty() && world_->rank() == stayed_.front() * k_) {
    std::string value = std::to_string(epoch_);
    value += ':';
    value += std::to_string(step);
    value += ':';
    value += encode(live);
    value += ':';
    value += encode(stayed_);
    for (int rank : ranks_of(joining))
      store_->set("admitted/" + std::to_string(rank), bytes_of(value));
  }
  return rebuild(live, step, epoch_tag(epoch_));
}

int64_t ReplicaQuorum::rejoin(std::chrono::milliseconds timeout, bool ask) {
  TORCH_CHECK(left_, "fsdp::ReplicaQuorum::rejoin: this rank's replica is live");
  const std::string me = std::to_string(world_->rank());
  if (ask)
    store_->set("join/" + me, bytes_of("1"));
  const auto deadline = Clock::now() + timeout;
  Backoff backoff;
  std::string value;
  auto next_look = Clock::now();
  while (value.empty()) {
    if (!store_->check({"admitted/" + me})) {
      if (Clock::now() >= next_look) {  // twice a second: nobody may be left to admit it
        next_look = Clock::now() + std::chrono::milliseconds(500);
        if (store_->check({"finished"})) {  // training is over: nothing to join
          if (ask)
            store_->deleteKey("join/" + me);
          return kFinished;
        }
        std::string why;
        if (state_lost(&why)) {
          if (ask)
            store_->deleteKey("join/" + me);
          throw ReplicaStateLost("fsdp::ReplicaQuorum: no live replica holds the training state (" +
                                 why + "): without a checkpoint the job cannot go on");
        }
      }
      if (Clock::now() > deadline) {
        // The request is withdrawn; an admission that raced it makes the live ranks' next
        // groups fail to form (this rank never joins them), which they handle as a fault.
        if (ask)
          store_->deleteKey("join/" + me);
        return -1;
      }
      backoff.wait();
      continue;
    }
    const auto raw = store_->get("admitted/" + me);
    store_->deleteKey("admitted/" + me);
    value.assign(raw.begin(), raw.end());
    // "<epoch>:<step>:[live]:[stayed]", as change() wrote it; one of an epoch before this rank
    // left is stale.
    if (std::stoull(value.substr(0, value.find(':'))) <= left_at_epoch_)
      value.clear();
  }
  if (ask)
    store_->deleteKey("join/" + me);
  store_->deleteKey("restarted/" + me);
  const auto c1 = value.find(':'), c2 = value.find(':', c1 + 1), c3 = value.find(':', c2 + 1);
  TORCH_CHECK(c1 != std::string::npos && c2 != std::string::npos && c3 != std::string::npos,
              "fsdp::ReplicaQuorum: a malformed admission in the store: '", value, "'");
  epoch_ = std::stoull(value.substr(0, c1));
  const int64_t step = std::stoll(value.substr(c1 + 1, c2 - c1 - 1));
  stayed_ = decode(bytes_of(value.substr(c3 + 1)));
  rebuild(decode(bytes_of(value.substr(c2 + 1, c3 - c2 - 1))), step, epoch_tag(epoch_));
  return step;
}

void ReplicaQuorum::sync_state(const std::vector<torch::Tensor>& tensors, std::string* blob,
                               const std::vector<torch::Tensor>& held) {
  TORCH_CHECK(!left_ && replicate_group_ && !stayed_.empty(),
              "fsdp::ReplicaQuorum::sync_state: no change admitted replicas");
  torch::NoGradGuard no_grad;
  auto& group = *replicate_group_;
  // The group is the live replicas in ascending order, at this index: the first that stayed.
  const int root =
      static_cast<int>(std::find(live_.begin(), live_.end(), stayed_.front()) - live_.begin());
  // Checked before the first collective: a rank that threw midway would leave the others
  // waiting in a broadcast until the timeout.
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].is_contiguous() && tensors[i].device().is_cpu(),
                "fsdp::ReplicaQuorum::sync_state: tensor ", i, " is not a contiguous CPU tensor");
  }
  {
    // The members' tensors must agree in number, dtypes and shapes, or the broadcasts below
    // would pair unlike buffers (a replica started with another config): compared first, as a
    // hash of them all.
    std::vector<int64_t> layout{static_cast<int64_t>(tensors.size()),
                                static_cast<int64_t>(held.size()), blob ? 1 : 0};
    for (const auto* list : {&tensors, &held}) {
      for (const auto& t : *list) {
        layout.push_back(static_cast<int64_t>(t.scalar_type()));
        layout.push_back(t.dim());
        layout.insert(layout.end(), t.sizes().begin(), t.sizes().end());
      }
    }
    const auto signature = checksum(
        torch::from_blob(layout.data(), {static_cast<int64_t>(layout.size())}, torch::kLong));
    TORCH_CHECK(agreed(group, {signature}, "sync_state: layout").front(),
                "fsdp::ReplicaQuorum::sync_state: the replicas' tensors differ in number, dtypes "
                "or shapes (",
                tensors.size(), " to copy and ", held.size(),
                " held here): a replica started with another configuration?");
  }
  std::vector<torch::Tensor> all = tensors;
  if (blob) {
    auto size = torch::tensor({static_cast<int64_t>(blob->size())}, torch::kLong);
    broadcast(group, size, root, "sync_state: size")->wait();
    blob->resize(static_cast<size_t>(size.item<int64_t>()));
    // In place, in the string's own buffer.
    auto bytes = torch::from_blob(blob->data(), {size.item<int64_t>()}, torch::kUInt8);
    broadcast(group, bytes, root, "sync_state: blob")->wait();
    all.push_back(bytes);
  }
  for (const auto& t : tensors)
    broadcast(group, t, root, "sync_state")->wait();
  const size_t copied = all.size();
  all.insert(all.end(), held.begin(), held.end());
  // Every member's checksum of every tensor, compared with the others'.
  std::vector<int64_t> sums(all.size());
  for (size_t i = 0; i < all.size(); ++i)
    sums[i] = checksum(all[i]);
  const auto same = agreed(group, sums, "sync_state: checksums");
  for (size_t i = 0; i < all.size(); ++i) {
    if (same[i])
      continue;
    std::string what = "tensor " + std::to_string(i);
    if (i >= copied)
      what = "held tensor " + std::to_string(i - copied) + " (not copied: each replica's own)";
    else if (blob && i + 1 == copied)
      what = "the blob";
    TORCH_CHECK(false, "fsdp::ReplicaQuorum::sync_state: ", what,
                " differs between the replicas after the copy (checksums differ)");
  }
}

void ReplicaQuorum::record_membership(const std::vector<int>& live, int64_t step) {
  // One writer per change, the first rank of the first live replica; any rank when none is
  // left. "<epoch>:<step>:[live]"; a writer slower than the next change's keeps the later one.
  if (!live.empty() && world_->rank() != live.front() * k_)
    return;
  std::string value = std::to_string(epoch_);
  value += ':';
  value += std::to_string(step);
  value += ':';
  value += encode(live);
  std::vector<uint8_t> current;
  if (store_->check({"membership"}))
    current = store_->get("membership");
  while (true) {
    const std::string cur(current.begin(), current.end());
    if (!cur.empty() && std::stoull(cur.substr(0, cur.find(':'))) >= epoch_)
      return;
    const auto now = store_->compareSet("membership", current, bytes_of(value));
    if (now == bytes_of(value))
      return;
    current = now;
  }
}

void ReplicaQuorum::publish(const std::string& name, const std::string& value) {
  store_->set("published/" + name, bytes_of(value));
}

std::string ReplicaQuorum::published(const std::string& name) const {
  const auto bytes = store_->get("published/" + name);
  return std::string(bytes.begin(), bytes.end());
}

void ReplicaQuorum::finish() {
  TORCH_CHECK(!left_, "fsdp::ReplicaQuorum::finish: this rank's replica is not live");
  store_->set("finished", bytes_of("1"));
}

bool ReplicaQuorum::state_lost(std::string* why) const {
  // Until the first change is recorded: the job's start.
  std::string step = "0";
  std::vector<int> live = first_live();
  if (store_->check({"membership"})) {
    const auto raw = store_->get("membership");
    const std::string value(raw.begin(), raw.end());
    const auto c1 = value.find(':'), c2 = value.find(':', c1 + 1);
    TORCH_CHECK(c1 != std::string::npos && c2 != std::string::npos,
                "fsdp::ReplicaQuorum: a malformed membership in the store: '", value, "'");
    step = value.substr(c1 + 1, c2 - c1 - 1);
    live = decode(bytes_of(value.substr(c2 + 1)));
  }
  for (int r : live) {
    bool whole = true;  // no rank of it restarted since: its processes hold the state
    for (int rank : ranks_of({r}))
      whole = whole && !store_->check({"restarted/" + std::to_string(rank)});
    if (whole)
      return false;
  }
  if (why) {
    *why = live.empty() ? "the membership decided at step " + step + " kept no replica"
                        : "every replica of the membership from step " + step + " " + encode(live) +
                              " has lost a process since";
  }
  return true;
}

bool ReplicaQuorum::rebuild(std::vector<int> live, int64_t step, const std::string& tag) {
  record_membership(live, step);
  if (std::find(live.begin(), live.end(), replica_) == live.end()) {
    live_ = std::move(live);
    schedule_.push_back({step, live_});
    replicate_group_.reset();
    live_group_.reset();
    left_ = true;
    left_at_epoch_ = epoch_;
    return false;
  }
  // May throw (a rank died while the groups were made, and every member's join then times
  // out): nothing changes but the epoch, and the caller votes the step failed and reforms.
  auto live_group = world_->members_group(ranks_of(live), tag + "/live");
  std::vector<int> same_index;
  for (int r : live)
    same_index.push_back(r * k_ + index_);
  auto replicate_group = world_->members_group(same_index, tag + "/index" + std::to_string(index_));
  // The replica's own group anew too: one of its collectives may have timed out in the fault
  // (the others waiting on a rank stuck with a dead peer elsewhere), which closed its
  // connections for good.
  if (k_ > 1)
    replica_group_ =
        world_->members_group(ranks_of({replica_}), tag + "/replica" + std::to_string(replica_));
  live_ = std::move(live);
  schedule_.push_back({step, live_});
  live_group_ = std::move(live_group);
  replicate_group_ = std::move(replicate_group);
  left_ = false;
  return true;
}

}  // namespace fsdp
