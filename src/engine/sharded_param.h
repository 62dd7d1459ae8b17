// One parameter's life under FSDP: sharded at rest, unsharded around compute.
//
// Note [FSDP tensors] (the vocabulary used everywhere in src/):
//  - param: the module's own parameter tensor. Its TensorImpl never changes identity, so the
//    module, model->parameters() and the optimizer all hold the same object; set_data() swaps
//    what it points at: the sharded view at rest, the unsharded tensor around compute.
//  - padded shard: this rank's rows of dim 0, in a buffer of ceil(d0 / N) rows; rows past
//    the parameter's end are padding and never reach the math.
//  - sharded view: the first local_rows rows of the padded shard. What the optimizer updates.
//  - unsharded: the full parameter, a view of the first d0 rows of a padded buffer of
//    N * ceil(d0 / N) rows, in the compute dtype (MixedPrecisionPolicy::param_dtype, else the
//    shard's dtype). Its StorageImpl lives as long as the parameter; only its bytes are
//    freed and re-allocated, so tensors that autograd saved in forward (views of the param)
//    see the re-gathered data in backward. Writing into it never bumps the param's version
//    counter, because set_data() keeps the param's own counter.
//  - sharded grad: the grad of the sharded view, accumulated across backward passes.
//
// Dim-0 sharding (as FSDP2), not a flat parameter (as FSDP1): see docs/design.md.
#pragma once

#include <torch/types.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <string>

#include <fsdp/detail/param_layout.h>
#include <fsdp/mixed_precision.h>

#include "gather_codec.h"

namespace fsdp::detail {

class ShardedParam {
 public:
  /// Takes over `param` (full data on every rank): keeps this rank's rows, frees the rest.
  /// With `init`, the shard is computed by init instead and `param`'s data is never read.
  /// `mp`: a floating-point parameter is computed with in mp.param_dtype() (when set) and
  /// gathered in mp.gather_format() (see GatherCodec).
  /// `offload`: the shard and its gradient live on the host, the unsharded parameter on
  /// `param`'s device (CPUOffloadPolicy); `pin_memory`: pinned host memory when that device is
  /// a GPU.
  ShardedParam(std::string fqn, torch::Tensor param, int rank, int world_size,
               const std::function<void(const torch::Tensor&, const torch::Tensor&, int64_t)>&
                   init = nullptr,
               const MixedPrecisionPolicy& mp = {}, bool offload = false, bool pin_memory = false);

  const std::string& fqn() const { return fqn_; }
  const torch::Tensor& param() const { return param_; }
  bool requires_grad() const { return param_.requires_grad(); }
  /// The shard's (master) dtype, and the dtype the unsharded parameter is computed in.
  torch::ScalarType dtype() const { return padded_shard_.scalar_type(); }
  torch::ScalarType compute_dtype() const { return padded_unsharded_.scalar_type(); }
  /// Gathered in another dtype than the shard's.
  bool casts() const { return compute_dtype() != dtype(); }
  /// Where the unit computes (the unsharded parameter, the collectives' buffers); the shard
  /// is there too unless offloaded to the host.
  torch::Device compute_device() const { return padded_unsharded_.device(); }
  bool offloaded() const { return offload_; }

  const ParamLayout& layout() const { return layout_; }
  int64_t rows() const { return layout_.rows; }                        // d0 (1 for a 0-d parameter)
  const std::vector<int64_t>& shape() const { return layout_.shape; }  // the unsharded shape
  /// First global row of this rank's shard (clamped to rows() when it holds none).
  int64_t row_begin() const { return std::min(rank_ * layout_.chunk_rows, layout_.rows); }
  /// The shard's real rows (the param's data at rest; a view of the padded shard).
  const torch::Tensor& sharded_view() const { return sharded_view_; }
  int64_t chunk_rows() const { return layout_.chunk_rows; }  // ceil(d0 / N)
  int64_t local_rows() const { return layout_.local_rows; }  // this rank's real rows
  int64_t row_numel() const { return layout_.row_numel; }    // elements per row
  int64_t padded_shard_numel() const { return layout_.chunk_rows * layout_.row_numel; }
  int64_t numel() const { return layout_.rows * layout_.row_numel; }

