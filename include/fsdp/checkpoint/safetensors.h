// safetensors files: a strict reader and a streaming writer.
//
// The format (https://huggingface.co/docs/safetensors): 8 bytes little-endian header length N,
// N bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
// {string: string}}, then the data; offsets count from the end of the header. Everything in a
// header is validated before a byte of data is trusted: the length against the file, every
// dtype, shape and offset pair, the byte count against the shape, and that the tensors tile
// the data exactly (no overlap, no hole: a hole could hide anything), as the reference
// implementation requires. Files from outside (checkpoints copied around, downloaded models)
// go through the same parser.
//
// Written by hand rather than taken from a library: the format is a JSON header and raw bytes,
// there is no maintained C++ package in Debian, and what the checkpoints need (reading a range
// of rows with pread, writing a tensor's rows as they arrive from several units) is the
// part a general library would not give.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <fsdp/core/file.h>
#include <fsdp/core/sequential_file.h>

namespace fsdp::safetensors {

/// A malformed, truncated or unreadable file; the message names the file (and the tensor).
class FormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Largest header accepted (as the reference implementation): a bigger length is corruption or
/// an attack, and would otherwise be allocated before anything is checked.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

struct TensorEntry {
  std::string name;
  torch::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets in the data section
  uint64_t end = 0;
  int64_t numel() const;
  /// Bytes of one dim-0 row (the whole tensor for a 0-d one).
  uint64_t row_bytes() const;
};

struct Header {
  std::vector<TensorEntry> tensors;  // in data order
  std::map<std::string, std::string> metadata;
  uint64_t data_bytes = 0;
  /// nullptr if absent.
  const TensorEntry* find(const std::string& name) const;
};

/// The safetensors name of a dtype ("F32", "BF16", ...), and back; throws FormatError for a
/// dtype the format has no name for (or a name it does not define).
std::string dtype_name(torch::ScalarType dtype);
torch::ScalarType dtype_from_name(const std::string& name);

/// Parses and validates a header (the JSON text) for a data section of `data_bytes` bytes.
/// Throws FormatError naming the problem (and the tensor) without a file name.
Header parse_header(std::string_view json, uint64_t data_bytes);

class Reader {
 public:
  /// Opens `path` and validates its header; throws FormatError.
  explicit Reader(std::string path);
  ~Reader();
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  const std::string& path() const { return path_; }
  const Header& header() const { return header_; }
  /// The entry named `name`; throws FormatError naming the file if absent.
  const TensorEntry& entry(const std::string& name) const;

  /// Copies bytes [offset, offset + len) of `t`'s data into `dst` (pread; bounds checked).
  void read_bytes(const TensorEntry& t, uint64_t offset, uint64_t len, void* dst) const;
  /// Rows [row, row + rows) of dim 0 of tensor `name`, as a new CPU tensor of its dtype.
  torch::Tensor read_rows(const std::string& name, int64_t row, int64_t rows) const;
  /// The whole tensor.
  torch::Tensor read(const std::string& name) const;

 private:
  std::string path_;
  File file_;
  uint64_t data_start_ = 0;
  Header header_;
};

struct TensorSpec {
  std::string name;
  torch::ScalarType dtype;
  std::vector<int64_t> shape;
};

/// The file's first bytes for `specs` in their order (the 8-byte length, then the JSON header
/// padded with spaces so the data starts 8-byte aligned), and in `header` their layout: what
/// Writer and Image both write. Throws for an empty, reserved or repeated name.
std::string layout_file(const std::vector<TensorSpec>& specs,
                        const std::map<std::string, std::string>& metadata, Header& header);

/// A whole file built in memory, laid out as Writer lays it out: the caller copies each tensor
/// into its slot(), and write() puts the file on disk in one front-to-back pass, O_DIRECT
/// straight from the image's page-aligned memory where the filesystem allows it (no copy into
/// a write buffer, none into the page cache). An asynchronous checkpoint's snapshot is one
/// (its copy of the rows is the file's image, so its background writer costs the training
/// cores almost nothing). The memory is one tensor of bytes: fsdp::memory counts it, and the
/// caching allocator hands it back to the next image of the same size.
class Image {
 public:
  Image(const std::vector<TensorSpec>& specs,
        const std::map<std::string, std::string>& metadata = {});

  const Header& header() const { return header_; }
  /// The tensor's place in the image, as a tensor of its dtype and shape (valid while the image
  /// lives; not necessarily aligned to its dtype, as in the file).
  torch::Tensor slot(const std::string& name);
  /// The file's size in bytes.
  uint64_t size() const { return size_; }
  /// Whether the image is laid out for `specs` (and no metadata): it can be filled again.
  bool holds(const std::vector<TensorSpec>& specs) const;
  /// Creates (or truncates) `path`, writes the image and fsyncs it. Throws on an I/O error.
  void write(const std::string& path) const;

 private:
  Header header_;
  torch::Tensor bytes_;          // the allocation (one page more, for the alignment)
  unsigned char* at_ = nullptr;  // the image's first byte, page-aligned
  uint64_t data_start_ = 0;
  uint64_t size_ = 0;
};

/// Writes one file whose tensors are known in advance and whose data arrives in pieces (a
/// tensor's rows as each unit is gathered, in any order): the header is written first, each
/// piece with pwrite at its offset (a SequentialFile: while the pieces come in the file's order,
/// as a checkpoint's do, they bypass the page cache). finish() checks that each tensor received
/// as many bytes as it holds, then fsyncs. A writer destroyed before finish() leaves an incomplete
/// file: write into a temporary name and rename after finish() (the checkpoint code does).
class Writer {
 public:
  Writer(std::string path, std::vector<TensorSpec> specs,
         std::map<std::string, std::string> metadata = {});
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  const Header& header() const { return header_; }
  /// Writes `rows` (contiguous or not; CPU or not; the spec's dtype and row shape) as rows
  /// [row, row + rows.size(0)) of tensor `name`.
  void write_rows(const std::string& name, int64_t row, const torch::Tensor& rows);
  void write(const std::string& name, const torch::Tensor& t);
  /// Verifies completeness, fsyncs and closes. Throws if a byte range is missing.
  void finish();

 private:
  std::string path_;
  std::unique_ptr<SequentialFile> file_;
  uint64_t data_start_ = 0;
  Header header_;
  std::map<std::string, size_t> index_;
  std::vector<uint64_t> written_;  // bytes written per tensor
};

}  // namespace fsdp::safetensors
