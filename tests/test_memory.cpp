// The tracking allocator is the ground truth for every per-rank memory claim fsdp-cpp makes, so
// these tests pin it down exactly on allocations we control and only measure deltas around our
// own tensors, never LibTorch's internal bookkeeping.
#include <gtest/gtest.h>
#include <torch/types.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include <c10/core/CPUAllocator.h>
#include <fsdp/core/memory.h>

#include "harness/multiprocess.h"

namespace {

namespace mem = fsdp::memory;

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kFloatsPerMiB = kMiB / static_cast<int64_t>(sizeof(float));

// Made during static initialisation, before any test can install the tracker, so that freeing
// it later exercises the "allocated before install" path for real. ctest runs each test in its
// own process, so every process gets a fresh one. Kept small because multi-process tests
// re-execute this binary as their ranks.
constexpr int64_t kPreInstallFloats = 16 * 1024;
const bool g_installed_before_pre_install_tensor = mem::tracking_installed();
at::Tensor g_pre_install_tensor = at::ones({kPreInstallFloats}, at::kFloat);

class MemoryTest : public ::testing::Test {
 protected:
  void SetUp() override { mem::install_tracking_allocator(); }
};

TEST_F(MemoryTest, InstallTwiceIsNoOp) {
  ASSERT_TRUE(mem::tracking_installed());
  c10::Allocator* first = c10::GetAllocator(c10::DeviceType::CPU);
  const mem::Stats before = mem::stats();
  mem::install_tracking_allocator();
  mem::install_tracking_allocator();
  EXPECT_TRUE(mem::tracking_installed());
  EXPECT_EQ(c10::GetAllocator(c10::DeviceType::CPU), first);
  // Not wrapped twice: one tensor is still counted exactly once.
  {
    at::Tensor t = at::empty({kFloatsPerMiB}, at::kFloat);
    EXPECT_EQ(mem::current_bytes() - before.current_bytes, kMiB);
    EXPECT_EQ(mem::stats().num_allocations - before.num_allocations, 1);
  }
  EXPECT_EQ(mem::current_bytes(), before.current_bytes);
}

// Threads racing to install the tracker in a process where nothing installed it yet (a fresh
// one: this binary's fixture installs it in SetUp): exactly one wraps the allocator, and a
// tensor is counted once.
FSDP_WORKER(memory_concurrent_install) {
  WORKER_CHECK(!mem::tracking_installed()) << "installed before the race";
  c10::Allocator* original = c10::GetAllocator(c10::DeviceType::CPU);
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&] {
      while (!go.load())
        std::this_thread::yield();
      mem::install_tracking_allocator();
    });
  }
  go = true;
  for (auto& t : threads)
    t.join();
  WORKER_CHECK(mem::tracking_installed());
  WORKER_CHECK(c10::GetAllocator(c10::DeviceType::CPU) != original) << "not installed";
  const mem::Stats before = mem::stats();
  {
    at::Tensor t = at::empty({kFloatsPerMiB}, at::kFloat);
    WORKER_CHECK(mem::current_bytes() - before.current_bytes == kMiB)
        << mem::current_bytes() - before.current_bytes << " bytes counted for 1 MiB";
    WORKER_CHECK(mem::stats().num_allocations - before.num_allocations == 1)
        << "one tensor counted " << mem::stats().num_allocations - before.num_allocations
        << " times (wrapped more than once)";
  }
  WORKER_CHECK(mem::current_bytes() == before.current_bytes);
  return 0;
}

TEST(Memory, ConcurrentInstallInAFreshProcessWrapsOnce) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("memory_concurrent_install", 1));
}

