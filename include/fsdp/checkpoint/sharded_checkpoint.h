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
// The directory must be on a file system every rank sees (one node, or a shared one).
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <memory>
#include <string>

namespace fsdp {

class ProcessGroup;

/// Saves `model`'s parameters and, if given, `optimizer`'s state (torch::optim::AdamW, Adam or
/// SGD) as this rank holds them. Collective over `group` (every rank calls it with the same
/// dir). `metadata` (e.g. the training step) is stored in the index; load_sharded returns it.
/// Throws if `dir` exists (checkpoints are never overwritten in place).
void save_sharded(const std::string& dir, torch::nn::Module& model,
                  torch::optim::Optimizer* optimizer, ProcessGroup& group,
                  const std::map<std::string, std::string>& metadata = {});

/// Loads a checkpoint written by save_sharded on any number of ranks into `model` (sharded or
/// not; the same parameter names and shapes) and, if given, `optimizer` (the same kind as was
/// saved; its state is created or replaced). Every rank reads what it needs; no collective.
/// Returns the saved metadata. Throws safetensors::FormatError for a damaged checkpoint.
std::map<std::string, std::string> load_sharded(const std::string& dir, torch::nn::Module& model,
                                                torch::optim::Optimizer* optimizer = nullptr);

}  // namespace fsdp
