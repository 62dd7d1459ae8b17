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
TEST(CachingAllocator, AFreedBlockServesTheNextRequestOfItsSize) {
  mem::install_caching_allocator();
  ASSERT_TRUE(mem::caching_installed());
  void* first = nullptr;
  {
    at::Tensor t = at::empty({kMiB / 4}, at::kFloat);
    first = t.data_ptr();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 64, 0u);
  }
  const auto before = mem::cache_stats();
  EXPECT_GE(before.cached_bytes, kMiB);
  {
    // Same byte size, other shape and dtype: the same block.
    at::Tensor t = at::empty({kMiB / 8}, at::kDouble);
    EXPECT_EQ(t.data_ptr(), first);
    const auto after = mem::cache_stats();
    EXPECT_EQ(after.hits, before.hits + 1);
    EXPECT_EQ(after.misses, before.misses);
    EXPECT_EQ(after.cached_bytes, before.cached_bytes - kMiB);
    EXPECT_EQ(after.reserved_bytes, before.reserved_bytes);
    // A size the cache does not hold goes to malloc.
    at::Tensor u = at::empty({kMiB / 4 + 1000}, at::kFloat);
    EXPECT_NE(u.data_ptr(), first);
    EXPECT_EQ(mem::cache_stats().misses, before.misses + 1);
  }
  // Zero-byte storages own nothing and are not counted.
  const auto s0 = mem::cache_stats();
  at::Tensor empty = at::empty({0}, at::kFloat);
  EXPECT_EQ(mem::cache_stats().hits + mem::cache_stats().misses, s0.hits + s0.misses);
}

// A request that would take the bytes held past peak live * (1 + slack) + min_slack releases the
// oldest cached blocks first, so sizes that never come back do not pile up.
TEST(CachingAllocator, BytesHeldStayUnderTheLimit) {
  mem::CachingOptions o;
  o.slack = 0.0;
  o.min_slack_bytes = 2 * kMiB;
  mem::install_caching_allocator(o);
  const auto start = mem::cache_stats();
  // 200 distinct sizes around 1 MiB, each freed before the next: 200 MiB requested in all.
  for (int i = 0; i < 200; ++i) {
    at::Tensor t = at::empty({kMiB / 4 + 64 * i}, at::kFloat);
    t.fill_(1.0f);
    const auto s = mem::cache_stats();
    ASSERT_LE(s.reserved_bytes, s.peak_live_bytes + o.min_slack_bytes) << "at size " << i;
  }
  const auto end = mem::cache_stats();
  EXPECT_EQ(end.misses - start.misses, 200);
  EXPECT_GE(end.released_blocks - start.released_blocks, 190);
  EXPECT_LE(end.cached_bytes, o.min_slack_bytes + kMiB + 200 * 64);
  // empty_cache() gives all of it back; disabling does too and keeps nothing afterwards.
  mem::empty_cache();
  EXPECT_EQ(mem::cache_stats().cached_bytes, 0);
  EXPECT_EQ(mem::cache_stats().cached_blocks, 0);
  o.enabled = false;
  mem::set_caching_options(o);
  { at::Tensor t = at::empty({kMiB}, at::kFloat); }
  EXPECT_EQ(mem::cache_stats().cached_bytes, 0);
  o.enabled = true;
  mem::set_caching_options(o);
  { at::Tensor t = at::empty({kMiB}, at::kFloat); }
  EXPECT_EQ(mem::cache_stats().cached_bytes, 4 * kMiB);
}

// The tracking allocator installed on top counts the bytes requested, not the cache's rounding
// or its free blocks.
TEST(CachingAllocator, TheTrackerOnTopCountsRequestedBytes) {
  mem::install_caching_allocator();
  mem::install_tracking_allocator();
  const int64_t before = mem::current_bytes();
  {
    at::Tensor t = at::empty({1001}, at::kFloat);  // 4,004 bytes, a 4,032-byte block
    EXPECT_EQ(mem::current_bytes() - before, 4004);
  }
  EXPECT_EQ(mem::current_bytes(), before);
  EXPECT_GE(mem::cache_stats().cached_bytes, 4032);
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
}

// Threads allocating and freeing at once (autograd, Gloo's lanes and the main thread do): each
// block is owned by one tensor at a time (the pattern written survives), and the counts add up.
TEST(CachingAllocator, ThreadsShareItSafely) {
  mem::install_caching_allocator();
  const auto start = mem::cache_stats();
  std::vector<std::thread> threads;
  std::atomic<int> corrupted{0};
  for (int w = 0; w < 4; ++w) {
    threads.emplace_back([w, &corrupted] {
      std::mt19937 rng(w);
      std::vector<at::Tensor> held;
      for (int i = 0; i < 3000; ++i) {
        const int64_t n = 16 + static_cast<int64_t>(rng() % 8) * 1000;
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
  // 8 sizes per thread and at most 9 tensors each held: nearly everything came from the cache.
  EXPECT_GT(end.hits - start.hits, 20 * (end.misses - start.misses));
  EXPECT_EQ(end.reserved_bytes - end.cached_bytes, start.reserved_bytes - start.cached_bytes);
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
