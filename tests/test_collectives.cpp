// The collectives layer against hand-computed results, on 3 ranks (sizes that 3 does not
// divide, mixed dtypes), and its byte accounting.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>

#include <fsdp/distributed/collectives.h>
#include "harness/multiprocess.h"

namespace {

using fsdp::ReduceOp;

// Rank r's piece i: a value that identifies both.
torch::Tensor piece(int rank, int i, int64_t n, torch::ScalarType dtype) {
  return (torch::arange(n, torch::kFloat) + 1000 * rank + 100 * i).to(dtype);
}

FSDP_WORKER(collectives_all_gather) {
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), n = pg->size();
  // Three pieces of different dtypes and sizes: all move as bytes in one collective. Buckets
  // of 0 (one call), a few bytes (cuts inside elements and inside pieces) and more than the
  // whole must all land the same bytes in the same places.
  std::vector<int64_t> sizes{5, 7, 1};
  std::vector<torch::ScalarType> dtypes{torch::kFloat, torch::kDouble, torch::kBFloat16};
  const int64_t in_bytes = 5 * 4 + 7 * 8 + 1 * 2;
  for (int64_t bucket :
       {int64_t{0}, int64_t{5} * n, int64_t{24} * n, in_bytes * n, int64_t{1} << 20}) {
    pg->comm_stats().reset();
    std::vector<torch::Tensor> inputs, outputs;
    for (int i = 0; i < 3; ++i) {
      inputs.push_back(piece(rank, i, sizes[i], dtypes[i]));
      outputs.push_back(torch::full({n * sizes[i]}, -1, dtypes[i]));
    }
    fsdp::all_gather(*pg, inputs, outputs, bucket)->wait();
    for (int i = 0; i < 3; ++i) {
      for (int r = 0; r < n; ++r) {
        auto got = outputs[i].narrow(0, r * sizes[i], sizes[i]);
        WORKER_CHECK(torch::equal(got, piece(r, i, sizes[i], dtypes[i])))
            << "bucket " << bucket << ": piece " << i << " from rank " << r << ": " << got;
      }
    }
    const auto& s = pg->comm_stats().all_gather;
    WORKER_CHECK(s.calls == 1 && s.bytes == n * in_bytes && s.sent_bytes == (n - 1) * in_bytes)
        << "bucket " << bucket << ": " << s.calls << " " << s.bytes << " " << s.sent_bytes;
  }
  std::printf("[rank %d] ALL-GATHER OK: 3 dtypes, %lld bytes in, one collective, 5 bucketings\n",
              rank, static_cast<long long>(in_bytes));
  return 0;
}

// Gloo stages an all-gather call in flat buffers of its own: (1 + 1/N) x the call's output.
// Buckets must bound that transient to a few buckets, whatever the unit's size.
FSDP_WORKER(collectives_all_gather_bucket_memory) {
  fsdp::memory::install_tracking_allocator();
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), n = pg->size();
  const int64_t shard_numel = (int64_t{4} << 20) / 4 / n;  // a 4 MiB fp32 unit in 3 pieces
  std::vector<torch::Tensor> inputs, outputs;
  for (int i = 0; i < 3; ++i) {
    const int64_t len = i == 2 ? shard_numel - 2 * (shard_numel / 3) : shard_numel / 3;
    inputs.push_back(piece(rank, i, len, torch::kFloat));
    outputs.push_back(torch::empty({n * len}));
  }
  const int64_t unit = n * shard_numel * 4, bucket = unit / 16;
  auto transient = [&](int64_t bucket_bytes) {
    fsdp::memory::PeakScope scope;
    fsdp::all_gather(*pg, inputs, outputs, bucket_bytes)->wait();
    return scope.peak_above_baseline();
  };
  transient(0), transient(bucket);  // warm up the transport
  const int64_t whole = transient(0), bucketed = transient(bucket);
  for (int i = 0; i < 3; ++i) {
    const int64_t len = inputs[i].numel();
    for (int r = 0; r < n; ++r)
      WORKER_CHECK(
          torch::equal(outputs[i].narrow(0, r * len, len), piece(r, i, len, torch::kFloat)));
  }
  // One call: Gloo's flat output (the unit) and flat input (1/N of it).
  WORKER_CHECK(whole >= unit) << "one call staged " << whole << " B of a " << unit << " B unit";
  // Buckets: one bucket per lane (2) in flight, each staging (1 + 1/N) buckets, plus one
  // finishing: at most 4 buckets, a quarter of the unit.
  WORKER_CHECK(bucketed <= 4 * bucket)
      << "buckets of " << bucket << " B staged " << bucketed << " B at once";
  std::printf(
      "[rank %d] BUCKET MEMORY OK: %lld B unit, staged %.2fx unit in one call, %.2fx in "
      "%lld-byte buckets\n",
      rank, static_cast<long long>(unit), double(whole) / unit, double(bucketed) / unit,
      static_cast<long long>(bucket));
  return 0;
}

