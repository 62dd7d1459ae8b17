#include <fsdp/core/caching_allocator.h>
#include <fsdp/core/memory.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <mutex>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/DeviceType.h>
#include <c10/util/Exception.h>

namespace fsdp::memory {
namespace {

// Every block carries this header in the 64 bytes before the data it hands out, so the deleter
// finds the block from the data pointer alone: DataPtrs stay "simple" (context == data), which
// LibTorch's raw_allocate users and the tracking allocator's side table rely on. 64 bytes keeps
// the data at c10's 64-byte alignment.
struct alignas(64) Block {
  uint64_t magic;
  int64_t size;  // payload bytes, a multiple of 64
  // The least-recently-freed order of all cached blocks, oldest first (what is released first).
  Block* lru_prev;
  Block* lru_next;
  // The cached blocks of this size, most recently freed first (what is reused first).
  Block* size_next;
  bool cached;
};
static_assert(sizeof(Block) == 64, "the header must keep the payload 64-byte aligned");
constexpr uint64_t kMagic = 0x66736470'63616368ULL;  // "fsdpcach"
constexpr int64_t kRound = 64;

std::byte* payload(Block* b) {
  return reinterpret_cast<std::byte*>(b) + sizeof(Block);
}
Block* block_of(void* data) {
  return reinterpret_cast<Block*>(static_cast<std::byte*>(data) - sizeof(Block));
}

// The cache's state, under one mutex: a step makes a few thousand allocations, and an
// uncontended lock costs tens of nanoseconds against the microseconds a tensor op takes.
// Invariants (checked by check_invariants() in debug builds and by the tests through
// cache_stats()): reserved == live + cached; cached == the sum of the sizes on the LRU list ==
// the sum over the size lists; a block is on both lists iff its `cached` flag is set.
struct Cache {
  std::mutex mutex;
  c10::Allocator* wrapped = nullptr;
  CachingOptions options;
  std::unordered_map<int64_t, Block*> by_size;  // head of each size's list (may be nullptr)
  Block* lru_head = nullptr;                    // oldest cached block
  Block* lru_tail = nullptr;                    // newest
  int64_t live = 0, cached = 0, cached_blocks = 0, peak_live = 0;
  int64_t hits = 0, misses = 0, released = 0;

  void lru_unlink(Block* b) {
    (b->lru_prev ? b->lru_prev->lru_next : lru_head) = b->lru_next;
    (b->lru_next ? b->lru_next->lru_prev : lru_tail) = b->lru_prev;
    b->lru_prev = b->lru_next = nullptr;
  }

  // Removes a cached block from both lists. The size list is singly linked: removing the head
  // (reuse) is O(1), removing from the middle (release of the oldest) walks that size's list,
  // which in a training loop holds a handful of blocks.
  void take(Block* b) {
    lru_unlink(b);
    auto it = by_size.find(b->size);
    if (it->second == b) {
      it->second = b->size_next;
      if (it->second == nullptr)
        by_size.erase(it);  // sizes seen once (a variable batch) do not pile up in the map
    } else {
      Block* p = it->second;
      while (p->size_next != b)
        p = p->size_next;
      p->size_next = b->size_next;
    }
    b->size_next = nullptr;
    b->cached = false;
    cached -= b->size;
    --cached_blocks;
  }

  void put(Block* b) {
    Block*& head = by_size[b->size];
    b->size_next = head;
    head = b;
    b->lru_prev = lru_tail;
    b->lru_next = nullptr;
    (lru_tail ? lru_tail->lru_next : lru_head) = b;
    lru_tail = b;
    b->cached = true;
    cached += b->size;
    ++cached_blocks;
  }

  // Outside the lock: free() can take as long as a page unmapping.
  void release(Block* b) {
    b->magic = 0;
    wrapped->raw_deallocate(b);
  }

