// The caching CPU allocator: freed blocks come back for the same size, the bytes it holds stay
// under its limit, the tracking allocator on top still counts what was requested, and a training
// loop in steady state stops calling malloc for tensors. ctest runs each test in its own
// process, so each installs the allocator fresh.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include <c10/core/CPUAllocator.h>
#include <fsdp/core/caching_allocator.h>
#include <fsdp/core/memory.h>

namespace {

namespace mem = fsdp::memory;

constexpr int64_t kMiB = int64_t{1} << 20;

// cache_stats() is process-wide; these tests look at differences around their own tensors.
TEST(CachingAllocator, FreedMemoryServesTheNextRequests) {
  mem::install_caching_allocator();
  ASSERT_TRUE(mem::caching_installed());
  void* first = nullptr;
  {
    at::Tensor t = at::empty({3 * kMiB / 4}, at::kFloat);  // 3 MiB: a 20 MiB segment
    first = t.data_ptr();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 64, 0u);
  }
  const auto before = mem::cache_stats();
  EXPECT_GE(before.cached_bytes, 20 * kMiB);
  {
    // The same bytes in another shape and dtype: the same memory, no malloc.
    at::Tensor t = at::empty({3 * kMiB / 8}, at::kDouble);
    EXPECT_EQ(t.data_ptr(), first);
    // Other sizes are cut from the same segment while it has room: still no malloc.
    at::Tensor u = at::empty({kMiB + 1000}, at::kFloat);
    at::Tensor v = at::empty({kMiB / 2}, at::kFloat);
    const auto after = mem::cache_stats();
    EXPECT_EQ(after.hits, before.hits + 3);
    EXPECT_EQ(after.misses, before.misses);
    EXPECT_EQ(after.reserved_bytes, before.reserved_bytes);
    EXPECT_EQ(after.segments, before.segments);
    EXPECT_EQ(after.cached_bytes, before.cached_bytes - 3 * kMiB - (4 * kMiB + 4096) - 2 * kMiB);
    // Small requests (up to 1 MiB) never split the large segments: they have their own pool.
    at::Tensor w = at::empty({1000}, at::kFloat);
    const auto* p = static_cast<const std::byte*>(w.data_ptr());
    const auto* lo = static_cast<const std::byte*>(first);
    EXPECT_TRUE(p < lo || p >= lo + 20 * kMiB);
  }
  // Everything freed merges back: the segment is one free block again, reused whole.
  {
    at::Tensor t = at::empty({5 * kMiB}, at::kFloat);  // 20 MiB: the whole segment
    EXPECT_EQ(t.data_ptr(), first);
  }
  // Zero-byte storages own nothing and are not counted.
  const auto s0 = mem::cache_stats();
  at::Tensor empty = at::empty({0}, at::kFloat);
  EXPECT_EQ(mem::cache_stats().hits + mem::cache_stats().misses, s0.hits + s0.misses);
}

// A new segment that would take the bytes held past peak live * (1 + slack) + min_slack first
// gives back the segments with nothing alive in them; disabling gives back the rest.
TEST(CachingAllocator, BytesHeldStayUnderTheLimit) {
  mem::CachingOptions o;
  o.slack = 0.0;
  o.min_slack_bytes = 0;
  mem::install_caching_allocator(o);
  const auto start = mem::cache_stats();
  // 30 sizes from 12 to 70 MiB (each a segment of its own size), each freed before the next:
  // without a limit the cache would hold 1,230 MiB.
  for (int i = 0; i < 30; ++i) {
    at::Tensor t = at::empty({(12 + 2 * i) * kMiB / 4}, at::kFloat);
    t.fill_(1.0f);
    const auto s = mem::cache_stats();
    ASSERT_LE(s.reserved_bytes, s.peak_live_bytes + 2 * kMiB) << "at size " << i;
  }
  const auto end = mem::cache_stats();
  EXPECT_EQ(end.misses - start.misses, 30);
  EXPECT_EQ(end.released_segments - start.released_segments, 29);
  EXPECT_EQ(end.cached_bytes, 70 * kMiB);
  // empty_cache() gives back every segment with nothing alive in it.
  mem::empty_cache();
  EXPECT_EQ(mem::cache_stats().cached_bytes, 0);
  // Disabled: requests go to malloc, and a segment goes back once its last block dies.
  at::Tensor held = at::empty({1000}, at::kFloat);
  o.enabled = false;
  mem::set_caching_options(o);
  const auto off = mem::cache_stats();
  { at::Tensor t = at::empty({kMiB}, at::kFloat); }
  EXPECT_EQ(mem::cache_stats().hits + mem::cache_stats().misses, off.hits + off.misses);
  EXPECT_EQ(mem::cache_stats().cached_bytes, off.cached_bytes);
  held = at::Tensor();
  EXPECT_EQ(mem::cache_stats().reserved_bytes, 0);
  EXPECT_EQ(mem::cache_stats().segments, 0);
  o.enabled = true;
  mem::set_caching_options(o);
  { at::Tensor t = at::empty({kMiB}, at::kFloat); }
  EXPECT_EQ(mem::cache_stats().cached_bytes, 20 * kMiB);
}

