// GGUF files (llama.cpp's model format): a strict reader of the header, the metadata and the
// tensor table, and dequantisation of F32, F16, BF16, Q8_0, Q4_0 and Q4_1 tensors to float32,
// row range by row range (so that each rank reads only the rows of its shards).
//
// Layout (GGUF v2 and v3, little-endian): "GGUF", u32 version, u64 tensor count, u64 key/value
// count; the key/value pairs (string key, u32 type, value; arrays carry an element type and a
// u64 count); the tensor infos (string name, u32 dims, u64 sizes innermost first, u32 ggml type,
// u64 offset into the data section); padding to general.alignment (default 32); the data.
// Every count, length, size and offset is checked against the file's size before use: a
// malformed file is a FormatError naming the file and what is wrong, never a crash
// (tests/fuzz/fuzz_gguf.cpp fuzzes the parser).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include <fsdp/core/file.h>

namespace fsdp_models::gguf {

struct FormatError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// ggml's tensor types that this reader dequantises (others are refused by name).
enum class TensorType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ8_0 = 8,
  kBF16 = 30,
};
const char* to_string(TensorType t);

/// A metadata value: an integer (signed or not), a float, a bool, a string or an array of
/// values.
struct Value {
  std::variant<uint64_t, int64_t, double, bool, std::string, std::vector<Value>> v;
  uint32_t type = 0;  // GGUF's value type code

  bool is_string() const { return std::holds_alternative<std::string>(v); }
  bool is_array() const { return std::holds_alternative<std::vector<Value>>(v); }
  /// The value as an integer (FormatError if it is not one, or does not fit).
  int64_t as_int(const std::string& what) const;
  double as_double(const std::string& what) const;
  bool as_bool(const std::string& what) const;
  const std::string& as_string(const std::string& what) const;
  const std::vector<Value>& as_array(const std::string& what) const;
};

struct TensorInfo {
  std::string name;
  std::vector<int64_t> shape;  // torch order: outermost first (GGUF stores innermost first)
  TensorType type = TensorType::kF32;
  uint64_t offset = 0;  // absolute, in the file
  uint64_t nbytes = 0;
  int64_t numel() const;
  /// Bytes of one row (the innermost dimension), whole quantisation blocks.
  uint64_t row_bytes() const;
  int64_t rows() const;  // product of all but the innermost dimension (1 for 1-D)
};

/// The parsed header: metadata, tensor table, where the data starts.
struct Header {
  uint32_t version = 0;
  std::map<std::string, Value> metadata;
  std::vector<TensorInfo> tensors;
  uint64_t alignment = 32;
  uint64_t data_offset = 0;
};

/// Parses the header of a GGUF image of `total_size` bytes whose first `available` bytes are
/// at `data` (offsets and sizes of the tensors are checked against total_size). Throws
/// NeedMoreBytes if the header runs past `available` but not past total_size, FormatError if
/// the image is malformed. `name` is used in errors. (The fuzzer passes a whole image.)
struct NeedMoreBytes {};
Header parse(const uint8_t* data, uint64_t available, uint64_t total_size, const std::string& name);

class File {
 public:
  /// Reads and validates the header, metadata and tensor table (not the data).
  explicit File(const std::string& path);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& path() const { return path_; }
  const Header& header() const { return header_; }
  const std::map<std::string, Value>& metadata() const { return header_.metadata; }
  const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
  /// The tensor named `name` (FormatError naming the file if there is none).
  const TensorInfo& tensor(const std::string& name) const;
  bool has_tensor(const std::string& name) const;
  /// The metadata value `key` (FormatError naming the file and key if missing).
  const Value& value(const std::string& key) const;

  /// Rows [row_begin, row_begin + rows) of tensor `name` (rows along its outermost torch
  /// dimension; -1: to the end), dequantised to float32, shaped [rows, ...].
  torch::Tensor read(const std::string& name, int64_t row_begin = 0, int64_t rows = -1) const;

 private:
  /// n bytes at `offset`, or a FormatError naming the file and `what`.
  void read_exact(uint8_t* dst, uint64_t n, uint64_t offset, const std::string& what) const;

  std::string path_;
  fsdp::File file_;
  uint64_t size_ = 0;
  Header header_;
};

/// Dequantises `n` elements of type `type` (whole blocks) from `src` into `dst`.
void dequantize(TensorType type, const uint8_t* src, int64_t n, float* dst);

}  // namespace fsdp_models::gguf
