// Where a tensor-parallel rank's parameters sit in the whole model: what a checkpoint needs to
// store them as whole tensors, so that a model saved on one (dp, tp) mesh loads on another.
//
// With tensor parallelism each rank of a tp group holds a part of some parameters (a
// column-parallel Linear: some output rows; a row-parallel one: some input columns; a split
// vocabulary: some words) and the others whole. fully_shard then shards each rank's tensor over
// its dp group as it shards any parameter. fsdp::param_shards() describes the second split only;
// this describes the first. models/tensor_parallel.h returns it for the models it splits; the
// sharded checkpoint and the models' deferred initialisation map a rank's rows to the whole
// tensor's with whole_blocks(), the one place that does.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {

/// A rank's part of one parameter: along `dim` (0 or 1), the whole tensor's indices
/// [begin, begin + size) of each range, concatenated in order, are this rank's tensor. `whole`
/// is the whole tensor's size along `dim`. A split along dim 1 has one range.
struct TensorPart {
  int64_t dim = 0;
  int64_t whole = 0;
  std::vector<std::pair<int64_t, int64_t>> ranges;  // (begin, size)
};

/// A model split over a tensor-parallel group, as one rank holds it.
struct TensorParallelLayout {
  /// The split parameters by name (named_parameters() of the model given to the checkpoint);
  /// every other parameter is whole, and the same, on every rank of the group.
  std::map<std::string, TensorPart> parts;
  /// Whether this rank writes the parameters that are whole on every rank of its tp group: the
  /// group's first rank does, the others would write the same values again.
  bool writes_whole = true;
};

/// A block of a rank's tensor in the whole one: `rows` rows from the rank's row `at` are the
/// whole tensor's rows [row, row + rows) and columns [col, col + cols) (all of them unless the
/// tensor is split by columns; [0, 1) for a tensor of under two dimensions).
struct WholeBlock {
  int64_t at, row, rows, col, cols;
};

/// The whole tensor's shape, for a rank's tensor of `shape` and its part (nullptr: whole).
/// Throws c10::Error, naming `name`, for a part that does not fit the shape.
std::vector<int64_t> whole_shape(const TensorPart* part, const std::vector<int64_t>& shape,
                                 const std::string& name);

/// Where rows [row_begin, row_begin + rows) of a rank's tensor of `shape` (a 0-d tensor: one
/// row) lie in the whole tensor: one block, or for a split by rows one per range they meet;
/// none for no rows. `part` nullptr: the tensor is whole. Checked as whole_shape().
std::vector<WholeBlock> whole_blocks(const TensorPart* part, const std::vector<int64_t>& shape,
                                     int64_t row_begin, int64_t rows, const std::string& name);

}  // namespace fsdp
