#include <fsdp/core/memory.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <c10/core/Allocator.h>
#include <c10/core/DeviceType.h>
#include <c10/util/Exception.h>

namespace fsdp::memory {
namespace {

// Plain atomics rather than members of the allocator: deleters may run during static
// destruction (tensors held by globals), and trivially destructible counters stay valid then.
std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_num_allocations{0};
std::atomic<int64_t> g_allocated_total{0};

// Per category: live bytes, own high-water mark, and the live bytes when the overall peak was
// last raised. The snapshot is taken without a lock: with several threads allocating at once it
// may mix two nearby moments, which a memory table can live with.
std::array<std::atomic<int64_t>, kNumCategories> g_cat_current{};
std::array<std::atomic<int64_t>, kNumCategories> g_cat_peak{};
std::array<std::atomic<int64_t>, kNumCategories> g_cat_at_peak{};

thread_local Category t_category = Category::kOther;

// Moments: the label in force (an index into the registered labels) and the one in force when
// the overall peak was last raised.
std::atomic<int> g_moment{0};
std::atomic<int> g_moment_at_peak{0};

void raise_to(std::atomic<int64_t>& peak, int64_t value) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (seen < value && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

void snapshot_categories() {
  g_moment_at_peak.store(g_moment.load(std::memory_order_relaxed), std::memory_order_relaxed);
  for (int c = 0; c < kNumCategories; ++c)
    g_cat_at_peak[c].store(g_cat_current[c].load(std::memory_order_relaxed),
                           std::memory_order_relaxed);
}

// Lowering is never needed here; reset_peak() is the only way down. Returns whether this call
// raised the peak.
bool raise_peak_to(int64_t value) {
  int64_t seen = g_peak.load(std::memory_order_relaxed);
  while (seen < value) {
    if (g_peak.compare_exchange_weak(seen, value, std::memory_order_relaxed))
      return true;
  }
  return false;
}

void add_to_category(int c, int64_t nbytes) {
  const int64_t now = g_cat_current[c].fetch_add(nbytes, std::memory_order_relaxed) + nbytes;
  if (nbytes > 0)
    raise_to(g_cat_peak[c], now);
}

// Why the bookkeeping lives in a side table instead of the DataPtr context: LibTorch calls
// Allocator::raw_allocate on the CPU allocator (oneDNN scratchpads in mkldnn_convolution, for
// one), which asserts that the context *is* the data pointer, and copy-on-write lazy clones
// need the same. So every DataPtr handed out is "simple" (context == data) and the deleter finds
// the wrapped allocation and its size by address. Sharded to keep intra-op threads from
// serialising on one lock.
struct LiveAllocation {
  c10::DataPtr original;
  int64_t nbytes;
  int category;
};

struct alignas(64) Shard {
  std::mutex mutex;
  std::unordered_map<void*, LiveAllocation> live;
};

constexpr size_t kNumShards = 16;

Shard& shard_for(const void* data) {
  // Never destroyed: deleters of tensors held by other statics can run during static
  // destruction, after anything with a destructor in this file is gone.
  static auto* shards = new std::array<Shard, kNumShards>();
  // Allocations are 64-byte aligned, so skip the always-zero low bits before mixing.
  const auto key = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(data) >> 6);
  return (*shards)[(key * 0x9E3779B97F4A7C15ULL) >> 60];
}
static_assert(kNumShards == 16, "shard_for takes the top 4 bits of the hash");

void tracked_delete(void* data) {
  if (data == nullptr) {
    return;
  }
  Shard& shard = shard_for(data);
  std::unordered_map<void*, LiveAllocation>::node_type node;
  {
    std::lock_guard<std::mutex> lock(shard.mutex);
    node = shard.live.extract(data);
  }
  // A miss means someone handed us memory we never allocated; freeing it would be a guess.
  TORCH_INTERNAL_ASSERT(!node.empty(), "fsdp::memory: freeing an untracked pointer ", data);
  g_current.fetch_sub(node.mapped().nbytes, std::memory_order_relaxed);
  add_to_category(node.mapped().category, -node.mapped().nbytes);
  // `node` goes out of scope here, outside the lock: the wrapped allocator's own deleter frees
  // the memory.
}

class TrackingAllocator final : public c10::Allocator {
 public:
  explicit TrackingAllocator(c10::Allocator* wrapped) : wrapped_(wrapped) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr original = wrapped_->allocate(n);
    void* data = original.get();
    const c10::Device device = original.device();
    if (data == nullptr) {
      // Zero-byte storages own no memory and nullptr cannot be a table key. Still return our
      // deleter so raw_deleter() holds for every DataPtr we produce.
      if (original.get_context() == nullptr) {
        return {nullptr, nullptr, &tracked_delete, device};
      }
      return original;
    }
    const auto nbytes = static_cast<int64_t>(n);
    const int category = static_cast<int>(t_category);
    {
      Shard& shard = shard_for(data);
      std::lock_guard<std::mutex> lock(shard.mutex);
      const bool inserted =
          shard.live.try_emplace(data, LiveAllocation{std::move(original), nbytes, category})
              .second;
      // Two live allocations at one address would mean the wrapped allocator is broken.
      TORCH_INTERNAL_ASSERT(inserted, "fsdp::memory: address ", data, " allocated twice");
    }
    // Counted only after the insert, so a throwing allocation leaves the counters alone.
    add_to_category(category, nbytes);
    const int64_t now = g_current.fetch_add(nbytes, std::memory_order_relaxed) + nbytes;
    if (raise_peak_to(now))
      snapshot_categories();
    if (nbytes > 0) {
      g_num_allocations.fetch_add(1, std::memory_order_relaxed);
      g_allocated_total.fetch_add(nbytes, std::memory_order_relaxed);
    }
    return {data, data, &tracked_delete, device};
  }

