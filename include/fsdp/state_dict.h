// What each rank holds of a sharded model's parameters, by name: the ground a checkpoint
// stands on. A checkpoint stores, per parameter, rows [row_begin, row_begin + shard.size(0))
// of the global tensor from every rank that is the first holder of those rows; loading on
// another number of ranks (or under another strategy) reads, for each parameter, the global
// rows this rank's shard covers, wherever they were saved.
//
//   for (auto& p : fsdp::param_shards(*model))
//     writer.write_rows(p.name, p.row_begin, p.shard);   // when p.writer
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <string>
#include <vector>

namespace fsdp {

struct ParamShard {
  /// The parameter's name in the model (named_parameters()).
  std::string name;
  /// This rank's real rows: the parameter itself at rest (dim-0 rows [row_begin, row_begin +
  /// rows) of the global tensor, no padding). Writing into it under a NoGradGuard changes the
  /// model. A 0-d parameter is one row: shape [1] where it is held, [0] on the other ranks.
  torch::Tensor shard;
  /// The unsharded (global) shape.
  std::vector<int64_t> global_shape;
  /// First global dim-0 row of `shard` (clamped to the row count on ranks holding none).
  int64_t row_begin = 0;
  /// Rows of `shard` (0 on ranks whose shard is only padding).
  int64_t rows = 0;
  /// This rank is the first of the ranks holding these rows (replicas under kNoShard or
  /// kHybridShard; every rank for a parameter outside any unit, where rank 0 of the units'
  /// group is the first): the one that saves them.
  bool writer = true;
};

/// Every parameter of `model` (recursively, named_parameters() order) as this rank holds it.
/// Units must be at rest (not gathered by fsdp::unshard or a forward in progress).
std::vector<ParamShard> param_shards(torch::nn::Module& model);

}  // namespace fsdp
