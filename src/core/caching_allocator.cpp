#include <fsdp/core/caching_allocator.h>
#include <fsdp/core/memory.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <mutex>
#include <set>
#include <unordered_map>
#include <vector>

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include <c10/core/Allocator.h>
#include <c10/core/DeviceType.h>
#include <c10/util/Exception.h>

namespace fsdp::memory {
namespace {

// Sizes and pools, as LibTorch's CUDA caching allocator sizes them (the same problem: a
// program that allocates the same tensors every step, some small, some large): requests are
// rounded to 512 bytes; those up to 1 MiB come from 2 MiB segments of their own pool, so that
// small tensors never split the large segments; 1-10 MiB requests from 20 MiB segments; larger
// ones from a segment of their own size (rounded to 2 MiB). A free block is split when what
// remains is worth keeping: any remainder in the small pool, above 1 MiB in the large one.
constexpr int64_t kRound = 512;
constexpr int64_t kSmallRequest = int64_t{1} << 20;
constexpr int64_t kSmallSegment = int64_t{2} << 20;
constexpr int64_t kMidRequest = int64_t{10} << 20;
constexpr int64_t kMidSegment = int64_t{20} << 20;
constexpr int64_t kLargeSplitRemainder = int64_t{1} << 20;

struct Block {
  std::byte* ptr;
  int64_t size;
  bool small_pool;
  bool free;
  // The blocks next to this one in its segment (nullptr at the segment's ends): a freed block
  // merges with free neighbours, so a segment whose blocks are all free is one block again.
  Block* prev;
  Block* next;
};

// A segment given back: unmapped outside the lock.
struct Segment {
  void* base;
  int64_t bytes;
};

// Best fit: the smallest free block that is large enough, lowest address among equals.
struct BySize {
  bool operator()(const Block* a, const Block* b) const {
    return a->size != b->size ? a->size < b->size : a->ptr < b->ptr;
  }
};
using FreeSet = std::set<Block*, BySize>;

int64_t round_up(int64_t n, int64_t to) {
  return (n + to - 1) / to * to;
}

// The state, under one mutex: a step makes a few thousand allocations, and an uncontended lock
// and a set lookup cost well under a microsecond against the microseconds a tensor op takes.
//
// A freed block is first *parked*: kept whole, for the next request of exactly its size. A
// training step asks for the same sizes every step, so in steady state every request finds a
// parked block, whatever order threads freed them in (merging at once would make where the
// next block is cut depend on that order, and now and then need a new segment late in a run:
// measured, +2 MiB at step ~100 of a soak). Only when a request finds neither a parked block of
// its size nor a free block that fits are the parked blocks merged into the free sets (varying
// sizes: evaluation, batches of varying length), before any new segment is mapped.
//
// Invariants: every byte of a segment is in exactly one block, which is live (in `live`),
// parked (in `parked` under its size, `free` false) or free (in its pool's free set, never next
// to another free block: they merge); reserved == the sum of the segments' sizes ==
// live_bytes + parked_bytes + the free blocks' bytes.
struct Cache {
  std::mutex mutex;
  c10::Allocator* wrapped = nullptr;
  CachingOptions options;
  FreeSet small_free, large_free;
  std::unordered_map<void*, Block*> live;
  std::unordered_map<int64_t, std::vector<Block*>> parked;
  int64_t live_bytes = 0, parked_bytes = 0, reserved = 0, peak_live = 0, segments = 0;
  int64_t hits = 0, misses = 0, released = 0;  // released: segments

  FreeSet& pool(const Block* b) { return b->small_pool ? small_free : large_free; }

  int64_t limit(int64_t live_after) const {
    const auto peak = static_cast<double>(std::max(peak_live, live_after));
    return static_cast<int64_t>(peak * (1.0 + options.slack)) + options.min_slack_bytes;
  }

  // Takes the segments whose blocks are all free out of the cache, largest first, until
  // `enough` bytes are out (all of them with enough < 0), and returns them to unmap outside
  // the lock.
  std::vector<Segment> take_free_segments(int64_t enough) {
    std::vector<Segment> bases;
    int64_t taken = 0;
    for (FreeSet* set : {&large_free, &small_free}) {
      for (auto it = set->rbegin(); it != set->rend() && (enough < 0 || taken < enough);) {
        Block* b = *it;
        if (b->prev != nullptr || b->next != nullptr) {
          ++it;
          continue;
        }
        it = std::make_reverse_iterator(set->erase(std::next(it).base()));
        taken += b->size;
        reserved -= b->size;
        --segments;
        ++released;
        bases.push_back({b->ptr, b->size});
        delete b;
      }
    }
    return bases;
  }

  void park(Block* b) {
    parked[b->size].push_back(b);
    parked_bytes += b->size;
  }

  Block* unpark(int64_t size) {
    auto it = parked.find(size);
    if (it == parked.end())
      return nullptr;
    Block* b = it->second.back();
    it->second.pop_back();
    if (it->second.empty())
      parked.erase(it);
    parked_bytes -= b->size;
    return b;
  }

  // Every parked block merged into its free set.
  void flush_parked() {
    for (auto& [size, blocks] : parked) {
      for (Block* b : blocks) {
        b = merge(b);
        pool(b).insert(b);
      }
    }
    parked.clear();
    parked_bytes = 0;
  }

  // Splits `b` (just taken out of its free set) to `size` if the rest is worth keeping free.
  void split(Block* b, int64_t size) {
    const int64_t rest = b->size - size;
    if (rest < kRound || (!b->small_pool && rest <= kLargeSplitRemainder))
      return;
    auto* r = new Block{b->ptr + size, rest, b->small_pool, true, b, b->next};
    if (b->next != nullptr)
      b->next->prev = r;
    b->next = r;
    b->size = size;
    pool(r).insert(r);
  }