TEST_F(MemoryTest, EmptyTensorOfOneMiBIsCountedExactly) {
  const mem::Stats before = mem::stats();
  at::Tensor t = at::empty({kFloatsPerMiB}, at::kFloat);
  const mem::Stats during = mem::stats();
  EXPECT_EQ(during.current_bytes - before.current_bytes, kMiB);
  EXPECT_EQ(during.num_allocations - before.num_allocations, 1);
  EXPECT_EQ(during.allocated_bytes_total - before.allocated_bytes_total, kMiB);
  EXPECT_GE(during.peak_bytes, during.current_bytes);
  t.reset();
  const mem::Stats after = mem::stats();
  EXPECT_EQ(after.current_bytes, before.current_bytes);
  // Cumulative counters do not go back down on free.
  EXPECT_EQ(after.num_allocations, during.num_allocations);
  EXPECT_EQ(after.allocated_bytes_total, during.allocated_bytes_total);
}

TEST_F(MemoryTest, TorchZerosIsCounted) {
  const int64_t base = mem::current_bytes();
  {
    torch::Tensor t = torch::zeros({kFloatsPerMiB}, torch::kFloat);
    EXPECT_EQ(mem::current_bytes() - base, kMiB);
    EXPECT_EQ(t.sum().item<float>(), 0.0F);
  }
  EXPECT_EQ(mem::current_bytes(), base);
}

TEST_F(MemoryTest, StorageAliasesAreCountedOnce) {
  const int64_t base = mem::current_bytes();
  at::Tensor t = at::empty({kFloatsPerMiB}, at::kFloat);
  at::Tensor view = t.view({2, kFloatsPerMiB / 2});
  at::Tensor slice = t.narrow(0, 0, 16);
  EXPECT_EQ(mem::current_bytes() - base, kMiB);
  t.reset();
  view.reset();
  // The slice keeps the whole storage alive.
  EXPECT_EQ(mem::current_bytes() - base, kMiB);
  slice.reset();
  EXPECT_EQ(mem::current_bytes(), base);
}

TEST_F(MemoryTest, ResizeIsCounted) {
  const int64_t base = mem::current_bytes();
  at::Tensor t = at::empty({0}, at::kFloat);
  EXPECT_EQ(mem::current_bytes(), base);
  t.resize_({kFloatsPerMiB});
  EXPECT_EQ(mem::current_bytes() - base, kMiB);
  // Growing reallocates: the old 1 MiB is freed, the new 2 MiB is live.
  t.resize_({2 * kFloatsPerMiB});
  EXPECT_EQ(mem::current_bytes() - base, 2 * kMiB);
  // Shrinking keeps the storage, as LibTorch's resize_ promises.
  t.resize_({16});
  EXPECT_EQ(mem::current_bytes() - base, 2 * kMiB);
  t.reset();
  EXPECT_EQ(mem::current_bytes(), base);
}

TEST_F(MemoryTest, StorageAllocatorGoesThroughTracker) {
  const int64_t base = mem::current_bytes();
  at::Tensor t = at::empty({kFloatsPerMiB}, at::kFloat);
  c10::Storage storage = t.storage();
  ASSERT_EQ(storage.allocator(), c10::GetAllocator(c10::DeviceType::CPU));

  // How FSDP frees and re-materialises an unsharded parameter in place.
  storage.set_data_ptr_noswap(storage.allocator()->allocate(0));
  storage.set_nbytes(0);
  EXPECT_EQ(mem::current_bytes(), base);
  storage.set_data_ptr_noswap(storage.allocator()->allocate(static_cast<size_t>(kMiB)));
  storage.set_nbytes(static_cast<size_t>(kMiB));
  EXPECT_EQ(mem::current_bytes() - base, kMiB);
  t.fill_(2.0F);
  EXPECT_EQ(t.sum().item<float>(), 2.0F * static_cast<float>(kFloatsPerMiB));

  // Allocator::clone (used by Storage copies) also allocates through the tracker.
  c10::DataPtr copy = storage.allocator()->clone(storage.data(), static_cast<size_t>(kMiB));
  EXPECT_EQ(mem::current_bytes() - base, 2 * kMiB);
  EXPECT_EQ(static_cast<const float*>(copy.get())[7], 2.0F);
  copy.clear();
  EXPECT_EQ(mem::current_bytes() - base, kMiB);

  storage = c10::Storage();
  t.reset();
  EXPECT_EQ(mem::current_bytes(), base);
}

