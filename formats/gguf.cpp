// See gguf.h. Written by hand: no Debian package reads GGUF (ggml's own reader is part of
// llama.cpp, not packaged as a library here), and the format is small.
#include "gguf.h"

#include <fsdp/core/file.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <torch/torch.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>

namespace fsdp_models::gguf {
namespace {

constexpr uint32_t kMaxDims = 4;  // ggml's GGML_MAX_DIMS
// Bounds on what a header may claim before anything is allocated for it: a string longer than
// the file, or more array elements than bytes left, is refused as malformed anyway; these only
// keep a hostile count from reserving memory first.
constexpr uint64_t kMaxNesting = 4;

struct BlockFormat {
  int64_t elems;  // per block
  int64_t bytes;  // per block
};

bool block_format(uint32_t type, BlockFormat* out) {
  switch (static_cast<TensorType>(type)) {
    case TensorType::kF32:
      *out = {1, 4};
      return true;
    case TensorType::kF16:
    case TensorType::kBF16:
      *out = {1, 2};
      return true;
    case TensorType::kQ4_0:
      *out = {32, 18};  // fp16 scale, 16 bytes of nibbles
      return true;
    case TensorType::kQ4_1:
      *out = {32, 20};  // fp16 scale, fp16 minimum, 16 bytes of nibbles
      return true;
    case TensorType::kQ8_0:
      *out = {32, 34};  // fp16 scale, 32 int8
      return true;
  }
  return false;
}

// A bounds-checked reader over the first `available` bytes of an image of `total` bytes.
class Cursor {
 public:
  Cursor(const uint8_t* data, uint64_t available, uint64_t total, const std::string& name)
      : data_(data), available_(available), total_(total), name_(name) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw FormatError(name_ + ": not a valid GGUF file: " + what + " (at byte " +
                      std::to_string(pos_) + ")");
  }
  // Makes sure n more bytes are there.
  void need(uint64_t n, const char* what) {
    if (n > total_ - pos_)
      fail(std::string("truncated: ") + what + " needs " + std::to_string(n) + " bytes, " +
           std::to_string(total_ - pos_) + " left in the file");
    if (n > available_ - pos_)
      throw NeedMoreBytes{};
  }
  template <class T>
  T get(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string string(const char* what) {
    const auto len = get<uint64_t>(what);
    need(len, what);
    std::string s(reinterpret_cast<const char*>(data_ + pos_), len);
    pos_ += len;
    return s;
  }
  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return total_ - pos_; }
  const std::string& name() const { return name_; }

