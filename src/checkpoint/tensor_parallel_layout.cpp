// See include/fsdp/checkpoint/tensor_parallel_layout.h.
#include <fsdp/checkpoint/tensor_parallel_layout.h>

#include <c10/util/Exception.h>

#include <algorithm>

namespace fsdp {

std::vector<int64_t> whole_shape(const TensorPart* part, const std::vector<int64_t>& shape,
                                 const std::string& name) {
  if (!part)
    return shape;
  const std::string what = "the tensor-parallel part of '" + name + "'";
  TORCH_CHECK(part->dim == 0 || part->dim == 1, what, ": dim ", part->dim,
              " (0 or 1 can be split)");
  TORCH_CHECK(static_cast<int64_t>(shape.size()) > part->dim, what, ": dim ", part->dim,
              " of a tensor of ", shape.size(), " dimensions");
  TORCH_CHECK(part->dim == 0 || part->ranges.size() == 1, what,
              ": a split by columns has one range");
  int64_t size = 0;
  for (const auto& [begin, n] : part->ranges) {
    TORCH_CHECK(begin >= 0 && n >= 0 && begin + n <= part->whole, what, ": range (", begin, ", ", n,
                ") outside the whole's ", part->whole);
    size += n;
  }
  const auto dim = static_cast<size_t>(part->dim);
  TORCH_CHECK(size == shape[dim], what, ": its ranges hold ", size, " of dim ", part->dim,
              ", the tensor has ", shape[dim]);
  auto whole = shape;
  whole[dim] = part->whole;
  return whole;
}

std::vector<WholeBlock> whole_blocks(const TensorPart* part, const std::vector<int64_t>& shape,
                                     int64_t row_begin, int64_t rows, const std::string& name) {
  const auto whole = whole_shape(part, shape, name);
  const int64_t cols = whole.size() < 2 ? 1 : whole[1];
  std::vector<WholeBlock> out;
  if (rows <= 0)
    return out;
  if (!part) {
    out.push_back({0, row_begin, rows, 0, cols});
    return out;
  }
  if (part->dim == 1) {
    const auto [begin, n] = part->ranges[0];
    if (n > 0)
      out.push_back({0, row_begin, rows, begin, n});
    return out;
  }
  int64_t offset = 0;  // the rank's row where this range starts
  for (const auto& [begin, n] : part->ranges) {
    const int64_t lo = std::max(offset, row_begin);
    const int64_t hi = std::min(offset + n, row_begin + rows);
    if (lo < hi)
      out.push_back({lo - row_begin, begin + lo - offset, hi - lo, 0, cols});
    offset += n;
  }
  return out;
}

}  // namespace fsdp
