// Consolidated files: a sharded model as one safetensors file of whole tensors, and back.
//
// save_consolidated streams a sharded model into one file written by rank 0. For each
// parameter in turn, rank 0 writes its own rows and receives every other first holder's rows
// (point to point, in messages of at most an I/O buffer, in parameter order; the next message
// is received while the current one is written), so rank 0 never holds more than its shards
// plus two I/O buffers (plus, for a transposed layout, the parameter in the file's layout); the
// other ranks send from their shards (a transposed layout: one transposed slab at a time). The
// file is written as "<path>.tmp", fsynced, and renamed: a crash leaves no half-written file
// under the final name.
//
// load_consolidated reads, on every rank and without any collective, only the bytes of the
// rows its shard covers (pread), converting the file's dtype to the parameter's: a file saved
// on any number of ranks, by another program, or by Python, loads on any number of ranks and
// under any strategy. The tensors may be spread over several files (a sharded Hugging Face
// checkpoint); each rank then opens every file and reads its rows from whichever holds them.
//
// A TensorLayout maps a parameter onto a tensor of the file under another name, transposed, or
// with its dim-0 rows in another order: what other programs' layouts need (Hugging Face's GPT-2
// stores its linear weights transposed; its Llama permutes the q/k rows for a RoPE that rotates
// halves instead of pairs). The models' Hugging Face mappings are built on it
// (formats/hf_format.h).
#pragma once

#include <c10/util/ArrayRef.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {

class ProcessGroup;

/// Where a parameter lives in a consolidated file.
struct TensorLayout {
  enum class Kind {
    kSame,        // the same shape and order
    kTransposed,  // a 2-d parameter [R, C] stored as [C, R]
    kRowPermuted  // the same shape, dim-0 rows reordered
  };
  TensorLayout() = default;
  TensorLayout(std::string name, Kind kind = Kind::kSame, std::vector<int64_t> file_row = {})
      : name(std::move(name)), kind(kind), file_row(std::move(file_row)) {}

  /// The tensor's name in the file.
  std::string name;
  Kind kind = Kind::kSame;
  /// kRowPermuted: the parameter's row r is the file's row file_row[r] (a permutation).
  std::vector<int64_t> file_row;
};

struct ConsolidatedOptions {
  /// The file tensor of parameter `name` (the model's name; `shape` its global shape). Unset:
  /// the same name and layout for every parameter.
  std::function<TensorLayout(const std::string& name, c10::IntArrayRef shape)> layout;
  /// Which parameters take part (save: are written; load: are read, the others left as they
  /// are). Unset: all. Must give every rank the same answer.
  std::function<bool(const std::string& name)> include;
  /// save: tensors written beside the parameters, rank 0's values (a format's constants, e.g.
  /// zero biases our model does not have). load: ignored, as any tensor of the file that no
  /// parameter maps to.
  std::map<std::string, torch::Tensor> extra_tensors;
  /// save: the file's "__metadata__".
  std::map<std::string, std::string> metadata;
  /// save: the stored dtype of floating-point parameters (unset: as the shards hold them).
  std::optional<torch::ScalarType> dtype;
  /// The I/O buffer: rows travel to rank 0 in messages of at most this many bytes, and reads
  /// that cannot go straight into a shard (another dtype, a transposed layout) are staged
  /// through at most this many (always at least one row).
  int64_t io_buffer_bytes = 16 << 20;
};

/// Writes `model`'s parameters, whole, into the safetensors file `path` (rank 0 writes; every
/// rank of `group`, the group the units were sharded over, calls it). Units must be at rest.
/// Throws if `path` exists. The memory bound (rank 0): its shards, plus two I/O buffers, plus
/// for a transposed layout the whole parameter.
void save_consolidated(const std::string& path, torch::nn::Module& model, ProcessGroup& group,
                       const ConsolidatedOptions& options = {});

/// Loads every parameter of `model` (sharded or not) from the safetensors file `path`: each
/// rank reads the rows its shard covers. Every parameter must be in the file with the expected
/// shape (after its layout) and a floating-point dtype. Throws safetensors::FormatError naming
/// the file and the tensor. Returns the file's metadata.
std::map<std::string, std::string> load_consolidated(const std::string& path,
                                                     torch::nn::Module& model,
                                                     const ConsolidatedOptions& options = {});

/// The same from a model stored across several safetensors files (Hugging Face's sharded
/// checkpoints, model-0000k-of-0000n.safetensors): each tensor is read from the file holding it.
/// Refused (FormatError): a tensor held by two of the files, naming both. Returns the first
/// file's metadata.
std::map<std::string, std::string> load_consolidated(const std::vector<std::string>& paths,
                                                     torch::nn::Module& model,
                                                     const ConsolidatedOptions& options = {});

}  // namespace fsdp
