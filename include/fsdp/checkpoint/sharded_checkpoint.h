// Sharded checkpoints: every rank writes its own rows, any number of ranks reads them back.
//
// A checkpoint is a directory:
//   rank-00000.safetensors ...  one per rank that holds rows to write: the rows of every
//                               parameter ("model/<name>") and optimizer state tensor
//                               ("optim/<name>/exp_avg", ...) it is the first holder of;
//   index.json                  every tensor's global shape and dtype, which rows live in which
//                               file, an xxh3 checksum per block of rows, the optimizer's kind
//                               and per-parameter step counts, and the caller's metadata.
// save_sharded writes into "<dir>.tmp", fsyncs every file, and renames it to <dir> only once
// every rank has finished: a crash leaves the previous checkpoint and a .tmp directory that
// load_sharded never reads. load_sharded reads, for each tensor, only the blocks of rows this
// rank's shard covers (pread), verifies their checksums, and copies them into the shards: a
// checkpoint saved on N ranks loads on M, under any strategy. Files from outside are validated
// before anything is trusted (safetensors headers, the index's every field); a corrupted or
// truncated file is refused with an error naming the file and the tensor.
//
// With tensor parallelism (a TensorParallelLayout given), every tensor is still stored whole: a
// piece is then a block of rows and, for a parameter split by columns, of columns, and a
// checkpoint saved on a (dp, tp) mesh loads on any other, or on one process.
//
// The directory must be on a file system every rank sees (one node, or a shared one).
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <fsdp/checkpoint/tensor_parallel_layout.h>

namespace fsdp {

class ProcessGroup;
namespace safetensors {
class Image;
}

/// Saves `model`'s parameters and, if given, `optimizer`'s state (torch::optim::AdamW, Adam or
/// SGD) as this rank holds them. Collective over `group` (every rank calls it with the same
/// dir). `metadata` (e.g. the training step) is stored in the index; load_sharded returns it.
/// Throws if `dir` exists (checkpoints are never overwritten in place). With tensor
/// parallelism, `group` spans both axes (the world) and `tp` is this rank's layout.
void save_sharded(const std::string& dir, torch::nn::Module& model,
                  torch::optim::Optimizer* optimizer, ProcessGroup& group,
                  const std::map<std::string, std::string>& metadata = {},
                  const TensorParallelLayout& tp = {});

/// What an asynchronous save did: its directory, this rank's bytes, how long start() held the
/// caller (the snapshot) and how long the whole save took until this rank's writer was done
/// (rank 0: the commit included).
struct AsyncSaveResult {
  std::string dir;
  int64_t bytes = 0;
  double stall_seconds = 0;
  double seconds = 0;
};

/// save_sharded that lets training go on while the files are written. start() does what needs
/// the ranks together, on the calling thread: the refusal of an existing directory and a copy of
/// every row this rank writes into its file's image in host memory (safetensors::Image: the
/// model's and the optimizer's shards once more). A thread of each rank then writes the image
/// (O_DIRECT where it can, with no further copy), fsyncs it, computes its checksums and leaves
/// its part of the index in the group's store as it counts itself written (fsdp::StoreLatch, no
/// collective); rank 0's, once every rank's file is durable, builds the index, writes it last
/// and renames <dir>.tmp into place, as save_sharded does. So the files are save_sharded's, byte
/// for byte, and a crash before the commit leaves the previous checkpoint the latest complete
/// one. At most one save is in flight: start() waits for the previous one first. The image is
/// kept for the next save of the same tensors (from the first save on, a rank holds its model
/// states once more; a fresh image's first touch of its pages stalled the step 0.15-0.2 s
/// more on our machines, for a 124M-parameter model on 2 ranks).
class AsyncCheckpointer {
 public:
  explicit AsyncCheckpointer(std::shared_ptr<ProcessGroup> group);
  /// Waits for the save in flight (an error is printed, not thrown).
  ~AsyncCheckpointer();
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  /// Collective over the group, like save_sharded; returns once the snapshot is taken.
  /// `after_commit`, if given, runs on rank 0's writer thread once the checkpoint is committed
  /// (tidying that should not hold training up, e.g. removing older checkpoints); what it
  /// throws is what wait() throws.
  void start(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer* optimizer,
             const std::map<std::string, std::string>& metadata = {},
             const TensorParallelLayout& tp = {}, std::function<void()> after_commit = {});
  /// Waits for the save in flight on this rank (rank 0: until it is committed) and returns what
  /// it did, or nullopt if none was in flight. Throws what the writer threw (an I/O error, or on
  /// rank 0 a rank that did not write its file within the group's timeout).
  std::optional<AsyncSaveResult> wait();
  bool in_flight() const { return in_flight_ != nullptr; }
  /// The group the next start() saves over (the ranks training now, when a fault-tolerant job's
  /// membership changed). Every rank of `group` sets it at the same point between saves; a save
  /// in flight finishes on its own group.
  void set_group(std::shared_ptr<ProcessGroup> group);

 private:
  struct Save;
  std::shared_ptr<ProcessGroup> group_;
  std::unique_ptr<Save> in_flight_;
  std::unique_ptr<safetensors::Image> spare_;  // the last save's image, for the next
  int64_t saves_started_ = 0;
};

/// Reads and checks a checkpoint's index.json as load_sharded does first (every field, the
/// pieces' tiling, its checksum) without reading a tensor, and returns the saved metadata: a job
/// can refuse a bad checkpoint before it builds its model. Throws safetensors::FormatError.
std::map<std::string, std::string> read_checkpoint_metadata(const std::string& dir);

/// Loads a checkpoint written by save_sharded on any number of ranks into `model` (sharded or
/// not; the same parameter names and shapes) and, if given, `optimizer` (the same kind as was
/// saved; its state is created or replaced). Every rank reads what it needs; no collective.
/// Returns the saved metadata. Throws safetensors::FormatError for a damaged checkpoint. `tp`:
/// this rank's tensor-parallel layout (default: every parameter whole), whatever the saving
/// job's was.
std::map<std::string, std::string> load_sharded(const std::string& dir, torch::nn::Module& model,
                                                torch::optim::Optimizer* optimizer = nullptr,
                                                const TensorParallelLayout& tp = {});

}  // namespace fsdp
