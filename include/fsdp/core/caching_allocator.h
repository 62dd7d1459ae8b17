// A caching CPU allocator: tensor storage freed by one training step is kept and handed back to
// the next step's allocations, instead of going back to malloc.
//
// Why: a training step allocates and frees the same tensors in the same order every step, but
// glibc places them differently from step to step, so the pages of its free chunks become
// resident one after another and a rank's resident memory creeps up for hundreds of steps
// (docs/multi-node.md, "Soak": +5-7% over 2,000 steps while the bytes in use stayed flat). With
// the memory kept in segments of its own, a step in steady state makes no malloc calls for
// tensors at all, so the set of resident pages stops changing. LibTorch has a caching allocator
// for CUDA only; the CPU one allocates and frees every storage.
//
// How: as LibTorch's CUDA caching allocator, which solves the same problem on the device.
// Memory is mapped in segments (mmap: 2 MiB for requests up to 1 MiB, 20 MiB for requests up to
// 10 MiB, the request itself above), a request gets the smallest free block that fits
// (split if the rest is worth keeping), and a freed block merges with its free neighbours. So
// any size can reuse any freed memory, as with malloc, but the segments stay ours: once a
// step's pattern fits them, the resident pages stop changing.
//
// How much it keeps: the bytes of its segments stay under a limit that follows the largest live
// total seen so far, plus a slack (CachingOptions); a new segment that would pass it first
// unmaps the segments with nothing alive in them.
#pragma once

#include <cstdint>

namespace fsdp::memory {

struct CachingOptions {
  /// Cache at all (false: every request goes to c10's allocator, i.e. malloc, as without it).
  bool enabled = true;
  /// The segments' bytes may exceed the highest live total seen so far by this fraction of it,
  /// plus min_slack_bytes, before free segments are given back (a segment larger than what is
  /// free can still be needed to serve a request).
  double slack = 0.25;
  int64_t min_slack_bytes = int64_t{16} << 20;
};

struct CacheStats {
  /// Requests served from a free block / by a new segment, cumulative.
  int64_t hits = 0;
  int64_t misses = 0;
  /// Segments held now, and those unmapped (to stay under the limit, by empty_cache() or once
  /// disabled), cumulative.
  int64_t segments = 0;
  int64_t released_segments = 0;
  /// Bytes of the segments held now: live blocks and free ones.
  int64_t reserved_bytes = 0;
  /// Of which free (cached for reuse).
  int64_t cached_bytes = 0;
  /// The highest live total seen (blocks rounded to 512 bytes): what the limit follows.
  int64_t peak_live_bytes = 0;
};

/// Puts the caching allocator in front of the CPU allocator c10 has at the time of the call.
/// Call it before install_tracking_allocator() (which then wraps it and still counts the bytes
/// requested, not the cached ones) and before threads that allocate tensors start. Idempotent;
/// refused once the tracking allocator is installed, which would stop counting.
void install_caching_allocator(const CachingOptions& options = {});
bool caching_installed();

/// Changes the options from now on. Disabling unmaps every segment with nothing alive in it, and
/// each other one as soon as its last block is freed; requests then go to malloc.
void set_caching_options(const CachingOptions& options);
CachingOptions caching_options();

/// Unmaps every segment with nothing alive in it.
void empty_cache();

CacheStats cache_stats();

}  // namespace fsdp::memory