  // Enables raw_allocate/raw_deallocate, which LibTorch uses on the CPU allocator.
  c10::DeleterFnPtr raw_deleter() const override { return &tracked_delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  c10::Allocator* wrapped_;
};

std::mutex g_install_mutex;
// Written once under g_install_mutex and never freed: c10 keeps a raw pointer to it.
std::atomic<TrackingAllocator*> g_tracker{nullptr};

}  // namespace

void install_tracking_allocator() {
  std::lock_guard<std::mutex> lock(g_install_mutex);
  c10::Allocator* active = c10::GetAllocator(c10::DeviceType::CPU);
  TrackingAllocator* tracker = g_tracker.load(std::memory_order_acquire);
  if (tracker != nullptr) {
    TORCH_CHECK(active == tracker,
                "fsdp::memory: the CPU allocator was replaced after the tracking allocator was "
                "installed; allocations are no longer counted");
    return;
  }
  tracker = new TrackingAllocator(active);
  // 255 is the highest priority, so this wins over c10's default (0) and any registration
  // made at static-init time.
  c10::SetAllocator(c10::DeviceType::CPU, tracker, /*priority=*/255);
  TORCH_CHECK(c10::GetAllocator(c10::DeviceType::CPU) == tracker,
              "fsdp::memory: c10 did not accept the tracking CPU allocator");
  g_tracker.store(tracker, std::memory_order_release);
}

bool tracking_installed() {
  TrackingAllocator* tracker = g_tracker.load(std::memory_order_acquire);
  return tracker != nullptr && c10::GetAllocator(c10::DeviceType::CPU) == tracker;
}

Stats stats() {
  Stats s;
  s.current_bytes = g_current.load(std::memory_order_relaxed);
  s.peak_bytes = g_peak.load(std::memory_order_relaxed);
  s.num_allocations = g_num_allocations.load(std::memory_order_relaxed);
  s.allocated_bytes_total = g_allocated_total.load(std::memory_order_relaxed);
  return s;
}

int64_t current_bytes() {
  return g_current.load(std::memory_order_relaxed);
}

int64_t peak_bytes() {
  return g_peak.load(std::memory_order_relaxed);
}

namespace {
// A "<key>: <n> kB" line of /proc/self/status, in bytes (0 if absent).
int64_t proc_status_kb(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string prefix = std::string(key) + ":";
  while (std::getline(in, line)) {
    if (line.rfind(prefix, 0) == 0)
      return std::strtoll(line.c_str() + prefix.size(), nullptr, 10) * 1024;
  }
  return 0;
}
}  // namespace

int64_t resident_bytes() {
  return proc_status_kb("VmRSS");
}

int64_t peak_resident_bytes() {
  return proc_status_kb("VmHWM");
}

void reset_peak() {
  g_peak.store(g_current.load(std::memory_order_relaxed), std::memory_order_relaxed);
  for (int c = 0; c < kNumCategories; ++c)
    g_cat_peak[c].store(g_cat_current[c].load(std::memory_order_relaxed),
                        std::memory_order_relaxed);
  snapshot_categories();
  // An allocation racing with the store may have raised current past what we stored.
  raise_peak_to(g_current.load(std::memory_order_relaxed));
}

const char* to_string(Category category) {
  switch (category) {
    case Category::kOther:
      return "other";
    case Category::kParams:
      return "sharded parameters";
    case Category::kGrads:
      return "gradients";
    case Category::kOptimizer:
      return "optimizer state";
    case Category::kGathered:
      return "gathered parameters";
    case Category::kActivations:
      return "activations";
  }
  return "?";
}

int64_t CategoryBytes::total() const {
  int64_t sum = 0;
  for (auto b : bytes)
    sum += b;
  return sum;
}

CategoryScope::CategoryScope(Category category) : previous_(t_category) {
  t_category = category;
}

CategoryScope::~CategoryScope() {
  t_category = previous_;
}

bool retag(const void* data, Category category) {
  if (data == nullptr || g_tracker.load(std::memory_order_acquire) == nullptr)
    return false;
  Shard& shard = shard_for(data);
  int from = 0;
  int64_t nbytes = 0;
  {
    std::lock_guard<std::mutex> lock(shard.mutex);
    auto it = shard.live.find(const_cast<void*>(data));
    if (it == shard.live.end())
      return false;
    from = it->second.category;
    nbytes = it->second.nbytes;
    it->second.category = static_cast<int>(category);
  }
  if (from != static_cast<int>(category)) {
    add_to_category(from, -nbytes);
    add_to_category(static_cast<int>(category), nbytes);
  }
  return true;
}

namespace {
CategoryBytes load(const std::array<std::atomic<int64_t>, kNumCategories>& counters) {
  CategoryBytes out;
  for (int c = 0; c < kNumCategories; ++c)
    out.bytes[c] = counters[c].load(std::memory_order_relaxed);
  return out;
}
}  // namespace

CategoryBytes current_by_category() {
  return load(g_cat_current);
}

CategoryBytes peak_by_category() {
  return load(g_cat_peak);
}

CategoryBytes at_peak_by_category() {
  return load(g_cat_at_peak);
}

namespace {
struct MomentLabels {
  std::mutex mutex;
  std::vector<std::string> labels{""};
  std::unordered_map<std::string, int> ids{{"", 0}};
};
MomentLabels& moment_labels() {
  static auto* labels = new MomentLabels();  // never destroyed, as the shards
  return *labels;
}
}  // namespace

int moment_id(const std::string& label) {
  auto& m = moment_labels();
  std::lock_guard<std::mutex> lock(m.mutex);
  auto [it, added] = m.ids.emplace(label, static_cast<int>(m.labels.size()));
  if (added)
    m.labels.push_back(label);
  return it->second;
}

void set_moment(int id) {
  g_moment.store(id, std::memory_order_relaxed);
}

int current_moment() {
  return g_moment.load(std::memory_order_relaxed);
}

std::string at_peak_moment() {
  const int id = g_moment_at_peak.load(std::memory_order_relaxed);
  auto& m = moment_labels();
  std::lock_guard<std::mutex> lock(m.mutex);
  return id >= 0 && id < static_cast<int>(m.labels.size()) ? m.labels[static_cast<size_t>(id)]
                                                           : std::string();
}

PeakScope::PeakScope() {
  TORCH_CHECK(tracking_installed(),
              "fsdp::memory::PeakScope needs install_tracking_allocator() to have been called");
  outer_peak_ = peak_bytes();
  baseline_ = current_bytes();
  reset_peak();
}

PeakScope::~PeakScope() {
  // The enclosing scope's breakdown at its peak is not restored: at_peak_by_category() always
  // describes the latest high-water mark.
  raise_peak_to(outer_peak_);
}

int64_t PeakScope::peak() const {
  return peak_bytes();
}

std::string format_bytes(int64_t bytes) {
  // Magnitude in unsigned arithmetic so INT64_MIN does not overflow on negation.
  const uint64_t magnitude =
      bytes < 0 ? uint64_t{0} - static_cast<uint64_t>(bytes) : static_cast<uint64_t>(bytes);
  const char* sign = bytes < 0 ? "-" : "";
  std::array<char, 64> buf{};
  if (magnitude < 1024) {
    std::snprintf(buf.data(), buf.size(), "%s%llu B", sign,
                  static_cast<unsigned long long>(magnitude));
    return buf.data();
  }
  static constexpr std::array<const char*, 5> kUnits = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(magnitude) / 1024.0;
  size_t unit = 0;
  // 1023.995 rather than 1024 so that rounding to two decimals never prints "1024.00 KiB".
  while (value >= 1023.995 && unit + 1 < kUnits.size()) {
    value /= 1024.0;
    ++unit;
  }
  std::snprintf(buf.data(), buf.size(), "%s%.2f %s", sign, value, kUnits[unit]);
  return buf.data();
}

}  // namespace fsdp::memory