 private:
  const uint8_t* data_;
  uint64_t available_, total_;
  uint64_t pos_ = 0;
  std::string name_;
};

// GGUF value types.
enum : uint32_t {
  kU8 = 0,
  kI8,
  kU16,
  kI16,
  kU32,
  kI32,
  kF32v,
  kBool,
  kString,
  kArray,
  kU64,
  kI64,
  kF64,
};

// The smallest number of bytes a value of this type takes (to refuse array counts larger than
// the file before reading them).
uint64_t min_size(uint32_t type) {
  switch (type) {
    case kU8:
    case kI8:
    case kBool:
      return 1;
    case kU16:
    case kI16:
      return 2;
    case kU32:
    case kI32:
    case kF32v:
      return 4;
    case kString:
    case kU64:
    case kI64:
    case kF64:
      return 8;
    case kArray:
      return 12;
    default:
      return 0;
  }
}

Value read_value(Cursor& c, uint32_t type, uint64_t depth) {
  Value out;
  out.type = type;
  switch (type) {
    case kU8:
      out.v = uint64_t{c.get<uint8_t>("a u8 value")};
      break;
    case kI8:
      out.v = int64_t{c.get<int8_t>("an i8 value")};
      break;
    case kU16:
      out.v = uint64_t{c.get<uint16_t>("a u16 value")};
      break;
    case kI16:
      out.v = int64_t{c.get<int16_t>("an i16 value")};
      break;
    case kU32:
      out.v = uint64_t{c.get<uint32_t>("a u32 value")};
      break;
    case kI32:
      out.v = int64_t{c.get<int32_t>("an i32 value")};
      break;
    case kU64:
      out.v = c.get<uint64_t>("a u64 value");
      break;
    case kI64:
      out.v = c.get<int64_t>("an i64 value");
      break;
    case kF32v:
      out.v = double{c.get<float>("an f32 value")};
      break;
    case kF64:
      out.v = c.get<double>("an f64 value");
      break;
    case kBool: {
      const auto b = c.get<uint8_t>("a bool value");
      if (b > 1)
        c.fail("a bool value of " + std::to_string(b));
      out.v = b == 1;
      break;
    }
    case kString:
      out.v = c.string("a string value");
      break;
    case kArray: {
      if (depth >= kMaxNesting)
        c.fail("arrays nested deeper than " + std::to_string(kMaxNesting));
      const auto elem = c.get<uint32_t>("an array's element type");
      const auto count = c.get<uint64_t>("an array's length");
      const uint64_t each = min_size(elem);
      if (each == 0)
        c.fail("an array of unknown value type " + std::to_string(elem));
      if (count > c.remaining() / each)
        c.fail("an array of " + std::to_string(count) + " elements, longer than the file");
      std::vector<Value> items;
      items.reserve(count);
      for (uint64_t i = 0; i < count; ++i)
        items.push_back(read_value(c, elem, depth + 1));
      out.v = std::move(items);
      break;
    }
    default:
      c.fail("unknown value type " + std::to_string(type));
  }
  return out;
}

}  // namespace

const char* to_string(TensorType t) {
  switch (t) {
    case TensorType::kF32:
      return "F32";
    case TensorType::kF16:
      return "F16";
    case TensorType::kQ4_0:
      return "Q4_0";
    case TensorType::kQ4_1:
      return "Q4_1";
    case TensorType::kQ8_0:
      return "Q8_0";
    case TensorType::kBF16:
      return "BF16";
  }
  return "?";
}

int64_t Value::as_int(const std::string& what) const {
  if (const auto* u = std::get_if<uint64_t>(&v)) {
    if (*u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      throw FormatError(what + ": " + std::to_string(*u) + " is too large");
    return static_cast<int64_t>(*u);
  }
  if (const auto* i = std::get_if<int64_t>(&v))
    return *i;
  throw FormatError(what + ": not an integer");
}

double Value::as_double(const std::string& what) const {
  if (const auto* d = std::get_if<double>(&v))
    return *d;
  if (std::holds_alternative<uint64_t>(v) || std::holds_alternative<int64_t>(v))
    return static_cast<double>(as_int(what));
  throw FormatError(what + ": not a number");
}

bool Value::as_bool(const std::string& what) const {
  if (const auto* b = std::get_if<bool>(&v))
    return *b;
  throw FormatError(what + ": not a bool");
}

const std::string& Value::as_string(const std::string& what) const {
  if (const auto* s = std::get_if<std::string>(&v))
    return *s;
  throw FormatError(what + ": not a string");
}

const std::vector<Value>& Value::as_array(const std::string& what) const {
  if (const auto* a = std::get_if<std::vector<Value>>(&v))
    return *a;
  throw FormatError(what + ": not an array");
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (auto d : shape)
    n *= d;
  return n;
}

int64_t TensorInfo::rows() const {
  int64_t n = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i)
    n *= shape[i];
  return n;
}

uint64_t TensorInfo::row_bytes() const {
  BlockFormat f{};
  block_format(static_cast<uint32_t>(type), &f);
  const int64_t inner = shape.empty() ? 1 : shape.back();
  return static_cast<uint64_t>(inner / f.elems * f.bytes);
}

