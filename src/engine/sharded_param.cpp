// See sharded_param.h, Note [FSDP tensors].
#include "sharded_param.h"

#include <fsdp/core/memory.h>

#include <ATen/Context.h>

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

namespace fsdp::detail {
namespace {

// A tensor over the same memory as `v` that autograd does not consider a view: optimizers
// call grad.detach_() in zero_grad(), which autograd refuses on views. Holding the storage
// keeps the shared buffer (the reduce-scatter output) alive as long as any grad uses it.
torch::Tensor alias_as_base(const torch::Tensor& v) {
  c10::Storage storage = v.storage();
  return torch::from_blob(
      v.data_ptr(), v.sizes(), v.strides(), [storage](void*) {}, v.options());
}

// Autograd caches a parameter's AccumulateGrad node, with the parameter's shape at creation.
// A node made while the parameter was sharded (say, by a clone() under grad mode between
// steps) would reject the full-shape grads of the next backward, and vice versa; dropping the
// cache at every swap makes the next use create a node of the current shape. Graphs already
// built keep their own node.
void forget_grad_accumulator(const torch::Tensor& p) {
  if (auto* meta = torch::autograd::impl::get_autograd_meta(p)) {
    std::lock_guard<std::mutex> lock(meta->mutex_);
    meta->grad_accumulator_.reset();
  }
}

// Gradients of gathered parameters are allocated by autograd (the backward of the op that used
// the parameter) while the caller's memory tag is in force; once one becomes a .grad it is
// counted as a gradient.
struct TagGradAsGradient : torch::autograd::PostAccumulateGradHook {
  void operator()(const torch::autograd::Variable& param) override {
    const auto& g = param.grad();
    if (g.defined() && g.has_storage())
      memory::retag(g.storage().data(), memory::Category::kGrads);
  }
};

}  // namespace

ShardedParam::ShardedParam(
    std::string fqn, torch::Tensor param, int rank, int world_size,
    const std::function<void(const torch::Tensor&, const torch::Tensor&, int64_t)>& init,
    const MixedPrecisionPolicy& mp, bool offload, bool pin_memory)
    : fqn_(std::move(fqn)),
      param_(std::move(param)),
      rank_(rank),
      world_size_(world_size),
      offload_(offload),
      pin_memory_(offload && pin_memory && !param_.device().is_cpu() && at::hasCUDA()) {
  TORCH_CHECK(param_.layout() == torch::kStrided, "fully_shard: parameter '", fqn_,
              "' is not a dense tensor");
  torch::NoGradGuard no_grad;
  if (param_.requires_grad() && !torch::autograd::impl::post_acc_grad_hooks(param_))
    torch::autograd::impl::set_post_acc_grad_hooks(param_, std::make_unique<TagGradAsGradient>());
  auto full = param_.detach();
  // What this rank holds and allocates: the layout the planner predicts from too.
  layout_ = param_layout(full.sizes().vec(), full.scalar_type(), rank_, world_size_, mp, offload_);

  std::vector<int64_t> row_shape = full.dim() == 0 ? std::vector<int64_t>{} : layout_.shape;
  if (!row_shape.empty())
    row_shape.erase(row_shape.begin());
  std::vector<int64_t> shard_shape{layout_.chunk_rows};
  shard_shape.insert(shard_shape.end(), row_shape.begin(), row_shape.end());
  std::vector<int64_t> padded_full_shape{layout_.chunk_rows * world_size_};
  padded_full_shape.insert(padded_full_shape.end(), row_shape.begin(), row_shape.end());

  // Offloaded: the shard lives on the host whatever the parameter's device.
  padded_shard_ = torch::zeros(
      shard_shape,
      offload_ ? full.options().device(torch::kCPU).pinned_memory(pin_memory_) : full.options());
  sharded_view_ = padded_shard_.narrow(0, 0, layout_.local_rows);
  if (init) {
    // Deferred initialisation: `full` may be a placeholder; only this rank's rows are made.
    init(param_, sharded_view_, std::min(rank_ * layout_.chunk_rows, layout_.rows));
  } else if (layout_.local_rows > 0) {
    auto rows_view = full.dim() == 0 ? full.reshape({1}) : full;  // copy_ crosses devices
    sharded_view_.copy_(rows_view.narrow(0, rank_ * layout_.chunk_rows, layout_.local_rows)
                            .reshape(sharded_view_.sizes()));
  }

  const auto dtype = full.scalar_type();
  const auto unsharded_dtype = layout_.unsharded_dtype;
  codec_ = GatherCodec::make(mp, dtype, unsharded_dtype, layout_.row_numel);
  if (!layout_.owns_unsharded) {
    // Unsharded (kNoShard, or a group of one) in its own dtype: the shard is the parameter;
    // no second copy.
    padded_unsharded_ = padded_shard_;
  } else {
    padded_unsharded_ = torch::empty(padded_full_shape, full.options().dtype(unsharded_dtype));
  }
  unsharded_ = padded_unsharded_.narrow(0, 0, layout_.rows).view(layout_.shape);
  free_unsharded();
  to_sharded();
}

size_t ShardedParam::unsharded_storage_bytes() const {
  return padded_unsharded_.storage().nbytes();
}

torch::Tensor ShardedParam::gather_input() const {
  torch::NoGradGuard no_grad;
  torch::Tensor shard = padded_shard_;
  if (offload_) {
    // Host to device before the gather (also on a CPU "device": one code path, tested here).
    // From pinned memory the copy is asynchronous on the current stream, which the
    // collective's stream waits for; the caller keeps the staged copy until the gather is done.
    memory::CategoryScope gathered(memory::Category::kGathered);
    auto staged =
        torch::empty(padded_shard_.sizes(),
                     padded_shard_.options().device(compute_device()).pinned_memory(false));
    staged.copy_(padded_shard_, /*non_blocking=*/pin_memory_);
    shard = staged;
  }
  if (codec_)
    return codec_->encode(shard);
  if (!casts())
    return shard;
  return shard.to(compute_dtype());
}

torch::Tensor ShardedParam::gather_output() {
  if (!codec_)
    return padded_unsharded_;
  wire_output_ = torch::empty({world_size_ * codec_->wire_numel(layout_.chunk_rows)},
                              padded_unsharded_.options().dtype(codec_->wire_dtype()));
  return wire_output_;
}

void ShardedParam::decode_gather() {
  if (wire_output_.defined())
    codec_->decode(wire_output_, padded_unsharded_, world_size_);
}

void ShardedParam::fill_unsharded_locally() {
  if (!layout_.owns_unsharded)
    return;
  TORCH_INTERNAL_ASSERT(world_size_ == 1);
  torch::NoGradGuard no_grad;
  if (codec_)
    codec_->decode(gather_input(), padded_unsharded_, 1);  // encoded (and staged) as a gather
  else
    padded_unsharded_.copy_(padded_shard_);
}

void ShardedParam::alloc_unsharded() {
  if (!layout_.owns_unsharded)
    return;
  auto storage = padded_unsharded_.storage();
  const size_t nbytes = padded_unsharded_.numel() * padded_unsharded_.element_size();
  if (storage.nbytes() == nbytes)
    return;
  // Same StorageImpl, new bytes: every view made in forward sees what the next gather writes.
  storage.set_data_ptr_noswap(storage.allocator()->allocate(nbytes));
  storage.set_nbytes(nbytes);
}

void ShardedParam::free_unsharded() {
  wire_output_ = torch::Tensor();
  if (!layout_.owns_unsharded)
    return;
  auto storage = padded_unsharded_.storage();
  storage.set_data_ptr_noswap(at::DataPtr(nullptr, padded_unsharded_.device()));
  storage.set_nbytes(0);
}

void ShardedParam::to_unsharded() {
  TORCH_INTERNAL_ASSERT(unsharded_allocated() || padded_unsharded_.numel() == 0, "param '", fqn_,
                        "' used before its gather");
  param_.set_data(unsharded_);
  forget_grad_accumulator(param_);
}

void ShardedParam::to_sharded() {
  param_.set_data(sharded_view_);
  forget_grad_accumulator(param_);
}

void ShardedParam::stash_sharded_grad() {
  stashed_grad_ = torch::Tensor();
  if (!param_.requires_grad())
    return;
  if (param_.grad().defined() && param_.grad().sizes() == sharded_view_.sizes()) {
    stashed_grad_ = param_.grad();
    param_.mutable_grad() = torch::Tensor();
  }
}

torch::Tensor ShardedParam::take_unsharded_grad() {
  if (!param_.requires_grad())
    return {};
  auto g = param_.grad();
  if (g.defined()) {
    TORCH_CHECK(g.sizes() == unsharded_.sizes(), "fsdp: parameter '", fqn_,
                "' has a gradient of shape ", g.sizes(), " during backward, expected ",
                unsharded_.sizes(), " (was it used outside its unit's fsdp::forward?)");
    param_.mutable_grad() = torch::Tensor();
  }
  return g;
}

void ShardedParam::hold_pass_grad(torch::Tensor g) {
  if (!g.defined())
    return;
  // Own the memory: autograd may hand us a buffer it could reuse. Accumulated in the master
  // dtype, so that many low-precision micro-batches do not lose their small contributions.
  if (g.scalar_type() != dtype())
    g = g.to(dtype());
  if (!g.is_contiguous())
    g = g.contiguous();
  pass_grad_ = pass_grad_.defined() ? pass_grad_.add_(g) : std::move(g);
}

void ShardedParam::commit_pass(bool drop_kept) {
  if (drop_kept)
    kept_grad_ = torch::Tensor();
  if (pass_grad_.defined()) {
    kept_grad_ = kept_grad_.defined() ? kept_grad_.add_(pass_grad_) : pass_grad_;
    pass_grad_ = torch::Tensor();
  }
}

bool ShardedParam::copy_grad_into(const torch::Tensor& g, const torch::Tensor& dst,
                                  bool add_kept) const {
  // dst: [N, chunk_rows, row_numel]. Rank r's block gets rows [r * chunk, (r + 1) * chunk).
  const torch::Tensor kept = add_kept ? kept_grad_ : torch::Tensor();
  if (!g.defined() && !kept.defined()) {
    dst.zero_();
    return false;
  }
  auto rows = (g.defined() ? g : kept).reshape({layout_.rows, layout_.row_numel});
  auto kept_rows = g.defined() && kept.defined() ? kept.reshape({layout_.rows, layout_.row_numel})
                                                 : at::Tensor();
  for (int r = 0; r < world_size_; ++r) {
    const int64_t start = r * layout_.chunk_rows;
    const int64_t n = std::clamp<int64_t>(layout_.rows - start, 0, layout_.chunk_rows);
    auto block = dst.select(0, r);
    if (n > 0) {
      block.narrow(0, 0, n).copy_(rows.narrow(0, start, n));
      if (kept_rows.defined())
        block.narrow(0, 0, n).add_(kept_rows.narrow(0, start, n));
    }
    if (n < layout_.chunk_rows)
      block.narrow(0, n, layout_.chunk_rows - n).zero_();
  }
  return true;
}

void ShardedParam::add_to_stash(const torch::Tensor& shard) {
  auto g = shard.view(padded_shard_.sizes()).narrow(0, 0, layout_.local_rows);
  if (offload_ && g.is_cpu() && !compute_device().is_cpu()) {
    // The reduction's output was copied to the host on a stream of its own while backward
    // went on (PendingReduce::start_host_copy), and the caller waited for that copy: the grad
    // is a view of that copy.
    g = g.scalar_type() == dtype() ? alias_as_base(g) : g.to(dtype());
  } else if (offload_) {
    // Device to host, synchronously: the gradient joins its shard where the optimizer steps.
    memory::CategoryScope grads(memory::Category::kGrads);
    auto host = torch::empty(g.sizes(), padded_shard_.options().pinned_memory(pin_memory_));
    host.copy_(g);
    g = host;
  } else {
    g = g.scalar_type() == dtype() ? alias_as_base(g) : g.to(dtype());
  }
  if (stashed_grad_.defined()) {
    stashed_grad_.add_(g);
  } else {
    stashed_grad_ = g;
  }
}

void ShardedParam::restore_stash() {
  if (!param_.requires_grad())
    return;  // never stashed: a frozen parameter's grad is not ours to touch
  param_.mutable_grad() = std::move(stashed_grad_);
  stashed_grad_ = torch::Tensor();
}

void ShardedParam::keep_block_shard(int blocks, int index) {
  TORCH_INTERNAL_ASSERT(world_size_ % blocks == 0);
  torch::NoGradGuard no_grad;
  const int64_t block_rows = layout_.block_rows(blocks);
  block_shard_ = padded_unsharded_.narrow(0, index * block_rows, block_rows).clone();
}

torch::Tensor ShardedParam::shard_of(const torch::Tensor& full) const {
  auto rows = full.dim() == 0 ? full.reshape({1}) : full;
  return rows.narrow(0, std::min(rank_ * layout_.chunk_rows, layout_.rows), layout_.local_rows);
}

}  // namespace fsdp::detail