FSDP_WORKER(collectives_reduce_scatter) {
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), n = pg->size();
  const int64_t s = 11;
  auto input_of = [&](int r) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(77 + r);
    return torch::randn({n * s}, gen);
  };
  torch::Tensor expect_sum = torch::zeros({s});
  for (int r = 0; r < n; ++r)
    expect_sum += input_of(r).narrow(0, rank * s, s);

  auto out = torch::empty({s});
  fsdp::reduce_scatter(*pg, input_of(rank), out, ReduceOp::kSum)->wait();
  WORKER_EXPECT_CLOSE(out, expect_sum, 1e-6, 1e-6);
  fsdp::reduce_scatter(*pg, input_of(rank), out, ReduceOp::kAvg)->wait();
  WORKER_EXPECT_CLOSE(out, expect_sum / n, 1e-6, 1e-6);

  const auto& st = pg->comm_stats().reduce_scatter;
  WORKER_CHECK(st.calls == 2 && st.bytes == 2 * n * s * 4 && st.sent_bytes == 2 * (n - 1) * s * 4)
      << st.calls << " " << st.bytes << " " << st.sent_bytes;

  auto t = torch::full({4}, static_cast<float>(rank + 1));
  fsdp::all_reduce(*pg, t, ReduceOp::kAvg)->wait();
  WORKER_EXPECT_CLOSE(t, torch::full({4}, (n + 1) / 2.0f), 1e-6, 1e-6);
  auto b = torch::full({3}, static_cast<float>(rank == 1 ? 42 : rank));
  fsdp::broadcast(*pg, b, /*root=*/1)->wait();
  WORKER_CHECK(torch::equal(b, torch::full({3}, 42.0f))) << b;
  std::printf("[rank %d] REDUCE-SCATTER OK (sum and avg), sent %lld bytes for %lld in\n", rank,
              static_cast<long long>(st.sent_bytes), static_cast<long long>(st.bytes));
  return 0;
}

TEST(Collectives, AllGatherMixedDtypesThreeRanks) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("collectives_all_gather", 3));
}

// Many gathers queued at once, several calls each, spread over the group's Gloo lanes: every
// byte must land where it belongs. On one Gloo context with two worker threads this pattern
// corrupted the heap (ProcessGroupOptions::gloo_lanes); lanes of one thread each must not.
FSDP_WORKER(collectives_queued_gathers) {
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), n = pg->size();
  std::vector<torch::Tensor> inputs;
  for (int i = 0; i < 5; ++i)
    inputs.push_back(piece(rank, i, 3000 + i, torch::kFloat));
  constexpr int kQueued = 6, kRounds = 20;
  const int64_t bucket = 16 << 10;
  for (int round = 0; round < kRounds; ++round) {
    std::vector<std::vector<torch::Tensor>> outs(kQueued);
    std::vector<std::unique_ptr<fsdp::CollectiveWork>> works;
    for (int k = 0; k < kQueued; ++k) {
      for (const auto& in : inputs)
        outs[k].push_back(torch::full({n * in.numel()}, -1.0f));
      works.push_back(fsdp::all_gather(*pg, inputs, outs[k], bucket));
    }
    for (int k = 0; k < kQueued; ++k) {
      works[k]->wait();
      for (int i = 0; i < 5; ++i) {
        const int64_t len = inputs[i].numel();
        for (int r = 0; r < n; ++r) {
          WORKER_CHECK(
              torch::equal(outs[k][i].narrow(0, r * len, len), piece(r, i, len, torch::kFloat)))
              << "round " << round << ", gather " << k << ", piece " << i << " from rank " << r;
        }
      }
    }
  }
  std::printf("[rank %d] QUEUED GATHERS OK: %d rounds of %d gathers in flight on %d lanes\n", rank,
              kRounds, kQueued, pg->num_lanes());
  return 0;
}

TEST(Collectives, QueuedBucketedGathersOnLanes) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("collectives_queued_gathers", 3));
}

TEST(Collectives, BucketedAllGatherBoundsGlooStaging) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("collectives_all_gather_bucket_memory", 3));
}

TEST(Collectives, ReduceScatterAllReduceBroadcastThreeRanks) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("collectives_reduce_scatter", 3));
}

}  // namespace
