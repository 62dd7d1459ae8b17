// The collectives layer against hand-computed results, on 3 ranks (sizes that 3 does not
// divide, mixed dtypes), and its byte accounting.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>

#include "collectives.h"
#include "harness/multiprocess.h"

namespace {

using fsdp::detail::ReduceOp;

// Rank r's piece i: a value that identifies both.
torch::Tensor piece(int rank, int i, int64_t n, torch::ScalarType dtype) {
  return (torch::arange(n, torch::kFloat) + 1000 * rank + 100 * i).to(dtype);
}

FSDP_WORKER(collectives_all_gather) {
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), n = pg->size();
  // Three pieces of different dtypes and sizes: all move as bytes in one collective.
  std::vector<int64_t> sizes{5, 7, 1};
  std::vector<torch::ScalarType> dtypes{torch::kFloat, torch::kDouble, torch::kBFloat16};
  std::vector<torch::Tensor> inputs, outputs;
  for (int i = 0; i < 3; ++i) {
    inputs.push_back(piece(rank, i, sizes[i], dtypes[i]));
    outputs.push_back(torch::full({n * sizes[i]}, -1, dtypes[i]));
  }
  fsdp::detail::all_gather(*pg, inputs, outputs)->wait();
  for (int i = 0; i < 3; ++i) {
    for (int r = 0; r < n; ++r) {
      auto got = outputs[i].narrow(0, r * sizes[i], sizes[i]);
      WORKER_CHECK(torch::equal(got, piece(r, i, sizes[i], dtypes[i])))
          << "piece " << i << " from rank " << r << ": " << got;
    }
  }
  const auto& s = pg->comm_stats().all_gather;
  const int64_t in_bytes = 5 * 4 + 7 * 8 + 1 * 2;
  WORKER_CHECK(s.calls == 1 && s.bytes == n * in_bytes && s.sent_bytes == (n - 1) * in_bytes)
      << s.calls << " " << s.bytes << " " << s.sent_bytes;
  std::printf("[rank %d] ALL-GATHER OK: 3 dtypes, %lld bytes in, one collective\n", rank,
              static_cast<long long>(in_bytes));
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
  fsdp::detail::reduce_scatter(*pg, input_of(rank), out, ReduceOp::kSum)->wait();
  WORKER_EXPECT_CLOSE(out, expect_sum, 1e-6, 1e-6);
  fsdp::detail::reduce_scatter(*pg, input_of(rank), out, ReduceOp::kAvg)->wait();
  WORKER_EXPECT_CLOSE(out, expect_sum / n, 1e-6, 1e-6);

  const auto& st = pg->comm_stats().reduce_scatter;
  WORKER_CHECK(st.calls == 2 && st.bytes == 2 * n * s * 4 && st.sent_bytes == 2 * (n - 1) * s * 4)
      << st.calls << " " << st.bytes << " " << st.sent_bytes;

  auto t = torch::full({4}, static_cast<float>(rank + 1));
  fsdp::detail::all_reduce(*pg, t, ReduceOp::kAvg)->wait();
  WORKER_EXPECT_CLOSE(t, torch::full({4}, (n + 1) / 2.0f), 1e-6, 1e-6);
  auto b = torch::full({3}, static_cast<float>(rank == 1 ? 42 : rank));
  fsdp::detail::broadcast(*pg, b, /*root=*/1)->wait();
  WORKER_CHECK(torch::equal(b, torch::full({3}, 42.0f))) << b;
  std::printf("[rank %d] REDUCE-SCATTER OK (sum and avg), sent %lld bytes for %lld in\n", rank,
              static_cast<long long>(st.sent_bytes), static_cast<long long>(st.bytes));
  return 0;
}

TEST(Collectives, AllGatherMixedDtypesThreeRanks) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("collectives_all_gather", 3));
}

TEST(Collectives, ReduceScatterAllReduceBroadcastThreeRanks) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("collectives_reduce_scatter", 3));
}

}  // namespace
