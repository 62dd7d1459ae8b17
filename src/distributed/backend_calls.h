// c10d::Backend's single-tensor collectives under the names each torch version has.
//
// torch 2.15 renamed _allgather_base, _reduce_scatter_base and alltoall_base to
// all_gather_single, reduce_scatter_single and all_to_all_single (the torchcomms names), keeping
// the old names as deprecated aliases; torch 2.11 has only the old ones. A GPU user's PyTorch is
// whichever they installed, so each call asks the compiler which name exists (a
// requires-expression on the backend type) instead of trusting a version number: a torch between
// the two, or a later one that drops the aliases, builds too. (Templates, so that the name a
// torch lacks is only looked up, never an error.)
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <vector>

namespace fsdp::detail {

template <typename B>
c10::intrusive_ptr<c10d::Work> all_gather_single(B& backend, at::Tensor& out, at::Tensor& in) {
  if constexpr (requires { backend.all_gather_single(out, in); })
    return backend.all_gather_single(out, in);
  else
    return backend._allgather_base(out, in);
}

template <typename B>
c10::intrusive_ptr<c10d::Work> reduce_scatter_single(B& backend, at::Tensor& out, at::Tensor& in,
                                                     const c10d::ReduceScatterOptions& opts) {
  if constexpr (requires { backend.reduce_scatter_single(out, in, opts); })
    return backend.reduce_scatter_single(out, in, opts);
  else
    return backend._reduce_scatter_base(out, in, opts);
}

/// Equal splits (empty split lists): each rank's block of `in` goes to that rank.
template <typename B>
c10::intrusive_ptr<c10d::Work> all_to_all_single(B& backend, at::Tensor& out, at::Tensor& in) {
  std::vector<int64_t> equal_splits;
  if constexpr (requires { backend.all_to_all_single(out, in, equal_splits, equal_splits); })
    return backend.all_to_all_single(out, in, equal_splits, equal_splits);
  else
    return backend.alltoall_base(out, in, equal_splits, equal_splits);
}

}  // namespace fsdp::detail