  int64_t limit(int64_t live_after) const {
    const auto peak = static_cast<double>(std::max(peak_live, live_after));
    return static_cast<int64_t>(peak * (1.0 + options.slack)) + options.min_slack_bytes;
  }
};

Cache& cache() {
  // Never destroyed: deleters of tensors held by statics run during static destruction.
  static auto* c = new Cache();
  return *c;
}

void cached_delete(void* data) {
  if (data == nullptr)
    return;
  Block* b = block_of(data);
  TORCH_INTERNAL_ASSERT(b->magic == kMagic && !b->cached,
                        "fsdp::memory: the caching allocator was handed a pointer it did not "
                        "allocate, or one freed twice: ",
                        data);
  Cache& c = cache();
  std::unique_lock<std::mutex> lock(c.mutex);
  c.live -= b->size;
  if (c.options.enabled) {
    c.put(b);
    return;
  }
  lock.unlock();
  c.release(b);
}

class CachingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    Cache& c = cache();
    if (n == 0)
      return c.wrapped->allocate(0);
    const int64_t size = (static_cast<int64_t>(n) + kRound - 1) / kRound * kRound;
    Block* b = nullptr;
    Block* to_release = nullptr;  // a chain (through size_next) freed outside the lock
    {
      std::lock_guard<std::mutex> lock(c.mutex);
      auto it = c.by_size.find(size);
      if (it != c.by_size.end() && it->second != nullptr) {
        b = it->second;
        c.take(b);
        ++c.hits;
      } else {
        ++c.misses;
        // Make room under the limit by releasing the least recently freed blocks.
        const int64_t limit = c.limit(c.live + size);
        while (c.lru_head != nullptr && c.live + c.cached + size > limit) {
          Block* old = c.lru_head;
          c.take(old);
          ++c.released;
          old->size_next = to_release;
          to_release = old;
        }
      }
      c.live += size;  // counted before malloc so that a concurrent miss sees it
      c.peak_live = std::max(c.peak_live, c.live);
    }
    while (to_release != nullptr) {
      Block* next = to_release->size_next;
      c.release(to_release);
      to_release = next;
    }
    if (b == nullptr) {
      void* raw = nullptr;
      try {
        raw = c.wrapped->raw_allocate(static_cast<size_t>(size) + sizeof(Block));
      } catch (...) {
        std::lock_guard<std::mutex> lock(c.mutex);
        c.live -= size;
        throw;
      }
      b = new (raw) Block{kMagic, size, nullptr, nullptr, nullptr, false};
    }
    void* data = payload(b);
    return {data, data, &cached_delete, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &cached_delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

std::mutex g_install_mutex;
std::atomic<CachingAllocator*> g_allocator{nullptr};

}  // namespace

void install_caching_allocator(const CachingOptions& options) {
  std::lock_guard<std::mutex> install_lock(g_install_mutex);
  if (g_allocator.load(std::memory_order_acquire) != nullptr) {
    set_caching_options(options);
    return;
  }
  TORCH_CHECK(!tracking_installed(),
              "fsdp::memory: install the caching allocator before the tracking allocator, which "
              "wraps whatever CPU allocator c10 has when it is installed");
  Cache& c = cache();
  c.wrapped = c10::GetAllocator(c10::DeviceType::CPU);
  TORCH_CHECK(c.wrapped != nullptr && c.wrapped->raw_deleter() != nullptr,
              "fsdp::memory: the CPU allocator in place has no raw deleter to cache for");
  c.options = options;
  auto* allocator = new CachingAllocator();  // never freed: c10 keeps a raw pointer to it
  // 255 as the tracking allocator: above c10's default and static-init registrations.
  c10::SetAllocator(c10::DeviceType::CPU, allocator, /*priority=*/255);
  TORCH_CHECK(c10::GetAllocator(c10::DeviceType::CPU) == allocator,
              "fsdp::memory: c10 did not accept the caching CPU allocator");
  g_allocator.store(allocator, std::memory_order_release);
}

bool caching_installed() {
  return g_allocator.load(std::memory_order_acquire) != nullptr;
}

void set_caching_options(const CachingOptions& options) {
  TORCH_CHECK(options.slack >= 0 && options.min_slack_bytes >= 0,
              "fsdp::memory: caching slack must be >= 0");
  {
    std::lock_guard<std::mutex> lock(cache().mutex);
    cache().options = options;
  }
  if (!options.enabled)
    empty_cache();
}

CachingOptions caching_options() {
  std::lock_guard<std::mutex> lock(cache().mutex);
  return cache().options;
}

void empty_cache() {
  Cache& c = cache();
  Block* chain = nullptr;
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    while (c.lru_head != nullptr) {
      Block* b = c.lru_head;
      c.take(b);
      ++c.released;
      b->size_next = chain;
      chain = b;
    }
    c.by_size.clear();
  }
  while (chain != nullptr) {
    Block* next = chain->size_next;
    c.release(chain);
    chain = next;
  }
}

CacheStats cache_stats() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  CacheStats s;
  s.hits = c.hits;
  s.misses = c.misses;
  s.released_blocks = c.released;
  s.reserved_bytes = c.live + c.cached;
  s.cached_bytes = c.cached;
  s.cached_blocks = c.cached_blocks;
  s.peak_live_bytes = c.peak_live;
  return s;
}

}  // namespace fsdp::memory
