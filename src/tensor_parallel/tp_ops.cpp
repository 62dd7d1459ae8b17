// See fsdp/tensor_parallel/tp_ops.h.
#include <fsdp/tensor_parallel/tp_ops.h>

#include <torch/autograd.h>

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include <fsdp/distributed/collectives.h>

#include "group_capsule.h"

namespace fsdp::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

torch::Tensor all_reduced(const torch::Tensor& x, ProcessGroup& group, const char* what) {
  auto y = x.contiguous().clone();
  all_reduce(group, y, ReduceOp::kSum, what)->wait();
  return y;
}

// The ranks' x (equal shapes) concatenated along `dim`: gathered rank-major as (n, ...x), then
// that leading axis moved next to `dim` and merged into it.
torch::Tensor gathered(const torch::Tensor& x, int64_t dim, ProcessGroup& group, const char* what) {
  const auto in = x.contiguous();
  auto sizes = in.sizes().vec();
  sizes.insert(sizes.begin(), group.size());
  auto out = at::empty(sizes, in.options());
  all_gather(group, {in}, {out}, /*bucket_bytes=*/0, what)->wait();
  auto merged = in.sizes().vec();
  merged[static_cast<size_t>(dim)] *= group.size();
  return out.movedim(0, dim).reshape(merged);
}

// x.size(dim) / the group's size: each rank's piece along `dim`.
int64_t piece_size(const torch::Tensor& x, int64_t dim, const ProcessGroup& group,
                   const char* what) {
  const int n = group.size();
  if (x.size(dim) % n != 0)
    throw std::invalid_argument(std::string(what) + ": dimension " + std::to_string(dim) +
                                " of size " + std::to_string(x.size(dim)) +
                                " is not a multiple of the group's " + std::to_string(n) +
                                " ranks");
  return x.size(dim) / n;
}

// x summed over the group, this rank's piece along `dim`: the pieces stacked rank-major.
torch::Tensor reduce_scattered(const torch::Tensor& x, int64_t dim, ProcessGroup& group,
                               const char* what) {
  const int n = group.size();
  piece_size(x, dim, group, what);
  const auto input = at::stack(x.chunk(n, dim), 0).contiguous();
  auto sizes = x.sizes().vec();
  sizes[static_cast<size_t>(dim)] /= n;
  auto out = at::empty(sizes, x.options());
  reduce_scatter(group, input.view(-1), out.view(-1), ReduceOp::kSum, what)->wait();
  return out;
}

// This rank's piece of x along `dim` (no communication).
torch::Tensor split_piece(const torch::Tensor& x, int64_t dim, ProcessGroup& group,
                          const char* what) {
  const int64_t each = piece_size(x, dim, group, what);
  return x.narrow(dim, group.rank() * each, each).contiguous();
}

int64_t checked_dim(const torch::Tensor& x, int64_t dim, const char* what) {
  const int64_t d = dim < 0 ? dim + x.dim() : dim;
  if (d < 0 || d >= x.dim())
    throw std::invalid_argument(std::string(what) + ": dimension " + std::to_string(dim) +
                                " out of range for a " + std::to_string(x.dim()) + "-d tensor");
  return d;
}

struct CopyToGroup : torch::autograd::Function<CopyToGroup> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               std::shared_ptr<ProcessGroup> group) {
    ctx->saved_data["group"] = detail::capsule(std::move(group));
    return x;  // (autograd makes it a view of x)
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& group = detail::group_of(ctx->saved_data["group"]);
    return {all_reduced(grads[0], group, "tp copy_to_group backward"), torch::Tensor()};
  }
};

struct ReduceFromGroup : torch::autograd::Function<ReduceFromGroup> {
  static torch::Tensor forward(AutogradContext*, const torch::Tensor& x,
                               std::shared_ptr<ProcessGroup> group) {
    return all_reduced(x, *group, "tp reduce_from_group");
  }
  static variable_list backward(AutogradContext*, variable_list grads) {
    return {grads[0], torch::Tensor()};
  }
};

