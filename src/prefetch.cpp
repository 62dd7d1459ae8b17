// See prefetch.h for the schedule and the rate limiter.
#include "prefetch.h"

#include <algorithm>
#include <deque>

#include "param_group.h"
#include "registry.h"

namespace fsdp::detail::prefetch {
namespace {

struct Schedule {
  std::vector<std::weak_ptr<ParamGroup>> recording;  // this forward, in call order
  std::vector<std::weak_ptr<ParamGroup>> order;      // the last complete forward
  const ParamGroup* recording_root = nullptr;
  const ParamGroup* root = nullptr;  // of `order`
  int limit = 2;
  int in_use = 0;
  int high_water = 0;
  std::deque<std::weak_ptr<ParamGroup>> queue;
};

thread_local Schedule t_schedule;

bool same(const std::weak_ptr<ParamGroup>& w, const ParamGroup& unit) {
  auto p = w.lock();
  return p.get() == &unit;
}

void issue_queued() {
  auto& s = t_schedule;
  while (!s.queue.empty() && s.in_use < s.limit) {
    auto unit = s.queue.front().lock();
    s.queue.pop_front();
    if (unit && unit->sharded_state() == ShardedState::kSharded)
      unit->issue_unshard(/*counted=*/true);
  }
}

std::vector<std::shared_ptr<ParamGroup>> lock_all(
    const std::vector<std::weak_ptr<ParamGroup>>& list) {
  std::vector<std::shared_ptr<ParamGroup>> out;
  for (const auto& w : list) {
    if (auto p = w.lock())
      out.push_back(std::move(p));
  }
  return out;
}

}  // namespace

void begin_forward(ParamGroup& root) {
  auto& s = t_schedule;
  s.recording.clear();
  s.recording_root = &root;
  s.limit = std::max(1, root.options().max_inflight_all_gathers());
}

void record_forward(ParamGroup& unit) {
  t_schedule.recording.push_back(unit.weak_from_this());
}

void end_forward() {
  auto& s = t_schedule;
  s.queue.clear();
  s.order = std::move(s.recording);
  s.recording.clear();
  s.root = s.recording_root;
  // A unit gathered ahead that this forward never ran (the order changed): free it now.
  for (auto& unit : live_units()) {
    if (unit->training_state() == TrainingState::kIdle && !unit->held() &&
        unit->sharded_state() != ShardedState::kSharded) {
      unit->reshard();
    }
  }
}

void end_backward() {
  t_schedule.queue.clear();
}

std::vector<std::shared_ptr<ParamGroup>> forward_targets(const ParamGroup& unit) {
  if (unit.forward_prefetch_list)
    return lock_all(*unit.forward_prefetch_list);
  if (!unit.options().forward_prefetch())
    return {};
  const auto& order = t_schedule.order;
  for (size_t i = 0; i < order.size(); ++i) {
    if (!same(order[i], unit))
      continue;
    for (size_t j = i + 1; j < order.size(); ++j) {
      auto next = order[j].lock();
      if (next && next.get() != t_schedule.root)
        return {next};
    }
    return {};
  }
  return {};
}

std::vector<std::shared_ptr<ParamGroup>> backward_targets(const ParamGroup& unit) {
  if (unit.backward_prefetch_list)
    return lock_all(*unit.backward_prefetch_list);
  if (unit.options().backward_prefetch() == BackwardPrefetch::kNone)
    return {};
  // Backward order: the root, then the other units in reverse forward order.
  std::vector<std::shared_ptr<ParamGroup>> order;
  std::shared_ptr<ParamGroup> root;
  for (const auto& w : t_schedule.order) {
    auto p = w.lock();
    if (!p)
      continue;
    if (p.get() == t_schedule.root)
      root = p;
    else
      order.push_back(std::move(p));
  }
  std::reverse(order.begin(), order.end());
  if (root)
    order.insert(order.begin(), root);
  auto it =
      std::find_if(order.begin(), order.end(), [&](const auto& p) { return p.get() == &unit; });
  if (it == order.end())
    return {};
  for (++it; it != order.end(); ++it) {
    if ((*it)->backward_pending())
      return {*it};
  }
  return {};
}

void request(ParamGroup& unit) {
  auto& s = t_schedule;
  if (unit.sharded_state() != ShardedState::kSharded)
    return;
  if (std::any_of(s.queue.begin(), s.queue.end(), [&](const auto& w) { return same(w, unit); }))
    return;
  if (s.in_use < s.limit) {
    unit.issue_unshard(/*counted=*/true);
  } else {
    s.queue.push_back(unit.weak_from_this());
  }
}

void claim(const ParamGroup& unit) {
  auto& q = t_schedule.queue;
  std::erase_if(q, [&](const auto& w) { return same(w, unit); });
}

void acquire_slot() {
  auto& s = t_schedule;
  ++s.in_use;
  s.high_water = std::max(s.high_water, s.in_use);
}

void release_slot() {
  auto& s = t_schedule;
  s.in_use = std::max(0, s.in_use - 1);
  issue_queued();
}

int slots_in_use() {
  return t_schedule.in_use;
}

int slots_high_water() {
  return t_schedule.high_water;
}

void reset_high_water() {
  t_schedule.high_water = t_schedule.in_use;
}

}  // namespace fsdp::detail::prefetch