TEST_F(MemoryTest, RawAllocateIsCountedAndRoundTrips) {
  // LibTorch uses the raw interface on the CPU allocator, which requires context == data.
  c10::Allocator* allocator = c10::GetAllocator(c10::DeviceType::CPU);
  ASSERT_NE(allocator->raw_deleter(), nullptr);
  const int64_t base = mem::current_bytes();
  void* p = allocator->raw_allocate(static_cast<size_t>(kMiB));
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(mem::current_bytes() - base, kMiB);
  allocator->raw_deallocate(p);
  EXPECT_EQ(mem::current_bytes(), base);
  // Zero bytes: no memory, nothing counted, and the deleter tolerates the nullptr.
  allocator->raw_deallocate(allocator->raw_allocate(0));
  EXPECT_EQ(mem::current_bytes(), base);
}

TEST_F(MemoryTest, OneDnnConvolutionWorksUnderTracking) {
  // mkldnn_convolution takes its scratchpad through raw_allocate; a tracker whose DataPtr
  // context is not the data pointer makes this throw.
  const int64_t base = mem::current_bytes();
  {
    at::Tensor input = at::randn({4, 3, 32, 32});
    at::Tensor weight = at::randn({16, 3, 3, 3});
    at::Tensor out = at::conv2d(input, weight);
    EXPECT_EQ(out.sizes(), (std::vector<int64_t>{4, 16, 30, 30}));
    EXPECT_GE(mem::current_bytes() - base, out.nbytes() + input.nbytes() + weight.nbytes());
  }
  EXPECT_EQ(mem::current_bytes(), base);
}

TEST_F(MemoryTest, LazyCloneSharesUntilWritten) {
  const int64_t base = mem::current_bytes();
  at::Tensor x = at::ones({kFloatsPerMiB}, at::kFloat);
  // Copy-on-write only accepts storages whose DataPtr is simple.
  at::Tensor y = at::_lazy_clone(x);
  EXPECT_EQ(mem::current_bytes() - base, kMiB);
  y.add_(1.0F);  // materialises a private copy
  EXPECT_EQ(mem::current_bytes() - base, 2 * kMiB);
  EXPECT_EQ(x[0].item<float>(), 1.0F);
  EXPECT_EQ(y[0].item<float>(), 2.0F);
  x.reset();
  EXPECT_EQ(mem::current_bytes() - base, kMiB);
  // The last reference to a copy-on-write buffer takes it over instead of copying.
  at::Tensor z = at::_lazy_clone(y);
  y.reset();
  z.add_(1.0F);
  EXPECT_EQ(mem::current_bytes() - base, kMiB);
  EXPECT_EQ(z[0].item<float>(), 3.0F);
  z.reset();
  EXPECT_EQ(mem::current_bytes(), base);
}

TEST_F(MemoryTest, PeakTracksTemporaryAndResets) {
  mem::reset_peak();
  const int64_t base = mem::current_bytes();
  EXPECT_EQ(mem::peak_bytes(), base);
  {
    at::Tensor tmp = at::empty({4 * kFloatsPerMiB}, at::kFloat);
    EXPECT_EQ(mem::current_bytes() - base, 4 * kMiB);
  }
  EXPECT_EQ(mem::current_bytes(), base);
  EXPECT_GE(mem::peak_bytes(), base + 4 * kMiB);
  EXPECT_EQ(mem::stats().peak_bytes, mem::peak_bytes());
  mem::reset_peak();
  EXPECT_EQ(mem::peak_bytes(), mem::current_bytes());
  EXPECT_LT(mem::peak_bytes(), base + 4 * kMiB);
}