// An operation along a dimension and its adjoint in backward: the all-gather and the
// reduce-scatter of sequence parallelism, and the split whose adjoint is the all-gather.
using DimOp = torch::Tensor (*)(const torch::Tensor&, int64_t, ProcessGroup&, const char*);
template <DimOp Forward, DimOp Backward>
struct AlongDim : torch::autograd::Function<AlongDim<Forward, Backward>> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t dim,
                               std::shared_ptr<ProcessGroup> group, const char* what) {
    auto y = Forward(x, dim, *group, what);
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["group"] = detail::capsule(std::move(group));
    ctx->saved_data["what"] = std::string(what) + " backward";
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& group = detail::group_of(ctx->saved_data["group"]);
    return {Backward(grads[0], ctx->saved_data["dim"].toInt(), group,
                     ctx->saved_data["what"].toStringRef().c_str()),
            torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};
using GatherFromGroup = AlongDim<gathered, reduce_scattered>;
using ReduceScatterToGroup = AlongDim<reduce_scattered, gathered>;
using SplitToGroup = AlongDim<split_piece, gathered>;

struct GatherLastDim : torch::autograd::Function<GatherLastDim> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               std::vector<int64_t> sizes, std::shared_ptr<ProcessGroup> group) {
    const int n = group->size(), rank = group->rank();
    int64_t widest = 0, first = 0;
    for (int r = 0; r < n; ++r) {
      widest = std::max(widest, sizes[static_cast<size_t>(r)]);
      if (r < rank)
        first += sizes[static_cast<size_t>(r)];
    }
    // Equal pieces on the wire: each rank's columns padded to the widest, then cut.
    auto padded = x;
    if (x.size(-1) < widest) {
      auto pad_sizes = x.sizes().vec();
      pad_sizes.back() = widest - x.size(-1);
      padded = at::cat({x, at::zeros(pad_sizes, x.options())}, -1);
    }
    auto whole = gathered(padded, x.dim() - 1, *group, "tp gather_last_dim");
    std::vector<torch::Tensor> pieces;
    for (int r = 0; r < n; ++r)
      pieces.push_back(whole.narrow(-1, r * widest, sizes[static_cast<size_t>(r)]));
    ctx->saved_data["first"] = first;
    ctx->saved_data["width"] = x.size(-1);
    return at::cat(pieces, -1);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0]
                .narrow(-1, ctx->saved_data["first"].toInt(), ctx->saved_data["width"].toInt())
                .contiguous(),
            torch::Tensor(), torch::Tensor()};
  }
};

void require_group(const std::shared_ptr<ProcessGroup>& group, const char* what) {
  if (!group)
    throw std::invalid_argument(std::string(what) + ": no group given");
}

}  // namespace

torch::Tensor copy_to_group(const torch::Tensor& x, const std::shared_ptr<ProcessGroup>& group) {
  require_group(group, "tp::copy_to_group");
  if (group->size() == 1)
    return x;
  return CopyToGroup::apply(x, group);
}

torch::Tensor reduce_from_group(const torch::Tensor& x,
                                const std::shared_ptr<ProcessGroup>& group) {
  require_group(group, "tp::reduce_from_group");
  if (group->size() == 1)
    return x;
  return ReduceFromGroup::apply(x, group);
}

torch::Tensor gather_from_group(const torch::Tensor& x, int64_t dim,
                                const std::shared_ptr<ProcessGroup>& group) {
  require_group(group, "tp::gather_from_group");
  const auto d = checked_dim(x, dim, "tp::gather_from_group");
  if (group->size() == 1)
    return x;
  return GatherFromGroup::apply(x, d, group, "tp gather_from_group");
}

torch::Tensor reduce_scatter_to_group(const torch::Tensor& x, int64_t dim,
                                      const std::shared_ptr<ProcessGroup>& group) {
  require_group(group, "tp::reduce_scatter_to_group");
  const auto d = checked_dim(x, dim, "tp::reduce_scatter_to_group");
  if (group->size() == 1)
    return x;
  return ReduceScatterToGroup::apply(x, d, group, "tp reduce_scatter_to_group");
}

torch::Tensor split_to_group(const torch::Tensor& x, int64_t dim,
                             const std::shared_ptr<ProcessGroup>& group) {
  require_group(group, "tp::split_to_group");
  const auto d = checked_dim(x, dim, "tp::split_to_group");
  if (group->size() == 1)
    return x;
  return SplitToGroup::apply(x, d, group, "tp split_to_group");
}

torch::Tensor gather_last_dim(const torch::Tensor& x, const std::vector<int64_t>& sizes,
                              const std::shared_ptr<ProcessGroup>& group) {
  require_group(group, "tp::gather_last_dim");
  if (static_cast<int>(sizes.size()) != group->size() ||
      sizes[static_cast<size_t>(group->rank())] != x.size(-1))
    throw std::invalid_argument(
        "tp::gather_last_dim: sizes must hold one width per rank, this "
        "rank's equal to x.size(-1)");
  if (group->size() == 1)
    return x;
  return GatherLastDim::apply(x, sizes, group);
}

}  // namespace fsdp::tp
