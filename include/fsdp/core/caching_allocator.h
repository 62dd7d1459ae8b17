// A caching CPU allocator: tensor storage freed by one training step is kept and handed back to
// the next step's allocation of the same size, instead of going back to malloc.
//
// Why: a training step allocates and frees the same tensors in the same order every step, but
// glibc places them differently from step to step, so the pages of its free chunks become
// resident one after another and a rank's resident memory creeps up for hundreds of steps
// (docs/multi-node.md, "Soak": +5-7% over 2,000 steps while the bytes in use stayed flat). With
// every size served from its own free list, a step in steady state makes no malloc calls for
// tensors at all, so the set of resident pages stops changing. LibTorch has a caching allocator
// for CUDA only; the CPU one allocates and frees every storage.
//
// How much it keeps: blocks are reused only for requests of the same size (rounded up to 64
// bytes), and the bytes held from malloc (live plus cached) are kept under a limit that follows
// the largest live total seen so far plus a slack (CachingOptions). A request that would pass
// the limit first returns the least recently freed cached blocks to malloc. So the footprint
// stays within the slack of what the program really needed at its peak, even when the sizes
// change (evaluation, variable-length batches, a new configuration).
#pragma once

#include <cstdint>

namespace fsdp::memory {

struct CachingOptions {
  /// Cache freed blocks at all (false: every request goes to malloc, as without the cache).
  bool enabled = true;
  /// The bytes held (live + cached) may exceed the highest live total seen so far by this
  /// fraction of it, plus min_slack_bytes, before cached blocks are released.
  double slack = 0.25;
  int64_t min_slack_bytes = int64_t{16} << 20;
};

struct CacheStats {
  /// Requests served from the cache / from malloc, cumulative.
  int64_t hits = 0;
  int64_t misses = 0;
  /// Cached blocks given back to malloc to stay under the limit or by empty_cache().
  int64_t released_blocks = 0;
  /// Bytes held from malloc now: live blocks and cached ones (rounded sizes).
  int64_t reserved_bytes = 0;
  /// Of which cached (free, kept for reuse).
  int64_t cached_bytes = 0;
  int64_t cached_blocks = 0;
  /// The highest live total seen (rounded sizes): what the limit follows.
  int64_t peak_live_bytes = 0;
};

/// Puts the caching allocator in front of the CPU allocator c10 has at the time of the call.
/// Call it before install_tracking_allocator() (which then wraps it and still counts the bytes
/// requested, not the cached ones) and before threads that allocate tensors start. Idempotent;
/// refused once the tracking allocator is installed, which would stop counting.
void install_caching_allocator(const CachingOptions& options = {});
bool caching_installed();

/// Changes the options from now on; disabling releases every cached block. Storage allocated
/// before the change is freed into the cache (or to malloc) by the rules in force when it dies.
void set_caching_options(const CachingOptions& options);
CachingOptions caching_options();

/// Returns every cached block to malloc (live ones are untouched).
void empty_cache();

CacheStats cache_stats();

}  // namespace fsdp::memory