TEST_F(MemoryTest, PeakScopeReportsBaselineAndPeak) {
  at::Tensor held = at::empty({kFloatsPerMiB}, at::kFloat);
  // A high-water mark from before the scope must not leak into it.
  { at::Tensor before_scope = at::empty({8 * kFloatsPerMiB}, at::kFloat); }

  mem::PeakScope scope;
  EXPECT_EQ(scope.baseline(), mem::current_bytes());
  EXPECT_EQ(scope.peak(), scope.baseline());
  EXPECT_EQ(scope.peak_above_baseline(), 0);
  { at::Tensor tmp = at::empty({4 * kFloatsPerMiB}, at::kFloat); }
  at::Tensor kept = at::empty({kFloatsPerMiB}, at::kFloat);
  EXPECT_GE(scope.peak_above_baseline(), 4 * kMiB);
  EXPECT_LT(scope.peak_above_baseline(), 8 * kMiB);
  EXPECT_EQ(scope.peak(), scope.baseline() + scope.peak_above_baseline());
  EXPECT_EQ(mem::current_bytes() - scope.baseline(), kMiB);
}

TEST_F(MemoryTest, NestedPeakScopeKeepsOuterHighWaterMark) {
  mem::PeakScope outer;
  { at::Tensor big = at::empty({4 * kFloatsPerMiB}, at::kFloat); }
  {
    mem::PeakScope inner;
    { at::Tensor small = at::empty({kFloatsPerMiB}, at::kFloat); }
    EXPECT_GE(inner.peak_above_baseline(), kMiB);
    EXPECT_LT(inner.peak_above_baseline(), 4 * kMiB);
  }
  EXPECT_GE(outer.peak_above_baseline(), 4 * kMiB);
}

TEST_F(MemoryTest, AllocationOnAnotherThreadIsCounted) {
  const int64_t base = mem::current_bytes();
  at::Tensor from_thread;
  std::thread producer([&] { from_thread = at::empty({kFloatsPerMiB}, at::kFloat); });
  producer.join();
  EXPECT_EQ(mem::current_bytes() - base, kMiB);

  // Freed on a different thread from the one that allocated.
  at::Tensor from_main = at::empty({2 * kFloatsPerMiB}, at::kFloat);
  EXPECT_EQ(mem::current_bytes() - base, 3 * kMiB);
  std::thread consumer([t = std::move(from_main)]() mutable { t.reset(); });
  consumer.join();
  EXPECT_EQ(mem::current_bytes() - base, kMiB);
  from_thread.reset();
  EXPECT_EQ(mem::current_bytes(), base);
}

TEST_F(MemoryTest, ConcurrentAllocationsBalance) {
  constexpr int kThreads = 4;
  constexpr int kIters = 200;
  constexpr int64_t kFloats = 1024;
  const mem::Stats before = mem::stats();
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&] {
      while (!go.load()) {
        std::this_thread::yield();
      }
      for (int k = 0; k < kIters; ++k) {
        at::Tensor t = at::empty({kFloats}, at::kFloat);
      }
    });
  }
  go.store(true);
  for (auto& t : threads) {
    t.join();
  }
  const mem::Stats after = mem::stats();
  EXPECT_EQ(after.current_bytes, before.current_bytes);
  EXPECT_EQ(after.num_allocations - before.num_allocations, int64_t{kThreads} * kIters);
  EXPECT_EQ(after.allocated_bytes_total - before.allocated_bytes_total,
            int64_t{kThreads} * kIters * kFloats * static_cast<int64_t>(sizeof(float)));
}

