#include <fsdp/distributed/store_latch.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <thread>
#include <vector>

#include <fsdp/distributed/process_group.h>

#include "group_access.h"

namespace fsdp {

StoreLatch::StoreLatch(ProcessGroup& group, const std::string& name)
    : key_("fsdp/latch/" + group.name() + "/" + name), rank_(group.rank()), size_(group.size()) {
  const auto& store = detail::GroupAccess::store(group);
  // A connection of its own: the latch's calls never wait behind the main thread's (the store
  // serialises calls on one connection), nor they behind the latch's.
  try {
    store_ = store->clone();
  } catch (const std::exception&) {
    store_ = store;
  }
}

StoreLatch::~StoreLatch() = default;

void StoreLatch::arrive(const std::string& note) {
  // The note first: a rank that sees the count complete finds every note there.
  store_->set(key_ + "/note/" + std::to_string(rank_),
              std::vector<uint8_t>(note.begin(), note.end()));
  store_->add(key_, 1);
}

std::vector<std::string> StoreLatch::take_notes() {
  std::vector<std::string> notes;
  for (int r = 0; r < size_; ++r) {
    const std::string key = key_ + "/note/" + std::to_string(r);
    const auto bytes = store_->get(key);
    notes.emplace_back(bytes.begin(), bytes.end());
    store_->deleteKey(key);
  }
  return notes;
}

void StoreLatch::discard() {
  for (int r = 0; r < size_; ++r)
    store_->deleteKey(key_ + "/note/" + std::to_string(r));
  store_->deleteKey(key_);
}

int64_t StoreLatch::arrived() {
  return store_->add(key_, 0);
}

bool StoreLatch::wait(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  // Polled: c10d's wait() takes keys that exist, not a count that reaches a value. A file's
  // write takes far longer than the 10 ms between polls.
  while (arrived() < size_) {
    if (std::chrono::steady_clock::now() >= deadline)
      return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

}  // namespace fsdp