  const torch::Tensor& padded_shard() const { return padded_shard_; }
  /// All-gather input: the padded shard (contiguous); encoded in the gather format, or cast to
  /// the compute dtype when they differ, or (offloaded) copied to the compute device: then a
  /// new tensor, which the caller keeps alive until the gather completes.
  torch::Tensor gather_input() const;
  /// All-gather output: with a gather format, a wire buffer of N encoded pieces (allocated
  /// here, freed by free_gather_output() or free_unsharded()); else padded_unsharded().
  torch::Tensor gather_output();
  /// The gather landed: decodes the wire buffer (if any) into padded_unsharded().
  void decode_gather();
  /// Frees the wire buffer (UnitBuffer::kGatherInFlight, fsdp/detail/buffer_lifetimes.h).
  void free_gather_output() { wire_output_ = torch::Tensor(); }
  /// The padded unsharded buffer, N * padded_shard_numel elements in the compute dtype. Only
  /// valid between alloc_unsharded() and free_unsharded(). With a world of one rank and
  /// neither cast nor gather format it IS the padded shard (nothing to gather, nothing to
  /// free); otherwise fill_unsharded_locally() takes the gather's place (the cast, or the
  /// format's round trip, so that the math does not depend on the number of ranks).
  const torch::Tensor& padded_unsharded() const { return padded_unsharded_; }
  void fill_unsharded_locally();
  /// Bytes of the unsharded buffer (allocated or not).
  int64_t unsharded_nbytes() const {
    return padded_unsharded_.numel() * padded_unsharded_.element_size();
  }

  void alloc_unsharded();
  void free_unsharded();
  bool unsharded_allocated() const { return unsharded_storage_bytes() > 0; }
  size_t unsharded_storage_bytes() const;

  /// Points the param at the unsharded tensor (requires alloc_unsharded()).
  void to_unsharded();
  /// Points the param at its sharded view.
  void to_sharded();

  // Gradients through one backward pass (see ParamGroup): stash_sharded_grad() at the unit's
  // first pre-backward; then either take_unsharded_grad() + copy_grad_into() (a reduction,
  // whose result add_to_stash() adds later) or take_unsharded_grad() + hold_pass_grad()
  // (no-sync accumulation); at the end of a good pass restore_stash() + commit_pass(), of a
  // failed one restore_stash() + abort_pass(). Nothing of a pass is final before commit_pass:
  // a failed pass leaves the grads as they were before it.

  /// Moves the param's sharded grad aside so that autograd can accumulate the unsharded grad.
  void stash_sharded_grad();
  /// The unsharded grad autograd produced since stash_sharded_grad(), or undefined; the
  /// param's grad is cleared.
  torch::Tensor take_unsharded_grad();
  /// Copies the unsharded grad `g`, plus (add_kept) the grad kept by earlier no-sync passes,
  /// into `dst`, a [N, chunk_rows, row_numel]-shaped view of the reduce-scatter input, padding
  /// rows zeroed (zeros where there is none). Returns whether there was any gradient.
  bool copy_grad_into(const torch::Tensor& g, const torch::Tensor& dst, bool add_kept) const;
  /// Gradient accumulation without communication: holds this pass's unsharded grad until the
  /// pass commits, when it joins the local full-size accumulator (held until a syncing pass
  /// sends it).
  void hold_pass_grad(torch::Tensor g);
  /// Adds a reduced shard grad (`shard`: padded_shard_numel elements, any floating dtype) to
  /// the stashed grad, in the shard's dtype.
  void add_to_stash(const torch::Tensor& shard);
  /// Makes the stashed grad the param's grad again (undefined if there was none).
  void restore_stash();
  /// The pass succeeded: its held grad joins the accumulator. `drop_kept`: the pass's
  /// reduction sent the accumulator, which starts again from nothing.
  void commit_pass(bool drop_kept);
  /// The pass failed: its held grad is dropped; the accumulator is as before the pass.
  void abort_pass() { pass_grad_ = torch::Tensor(); }

  /// Reshard after forward to a smaller group: keeps block `index` of `blocks` equal row
  /// blocks of the padded unsharded buffer (requires it gathered), so that an all-gather
  /// over the `blocks` ranks of this rank's block rebuilds it. blocks divides the world size.
  void keep_block_shard(int blocks, int index);
  /// The kept block (contiguous), or undefined.
  const torch::Tensor& block_shard() const { return block_shard_; }
  void drop_block_shard() { block_shard_ = torch::Tensor(); }

  /// This rank's rows of a full tensor shaped like the parameter.
  torch::Tensor shard_of(const torch::Tensor& full) const;

 private:
  std::string fqn_;
  torch::Tensor param_;
  int rank_;
  int world_size_;
  ParamLayout layout_;    // what is allocated, as the planner predicts it
  bool offload_ = false;  // shard and grad on the host (CPUOffloadPolicy)
  bool pin_memory_ = false;
  torch::Tensor padded_shard_;        // [chunk_rows, *rest]
  torch::Tensor sharded_view_;        // [local_rows, *rest], view of padded_shard_
  torch::Tensor padded_unsharded_;    // [N * chunk_rows, *rest]
  torch::Tensor unsharded_;           // original shape, view of padded_unsharded_
  std::optional<GatherCodec> codec_;  // the gather's wire format, if not the compute dtype
  torch::Tensor wire_output_;         // encoded pieces of an all-gather in flight
  torch::Tensor stashed_grad_;
  torch::Tensor kept_grad_;    // unsharded, accumulated across non-syncing backwards
  torch::Tensor pass_grad_;    // unsharded, this no-sync pass's, until it commits
  torch::Tensor block_shard_;  // reshard-after-forward to a smaller group
};

}  // namespace fsdp::detail