Header parse(const uint8_t* data, uint64_t available, uint64_t total_size,
             const std::string& name) {
  Cursor c(data, std::min(available, total_size), total_size, name);
  Header h;
  c.need(4, "the magic");
  if (std::memcmp(data, "GGUF", 4) != 0)
    c.fail("it does not start with \"GGUF\"");
  c.get<uint32_t>("the magic");
  h.version = c.get<uint32_t>("the version");
  if (h.version != 2 && h.version != 3)
    c.fail("version " + std::to_string(h.version) + " (2 and 3 are read)");
  const auto n_tensors = c.get<uint64_t>("the tensor count");
  const auto n_kv = c.get<uint64_t>("the key/value count");
  // Each key/value takes at least 8 + 4 bytes, each tensor info 8 + 4 + 4 + 8.
  if (n_kv > c.remaining() / 12)
    c.fail(std::to_string(n_kv) + " key/value pairs, more than the file can hold");
  if (n_tensors > c.remaining() / 24)
    c.fail(std::to_string(n_tensors) + " tensors, more than the file can hold");
  for (uint64_t i = 0; i < n_kv; ++i) {
    auto key = c.string("a metadata key");
    const auto type = c.get<uint32_t>("a metadata value type");
    auto value = read_value(c, type, 0);
    if (!h.metadata.emplace(key, std::move(value)).second)
      c.fail("metadata key '" + key + "' appears twice");
  }
  if (auto it = h.metadata.find("general.alignment"); it != h.metadata.end()) {
    const int64_t a = it->second.as_int(name + ": general.alignment");
    if (a <= 0 || a > (1 << 20) || (a & (a - 1)) != 0)
      c.fail("general.alignment " + std::to_string(a) + " is not a power of two up to 1 MiB");
    h.alignment = static_cast<uint64_t>(a);
  }
  std::set<std::string> names;
  std::vector<uint64_t> relative;
  for (uint64_t i = 0; i < n_tensors; ++i) {
    TensorInfo t;
    t.name = c.string("a tensor name");
    if (!names.insert(t.name).second)
      c.fail("tensor '" + t.name + "' appears twice");
    const auto n_dims = c.get<uint32_t>("a tensor's dimension count");
    if (n_dims == 0 || n_dims > kMaxDims)
      c.fail("tensor '" + t.name + "' has " + std::to_string(n_dims) + " dimensions (1-4)");
    std::vector<int64_t> ne(n_dims);
    uint64_t numel = 1;
    for (auto& d : ne) {
      const auto v = c.get<uint64_t>("a tensor's size");
      if (v == 0 || v > (uint64_t{1} << 40))
        c.fail("tensor '" + t.name + "' has a dimension of " + std::to_string(v));
      if (numel > (uint64_t{1} << 48) / v)
        c.fail("tensor '" + t.name + "' has more than 2^48 elements");
      numel *= v;
      d = static_cast<int64_t>(v);
    }
    const auto type = c.get<uint32_t>("a tensor's type");
    BlockFormat f{};
    if (!block_format(type, &f))
      c.fail("tensor '" + t.name + "' has ggml type " + std::to_string(type) +
             ", which this reader does not dequantise (F32, F16, BF16, Q8_0, Q4_0, Q4_1)");
    t.type = static_cast<TensorType>(type);
    if (ne[0] % f.elems != 0)
      c.fail("tensor '" + t.name + "': rows of " + std::to_string(ne[0]) +
             " elements are not whole " + to_string(t.type) + " blocks of " +
             std::to_string(f.elems));
    t.shape.assign(ne.rbegin(), ne.rend());
    t.nbytes = numel / f.elems * f.bytes;
    const auto offset = c.get<uint64_t>("a tensor's offset");
    if (offset % h.alignment != 0)
      c.fail("tensor '" + t.name + "' starts at offset " + std::to_string(offset) +
             ", not a multiple of the alignment " + std::to_string(h.alignment));
    relative.push_back(offset);
    h.tensors.push_back(std::move(t));
  }
  h.data_offset = (c.pos() + h.alignment - 1) / h.alignment * h.alignment;
  if (h.data_offset > total_size)
    c.fail("the data section starts past the end of the file");
  // Every tensor within the file, and no two overlapping.
  std::vector<std::pair<uint64_t, size_t>> order;
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    auto& t = h.tensors[i];
    const uint64_t room = total_size - h.data_offset;
    if (relative[i] > room || t.nbytes > room - relative[i])
      c.fail("tensor '" + t.name + "' (" + std::to_string(t.nbytes) + " bytes at data offset " +
             std::to_string(relative[i]) + ") runs past the end of the file");
    t.offset = h.data_offset + relative[i];
    order.emplace_back(t.offset, i);
  }
  std::sort(order.begin(), order.end());
  for (size_t k = 1; k < order.size(); ++k) {
    const auto& prev = h.tensors[order[k - 1].second];
    if (prev.offset + prev.nbytes > order[k].first)
      c.fail("tensors '" + prev.name + "' and '" + h.tensors[order[k].second].name + "' overlap");
  }
  // Each tensor fills the space up to the next one (the end of the file after the last) but
  // for the padding to the alignment that writers put after every tensor: a type patched into
  // a smaller one (F16 -> Q4_0) or a shrunken shape would otherwise read its bytes as garbage.
  for (size_t k = 0; k < order.size(); ++k) {
    const auto& t = h.tensors[order[k].second];
    const uint64_t next = k + 1 < order.size() ? order[k + 1].first : total_size;
    const uint64_t unread = next - (t.offset + t.nbytes);
    if (unread >= h.alignment)
      c.fail("tensor '" + t.name + "' (" + to_string(t.type) + ", " + std::to_string(t.nbytes) +
             " bytes) leaves " + std::to_string(unread) + " bytes unread before " +
             (k + 1 < order.size() ? "tensor '" + h.tensors[order[k + 1].second].name + "'"
                                   : std::string("the end of the file")) +
             ": its type or shape does not match its data");
  }
  return h;
}