// The tracking allocator installed on top counts the bytes requested, not the cache's rounding
// or its free blocks.
TEST(CachingAllocator, TheTrackerOnTopCountsRequestedBytes) {
  mem::install_caching_allocator();
  mem::install_tracking_allocator();
  const int64_t before = mem::current_bytes();
  {
    at::Tensor t = at::empty({1001}, at::kFloat);  // 4,004 bytes, a 4,096-byte block
    EXPECT_EQ(mem::current_bytes() - before, 4004);
  }
  EXPECT_EQ(mem::current_bytes(), before);
  EXPECT_GE(mem::cache_stats().cached_bytes, 4096);
}

// Under an installed tracker the cache would go uncounted: refused, and nothing changes.
TEST(CachingAllocator, InstallingItUnderTheTrackerIsRefused) {
  mem::install_tracking_allocator();
  EXPECT_THROW(mem::install_caching_allocator(), c10::Error);
  EXPECT_FALSE(mem::caching_installed());
  EXPECT_TRUE(mem::tracking_installed());
}

// LibTorch's raw_allocate users (oneDNN scratchpads) get simple pointers that free correctly.
TEST(CachingAllocator, RawAllocateAndDeallocate) {
  mem::install_caching_allocator();
  c10::Allocator* a = c10::GetAllocator(c10::DeviceType::CPU);
  void* p = a->raw_allocate(1000);
  ASSERT_NE(p, nullptr);
  std::memset(p, 7, 1000);
  a->raw_deallocate(p);
  void* q = a->raw_allocate(1000);
  EXPECT_EQ(q, p);
  a->raw_deallocate(q);
  // With the cache off the memory comes from c10's allocator, and goes back to it.
  mem::CachingOptions off;
  off.enabled = false;
  mem::set_caching_options(off);
  void* r = a->raw_allocate(1000);
  std::memset(r, 7, 1000);
  a->raw_deallocate(r);
}

// Threads allocating and freeing at once (autograd, Gloo's lanes and the main thread do): each
// block is owned by one tensor at a time (the pattern written survives), and the counts add up.
TEST(CachingAllocator, ThreadsShareItSafely) {
  mem::install_caching_allocator();
  const auto start = mem::cache_stats();
  ASSERT_EQ(start.reserved_bytes, start.cached_bytes) << "something of ours is alive already";
  std::vector<std::thread> threads;
  std::atomic<int> corrupted{0};
  for (int w = 0; w < 4; ++w) {
    threads.emplace_back([w, &corrupted] {
      std::mt19937 rng(w);
      std::vector<at::Tensor> held;
      for (int i = 0; i < 3000; ++i) {
        // Mostly small (their pool), every 7th 1-3 MiB (split from the 20 MiB segments).
        const int64_t n = i % 7 == 0 ? (1 << 18) + static_cast<int64_t>(rng() % 8) * 65536
                                     : 16 + static_cast<int64_t>(rng() % 8) * 1000;
        at::Tensor t = at::empty({n}, at::kInt);
        t.fill_(w * 100000 + i);
        held.push_back(t);
        if (held.size() > 8) {
          const auto& old = held.front();
          if (!old.eq(old[0]).all().item<bool>())
            corrupted++;
          held.erase(held.begin());
        }
      }
    });
  }
  for (auto& t : threads)
    t.join();
  EXPECT_EQ(corrupted.load(), 0);
  const auto end = mem::cache_stats();
  // At most 9 tensors held per thread: nearly everything came from free blocks.
  EXPECT_GT(end.hits - start.hits, 20 * (end.misses - start.misses));
  EXPECT_EQ(end.reserved_bytes, end.cached_bytes);
  // Every block merged back into whole free segments, which empty_cache() gives back.
  mem::empty_cache();
  EXPECT_EQ(mem::cache_stats().reserved_bytes, 0);
  EXPECT_EQ(mem::cache_stats().segments, 0);
}

// What the cache is for: a training loop's second step onwards allocates every tensor from the
// cache (no malloc), and the results are those of the loop without it (at::empty never
// promised zeroed memory, and nothing here depends on it).
TEST(CachingAllocator, ATrainingLoopStopsCallingMallocAfterItsFirstSteps) {
  mem::install_caching_allocator();
  torch::set_num_threads(1);
  auto run = [](int steps, std::vector<int64_t>* misses) {
    torch::manual_seed(0);
    torch::nn::Sequential model(torch::nn::Linear(64, 256), torch::nn::GELU(),
                                torch::nn::Linear(256, 64));
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
    std::vector<float> losses;
    for (int s = 0; s < steps; ++s) {
      const at::Tensor x = torch::randn({32, 64});
      opt.zero_grad();
      const at::Tensor loss = (model->forward(x) - x).pow(2).mean();
      loss.backward();
      opt.step();
      losses.push_back(loss.item<float>());
      if (misses)
        misses->push_back(mem::cache_stats().misses);
    }
    return losses;
  };
  std::vector<int64_t> misses;
  const auto cached = run(8, &misses);
  EXPECT_EQ(misses[7], misses[2]) << "steps 4-8 still went to malloc";
  mem::CachingOptions off;
  off.enabled = false;
  mem::set_caching_options(off);
  const auto plain = run(8, nullptr);
  ASSERT_EQ(cached.size(), plain.size());
  for (size_t i = 0; i < plain.size(); ++i)
    EXPECT_EQ(cached[i], plain[i]) << "step " << i + 1;
}

}  // namespace
