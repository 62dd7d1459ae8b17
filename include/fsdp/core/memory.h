// Per-rank CPU memory accounting, so tests and benchmarks can check the memory FSDP is meant
// to save (sharded parameters, freed unsharded buffers) instead of trusting it.
//
// Ranks are separate processes, so process-wide counters are per-rank counters. Only storage
// allocated through c10's CPU allocator after install_tracking_allocator() is counted.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace fsdp::memory {

/// What an allocation is for, so a run can print where its memory goes (the FSDP case study's
/// table, measured). The engine tags what it allocates: its shards (kParams), unsharded
/// parameters and gather buffers (kGathered), gradients, unsharded ones included, and their
/// reduction buffers (kGrads). The rest is tagged by whoever runs it: wrap forward and backward
/// in CategoryScope(kActivations) and the optimizer step in CategoryScope(kOptimizer);
/// anything untagged is kOther.
enum class Category : int {
  kOther = 0,
  kParams,
  kGrads,
  kOptimizer,
  kGathered,
  kActivations,
};
constexpr int kNumCategories = 6;
const char* to_string(Category category);

/// Bytes per category, indexed by Category.
struct CategoryBytes {
  std::array<int64_t, kNumCategories> bytes{};
  int64_t operator[](Category c) const { return bytes[static_cast<int>(c)]; }
  int64_t total() const;
};

/// Allocations this thread makes while the scope lives are counted under `category`; scopes
/// nest (the innermost wins).
class CategoryScope {
 public:
  explicit CategoryScope(Category category);
  ~CategoryScope();
  CategoryScope(const CategoryScope&) = delete;
  CategoryScope& operator=(const CategoryScope&) = delete;

 private:
  Category previous_;
};

/// Counts the live allocation that starts at `data` (a storage's data pointer) under
/// `category` from now on, e.g. a gradient that autograd allocated during backward. Returns
/// false if no tracked allocation starts there.
bool retag(const void* data, Category category);

/// Live bytes per category now.
CategoryBytes current_by_category();
/// Each category's own high-water mark since install or the last reset_peak().
CategoryBytes peak_by_category();
/// The live bytes per category at the moment the overall peak (peak_bytes()) was reached: they
/// sum to it.
CategoryBytes at_peak_by_category();

/// Moments: a label for where the program is ("forward h3", "optimizer"), recorded with the
/// overall peak, so a run can say when its peak happened (the planner predicts it). The engine
/// sets "forward <unit>" and "backward <unit>" as units start; whoever runs other phases sets
/// theirs. Labels are registered once (moment_id, thread-safe) and set by id (one relaxed store:
/// cheap enough for every unit call). Process-wide, as the counters.
int moment_id(const std::string& label);
void set_moment(int id);
int current_moment();
/// The label in force when the overall peak was last raised ("" if none was set).
std::string at_peak_moment();

struct Stats {
  /// Bytes of tracked allocations that are still alive.
  int64_t current_bytes = 0;
  /// High-water mark of current_bytes since install or the last reset_peak().
  int64_t peak_bytes = 0;
  /// Tracked allocations made since install (cumulative, not live); zero-byte requests are
  /// not counted because they own no memory.
  int64_t num_allocations = 0;
  /// Bytes requested by all tracked allocations since install (cumulative).
  int64_t allocated_bytes_total = 0;
};

/// Wraps the CPU allocator c10 has at the time of the call. Idempotent and thread-safe with
/// respect to itself, but c10::SetAllocator is not synchronised with concurrent allocations:
/// call it before starting threads that allocate tensors.
void install_tracking_allocator();
/// True while the tracking allocator is c10's CPU allocator.
bool tracking_installed();

Stats stats();
int64_t current_bytes();
int64_t peak_bytes();
/// peak := current, to measure the high-water mark of a phase.
void reset_peak();

/// The process's resident set size now, and its high-water mark since the process started
/// (Linux: VmRSS and VmHWM of /proc/self/status), in bytes; 0 where unavailable. What the
/// operating system charges for: tracked tensors plus everything else (LibTorch's code and
/// pools, allocator arenas and fragmentation, the backend's buffers).
int64_t resident_bytes();
int64_t peak_resident_bytes();

/// RAII: on construction resets the peak; peak() is the high-water mark since then, above
/// the bytes live at construction (baseline()) — i.e. absolute peak and baseline both available.
///
/// The counters are process-wide, so a scope sees allocations from every thread. When a scope
/// ends it folds the peak it replaced back in, so an enclosing scope (or a later peak_bytes())
/// still sees a high-water mark reached before the inner scope started. Constructing one
/// before install_tracking_allocator() is an error: it would report a meaningless zero.
class PeakScope {
 public:
  PeakScope();
  ~PeakScope();
  PeakScope(const PeakScope&) = delete;
  PeakScope& operator=(const PeakScope&) = delete;

  /// current_bytes() when the scope was constructed.
  int64_t baseline() const { return baseline_; }
  /// Absolute high-water mark since construction (>= baseline()).
  int64_t peak() const;
  /// peak() - baseline(): what the scope's work added at its worst point.
  int64_t peak_above_baseline() const { return peak() - baseline_; }

 private:
  int64_t baseline_;
  int64_t outer_peak_;
};

/// Human-readable size with binary units, e.g. "512 B", "1.50 MiB", "-2.00 GiB", for reports.
std::string format_bytes(int64_t bytes);

}  // namespace fsdp::memory