void dequantize(TensorType type, const uint8_t* src, int64_t n, float* dst) {
  auto half = [](const uint8_t* p) {
    uint16_t bits;
    std::memcpy(&bits, p, 2);
    return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
  };
  switch (type) {
    case TensorType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case TensorType::kF16:
      for (int64_t i = 0; i < n; ++i)
        dst[i] = half(src + 2 * i);
      return;
    case TensorType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t bits;
        std::memcpy(&bits, src + 2 * i, 2);
        dst[i] = static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
      }
      return;
    case TensorType::kQ8_0:
      for (int64_t b = 0; b < n / 32; ++b, src += 34, dst += 32) {
        const float d = half(src);
        for (int j = 0; j < 32; ++j)
          dst[j] = static_cast<float>(static_cast<int8_t>(src[2 + j])) * d;
      }
      return;
    case TensorType::kQ4_0:
      // Element j of a block is the low nibble of byte j, element j + 16 its high nibble;
      // value (nibble - 8) * d.
      for (int64_t b = 0; b < n / 32; ++b, src += 18, dst += 32) {
        const float d = half(src);
        for (int j = 0; j < 16; ++j) {
          dst[j] = static_cast<float>((src[2 + j] & 0x0f) - 8) * d;
          dst[j + 16] = static_cast<float>((src[2 + j] >> 4) - 8) * d;
        }
      }
      return;
    case TensorType::kQ4_1:
      // Same nibble order; value nibble * d + m.
      for (int64_t b = 0; b < n / 32; ++b, src += 20, dst += 32) {
        const float d = half(src), m = half(src + 2);
        for (int j = 0; j < 16; ++j) {
          dst[j] = static_cast<float>(src[4 + j] & 0x0f) * d + m;
          dst[j + 16] = static_cast<float>(src[4 + j] >> 4) * d + m;
        }
      }
      return;
  }
  throw FormatError(std::string("gguf: cannot dequantise type ") + to_string(type));
}

