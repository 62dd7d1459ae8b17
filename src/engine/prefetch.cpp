// See prefetch.h for the schedule and the rate limiter.
#include "prefetch.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "param_group.h"

namespace fsdp::detail {
namespace {

bool same(const std::weak_ptr<ParamGroup>& w, const ParamGroup& unit) {
  auto p = w.lock();
  return p.get() == &unit;
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

void Prefetcher::issue_queued() {
  while (!queue_.empty() && in_use_ < limit_) {
    auto unit = queue_.front().lock();
    queue_.pop_front();
    if (unit && unit->sharded_state() == ShardedState::kSharded)
      unit->issue_unshard(/*counted=*/true);
  }
}

void Prefetcher::begin_forward(int limit) {
  recording_.clear();
  limit_ = std::max(1, limit);
}

void Prefetcher::record_forward(ParamGroup& unit) {
  recording_.push_back(unit.weak_from_this());
}

void Prefetcher::end_forward(bool completed) {
  queue_.clear();
  if (completed)
    order_ = std::move(recording_);
  recording_.clear();
}

void Prefetcher::begin_backward() {
  // The root call's unit first (its outputs get the first gradients), then the other calls in
  // reverse forward order.
  backward_order_.clear();
  if (order_.empty())
    return;
  backward_order_.push_back(order_.front());
  for (size_t i = order_.size(); i-- > 1;)
    backward_order_.push_back(order_[i]);
  backward_cursor_ = 0;
}

void Prefetcher::end_backward() {
  queue_.clear();
  backward_order_.clear();
  backward_cursor_ = 0;
}

std::vector<std::shared_ptr<ParamGroup>> Prefetcher::forward_targets(const ParamGroup& unit) const {
  if (unit.forward_prefetch_list)
    return lock_all(*unit.forward_prefetch_list);
  if (!unit.options().forward_prefetch() || order_.empty())
    return {};
  // This call is the k-th of the forward (k = recording_.size() - 1). If the previous forward
  // had this unit at k too, its (k+1)-th call comes next; otherwise the order changed: take the
  // call after this unit's first one.
  size_t k = recording_.empty() ? 0 : recording_.size() - 1;
  if (k >= order_.size() || !same(order_[k], unit)) {
    auto it =
        std::find_if(order_.begin(), order_.end(), [&](const auto& w) { return same(w, unit); });
    if (it == order_.end())
      return {};
    k = static_cast<size_t>(it - order_.begin());
  }
  if (k + 1 >= order_.size())
    return {};
  auto next = order_[k + 1].lock();
  auto root = order_.front().lock();
  // The root call's unit is gathered by its own call and stays so; never a prefetch target.
  if (!next || next == root || next.get() == &unit)
    return {};
  return {next};
}

std::vector<std::shared_ptr<ParamGroup>> Prefetcher::backward_targets(const ParamGroup& unit) {
  if (unit.backward_prefetch_list)
    return lock_all(*unit.backward_prefetch_list);
  if (unit.options().backward_prefetch() == BackwardPrefetch::kNone)
    return {};
  // Find this unit from the cursor on (a unit called twice appears twice), else anywhere.
  auto find_from = [&](size_t from) {
    for (size_t i = from; i < backward_order_.size(); ++i) {
      if (same(backward_order_[i], unit))
        return i;
    }
    return backward_order_.size();
  };
  size_t at = find_from(backward_cursor_);
  if (at == backward_order_.size())
    at = find_from(0);
  if (at == backward_order_.size())
    return {};
  backward_cursor_ = at + 1;
  for (size_t j = at + 1; j < backward_order_.size(); ++j) {
    auto next = backward_order_[j].lock();
    if (next && next.get() != &unit && next->awaits_backward())
      return {next};
  }
  return {};
}

void Prefetcher::request(ParamGroup& unit) {
  if (unit.sharded_state() != ShardedState::kSharded)
    return;
  if (std::any_of(queue_.begin(), queue_.end(), [&](const auto& w) { return same(w, unit); }))
    return;
  if (in_use_ < limit_) {
    unit.issue_unshard(/*counted=*/true);
  } else {
    queue_.push_back(unit.weak_from_this());
  }
}

void Prefetcher::claim(const ParamGroup& unit) {
  std::erase_if(queue_, [&](const auto& w) { return same(w, unit); });
}

void Prefetcher::acquire_slot() {
  ++in_use_;
  high_water_ = std::max(high_water_, in_use_);
}

void Prefetcher::release_slot() {
  TORCH_INTERNAL_ASSERT(in_use_ > 0, "fsdp: a rate-limiter slot released twice");
  --in_use_;
  issue_queued();
}

}  // namespace fsdp::detail
