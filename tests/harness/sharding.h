// What a rank should hold under dim-0 sharding, computed independently of the library: tests
// compare a rank's shards with these rows of a single-process reference.
#pragma once

#include <torch/torch.h>

#include <algorithm>

#include <fsdp/state_dict.h>

namespace fsdp::test {

/// Rows [r * chunk, r * chunk + local) of a full tensor, chunk = ceil(d0 / world): what rank
/// `rank` should hold (a 0-d tensor counts as one row).
inline torch::Tensor expected_shard(const torch::Tensor& full, int rank, int world) {
  auto rows = full.dim() == 0 ? full.reshape({1}) : full;
  const int64_t d0 = rows.size(0);
  const int64_t chunk = (d0 + world - 1) / world;
  const int64_t start = std::min<int64_t>(rank * chunk, d0);
  const int64_t local = std::clamp<int64_t>(d0 - rank * chunk, 0, chunk);
  return rows.narrow(0, start, local);
}

/// The rows of a full (global) tensor that `s` says this rank holds (a 0-d tensor is one row).
inline torch::Tensor rows_held(const torch::Tensor& full, const fsdp::ParamShard& s) {
  return (full.dim() == 0 ? full.reshape({1}) : full).narrow(0, s.row_begin, s.rows);
}

}  // namespace fsdp::test