File::File(const std::string& path) : path_(path) {
  try {
    file_ = fsdp::open_regular(path);  // a FIFO would block, a device never end
    size_ = file_.size();
  } catch (const std::runtime_error& e) {
    throw FormatError(e.what());
  }
  // The header's size is known only once parsed: read a prefix, and extend it if the parser
  // runs past it (tokenizer vocabularies make headers of several MiB).
  std::vector<uint8_t> buf;
  for (uint64_t want = std::min<uint64_t>(size_, 4 << 20);; want = std::min(size_, want * 4)) {
    const uint64_t have = buf.size();
    buf.resize(want);
    read_exact(buf.data() + have, want - have, have, "the header");
    try {
      header_ = parse(buf.data(), want, size_, path);
      break;
    } catch (const NeedMoreBytes&) {
      continue;  // want < size_ here: parse reports truncation against size_ itself
    }
  }
}

void File::read_exact(uint8_t* dst, uint64_t n, uint64_t offset, const std::string& what) const {
  uint64_t got = 0;
  try {
    got = file_.pread_some(dst, n, offset);
  } catch (const std::runtime_error& e) {
    throw FormatError(path_ + ": " + what + ": " + e.what());
  }
  if (got < n)
    throw FormatError(path_ + ": " + what +
                      ": read failed: the file is shorter than its header says");
}

File::~File() = default;

bool File::has_tensor(const std::string& name) const {
  return std::any_of(header_.tensors.begin(), header_.tensors.end(),
                     [&](const TensorInfo& t) { return t.name == name; });
}

const TensorInfo& File::tensor(const std::string& name) const {
  for (const auto& t : header_.tensors)
    if (t.name == name)
      return t;
  throw FormatError(path_ + ": no tensor '" + name + "'");
}

const Value& File::value(const std::string& key) const {
  auto it = header_.metadata.find(key);
  if (it == header_.metadata.end())
    throw FormatError(path_ + ": no metadata key '" + key + "'");
  return it->second;
}

torch::Tensor File::read(const std::string& name, int64_t row_begin, int64_t rows) const {
  const auto& t = tensor(name);
  const int64_t outer = t.shape.front();
  if (rows < 0)
    rows = outer - row_begin;
  TORCH_CHECK(row_begin >= 0 && rows >= 0 && row_begin + rows <= outer, path_, ": tensor '", name,
              "' has ", outer, " rows, asked for [", row_begin, ", ", row_begin + rows, ")");
  // Bytes per outermost row: of a 1-D tensor, one element (whole only if not quantised).
  uint64_t outer_bytes = 0;
  if (t.shape.size() == 1) {
    BlockFormat f{};
    block_format(static_cast<uint32_t>(t.type), &f);
    TORCH_CHECK(f.elems == 1 || (row_begin == 0 && rows == outer), path_, ": tensor '", name,
                "' is a quantised vector: it is read whole");
    outer_bytes = f.elems == 1 ? static_cast<uint64_t>(f.bytes) : 0;
  } else {
    outer_bytes = t.row_bytes() * static_cast<uint64_t>(t.rows() / outer);
  }
  std::vector<int64_t> shape = t.shape;
  shape[0] = rows;
  auto out = torch::empty(shape, torch::kFloat32);
  if (rows == 0)
    return out;
  const uint64_t first = outer_bytes ? row_begin * outer_bytes : 0;
  const uint64_t count = outer_bytes ? rows * outer_bytes : t.nbytes;
  std::vector<uint8_t> raw(count);
  read_exact(raw.data(), count, t.offset + first, "tensor '" + name + "'");
  dequantize(t.type, raw.data(), out.numel(), out.data_ptr<float>());
  return out;
}

}  // namespace fsdp_models::gguf