TEST_F(MemoryTest, PreInstallTensorFreesWithoutTouchingCounters) {
  if (g_installed_before_pre_install_tensor) {
    GTEST_SKIP() << "another static initialiser installed the tracker first";
  }
  if (!g_pre_install_tensor.defined()) {
    GTEST_SKIP() << "the pre-install tensor was already freed by an earlier --gtest_repeat round";
  }
  const int64_t base = mem::current_bytes();
  // Its storage remembers the allocator it came from, so even growing it stays untracked.
  EXPECT_NE(g_pre_install_tensor.storage().allocator(), c10::GetAllocator(c10::DeviceType::CPU));
  g_pre_install_tensor.resize_({2 * kPreInstallFloats});
  EXPECT_EQ(mem::current_bytes(), base);
  g_pre_install_tensor.reset();
  EXPECT_EQ(mem::current_bytes(), base);
}

TEST_F(MemoryTest, DefaultAllocatorDataPtrIsNotCounted) {
  // Same situation as a pre-install allocation, made deterministic: memory from the allocator
  // the tracker wraps carries that allocator's deleter, not ours.
  const int64_t base = mem::current_bytes();
  c10::DataPtr raw = c10::GetDefaultCPUAllocator()->allocate(static_cast<size_t>(kMiB));
  EXPECT_EQ(mem::current_bytes(), base);
  raw.clear();
  EXPECT_EQ(mem::current_bytes(), base);
}

TEST_F(MemoryTest, CategoriesTagRetagAndSumToThePeak) {
  using fsdp::memory::Category;
  const auto before = fsdp::memory::current_by_category();
  fsdp::memory::reset_peak();
  torch::Tensor a, b;
  {
    fsdp::memory::CategoryScope outer(Category::kActivations);
    a = torch::empty({1 << 18});  // 1 MiB
    {
      fsdp::memory::CategoryScope inner(Category::kOptimizer);
      b = torch::empty({1 << 17});  // 512 KiB
    }
  }
  auto now = fsdp::memory::current_by_category();
  EXPECT_EQ(now[Category::kActivations] - before[Category::kActivations], 1 << 20);
  EXPECT_EQ(now[Category::kOptimizer] - before[Category::kOptimizer], 1 << 19);
  // The breakdown at the peak sums to the peak.
  EXPECT_EQ(fsdp::memory::at_peak_by_category().total(), fsdp::memory::peak_bytes());
  EXPECT_TRUE(fsdp::memory::retag(a.storage().data(), Category::kGrads));
  now = fsdp::memory::current_by_category();
  EXPECT_EQ(now[Category::kActivations], before[Category::kActivations]);
  EXPECT_EQ(now[Category::kGrads] - before[Category::kGrads], 1 << 20);
  EXPECT_GE(fsdp::memory::peak_by_category()[Category::kActivations],
            before[Category::kActivations] + (1 << 20));
  a = torch::Tensor();
  EXPECT_EQ(fsdp::memory::current_by_category()[Category::kGrads], before[Category::kGrads]);
  int local = 0;
  EXPECT_FALSE(fsdp::memory::retag(&local, Category::kGrads));
}

TEST(MemoryFormat, FormatBytes) {
  EXPECT_EQ(mem::format_bytes(0), "0 B");
  EXPECT_EQ(mem::format_bytes(512), "512 B");
  EXPECT_EQ(mem::format_bytes(1023), "1023 B");
  EXPECT_EQ(mem::format_bytes(1024), "1.00 KiB");
  EXPECT_EQ(mem::format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(mem::format_bytes(kMiB + kMiB / 2), "1.50 MiB");
  EXPECT_EQ(mem::format_bytes(kMiB - 1), "1.00 MiB");
  EXPECT_EQ(mem::format_bytes(int64_t{3} << 30), "3.00 GiB");
  EXPECT_EQ(mem::format_bytes(int64_t{5} << 40), "5.00 TiB");
  EXPECT_EQ(mem::format_bytes(-2 * kMiB), "-2.00 MiB");
  EXPECT_EQ(mem::format_bytes(-100), "-100 B");
  EXPECT_EQ(mem::format_bytes(INT64_MIN), "-8192.00 PiB");
}

}  // namespace