  // Marks `b` free, merges it with free neighbours, and returns the merged block (not yet in a
  // free set).
  Block* merge(Block* b) {
    b->free = true;
    for (Block* n : {b->prev, b->next}) {
      if (n == nullptr || !n->free)
        continue;
      pool(n).erase(n);
      Block* lo = n == b->prev ? n : b;
      Block* hi = n == b->prev ? b : n;
      lo->size += hi->size;
      lo->next = hi->next;
      if (hi->next != nullptr)
        hi->next->prev = lo;
      delete hi;
      b = lo;
    }
    return b;
  }
};

Cache& cache() {
  // Never destroyed: deleters of tensors held by statics run during static destruction.
  static auto* c = new Cache();
  return *c;
}

// Segments come straight from mmap, not from malloc: glibc raises its mmap threshold to the
// size of each mapped chunk that is freed (up to 32 MiB), after which our segments would be cut
// from its heaps, whose freed pages stay resident: the growth this allocator exists to stop.
// Mapped, a released segment leaves the process at once.
std::byte* map_segment(int64_t bytes) {
  void* p = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK_WITH(OutOfMemoryError, p != MAP_FAILED,
                   "fsdp::memory caching allocator: can't allocate memory: mapping a segment of ",
                   bytes, " bytes failed: ", std::strerror(errno));
  return static_cast<std::byte*>(p);
}

void release_all(const std::vector<Segment>& segments) {
  for (const Segment& s : segments)
    munmap(s.base, static_cast<size_t>(s.bytes));
}

void cached_delete(void* data) {
  if (data == nullptr)
    return;
  Cache& c = cache();
  std::vector<Segment> bases;
  {
    std::unique_lock<std::mutex> lock(c.mutex);
    auto node = c.live.extract(data);
    if (node.empty()) {
      // Allocated while the cache was off, by c10's allocator, and handed back through our
      // raw_deleter() (raw_allocate / raw_deallocate): its own deleter frees it.
      const c10::DeleterFnPtr fallback = c.wrapped->raw_deleter();
      TORCH_INTERNAL_ASSERT(fallback != nullptr,
                            "fsdp::memory: the caching allocator was handed a pointer it did "
                            "not allocate: ",
                            data);
      lock.unlock();
      fallback(data);
      return;
    }
    Block* b = node.mapped();
    c.live_bytes -= b->size;
    if (c.options.enabled) {
      c.park(b);
    } else {
      b = c.merge(b);
      c.pool(b).insert(b);
      // Disabled: a segment is unmapped as soon as nothing in it is alive.
      if (b->prev == nullptr && b->next == nullptr)
        bases = c.take_free_segments(-1);
    }
  }
  release_all(bases);
}

class CachingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    Cache& c = cache();
    if (n == 0)
      return c.wrapped->allocate(0);
    const int64_t size = round_up(static_cast<int64_t>(n), kRound);
    const bool small = size <= kSmallRequest;
    std::unique_lock<std::mutex> lock(c.mutex);
    if (!c.options.enabled) {
      lock.unlock();
      return c.wrapped->allocate(n);  // its own deleter: never comes back here
    }
    FreeSet& set = small ? c.small_free : c.large_free;
    Block* b = c.unpark(size);
    if (b == nullptr) {
      Block probe{nullptr, size, small, true, nullptr, nullptr};
      auto it = set.lower_bound(&probe);
      if (it == set.end() && c.parked_bytes > 0) {
        c.flush_parked();
        it = set.lower_bound(&probe);
      }
      if (it != set.end()) {
        b = *it;
        set.erase(it);
      }
    }
    if (b != nullptr) {
      ++c.hits;
    } else {
      ++c.misses;
      const int64_t segment = small                ? kSmallSegment
                              : size < kMidRequest ? kMidSegment
                                                   : round_up(size, kSmallSegment);
      // Over the limit with this segment: unmap the free segments first (nothing is parked
      // now: a miss flushed them).
      const int64_t over = c.reserved + segment - c.limit(c.live_bytes + size);
      std::vector<Segment> to_release;
      if (over > 0)
        to_release = c.take_free_segments(over);
      if (!to_release.empty()) {
        // Unmapped before mapping, so that the new segment can take their place.
        lock.unlock();
        release_all(to_release);
        lock.lock();
      }
      b = new Block{map_segment(segment), segment, small, true, nullptr, nullptr};
      c.reserved += segment;
      ++c.segments;
    }
    c.split(b, size);
    b->free = false;
    c.live.emplace(b->ptr, b);
    c.live_bytes += b->size;
    c.peak_live = std::max(c.peak_live, c.live_bytes);
    void* data = b->ptr;
    lock.unlock();
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
  TORCH_CHECK(options.slack >= 0 && options.min_slack_bytes >= 0,
              "fsdp::memory: caching slack must be >= 0");
  Cache& c = cache();
  c.wrapped = c10::GetAllocator(c10::DeviceType::CPU);
  TORCH_CHECK(c.wrapped != nullptr, "fsdp::memory: c10 has no CPU allocator to fall back on");
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
  std::vector<Segment> bases;
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    c.flush_parked();
    bases = c.take_free_segments(-1);
  }
  release_all(bases);
}

CacheStats cache_stats() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  CacheStats s;
  s.hits = c.hits;
  s.misses = c.misses;
  s.released_segments = c.released;
  s.segments = c.segments;
  s.reserved_bytes = c.reserved;
  s.cached_bytes = c.reserved - c.live_bytes;
  s.peak_live_bytes = c.peak_live;
  return s;
}

}  // namespace fsdp::memory
