// Per-rank CPU memory accounting, so tests and benchmarks can check the memory FSDP is meant
// to save (sharded parameters, freed unsharded buffers) instead of trusting it.
//
// Ranks are separate processes, so process-wide counters are per-rank counters. Only storage
// allocated through c10's CPU allocator after install_tracking_allocator() is counted.
#pragma once

#include <cstdint>
#include <string>

namespace fsdp::memory {

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
