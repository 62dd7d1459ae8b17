#include <fsdp/checkpoint/safetensors.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <fsdp/core/json_depth.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <utility>

namespace fsdp::safetensors {
namespace {

using Json = nlohmann::json;

struct DtypeName {
  const char* name;
  torch::ScalarType dtype;
};

// Every dtype the format defines that LibTorch has.
constexpr std::array<DtypeName, 15> kDtypes = {{
    {"F64", torch::kDouble},
    {"F32", torch::kFloat},
    {"F16", torch::kHalf},
    {"BF16", torch::kBFloat16},
    {"I64", torch::kLong},
    {"I32", torch::kInt},
    {"I16", torch::kShort},
    {"I8", torch::kChar},
    {"U8", torch::kByte},
    {"U16", torch::kUInt16},
    {"U32", torch::kUInt32},
    {"U64", torch::kUInt64},
    {"BOOL", torch::kBool},
    {"F8_E4M3", torch::kFloat8_e4m3fn},
    {"F8_E5M2", torch::kFloat8_e5m2},
}};

[[noreturn]] void fail(const std::string& msg) {
  throw FormatError(msg);
}

// a * b, or nullopt when it does not fit in 63 bits.
std::optional<uint64_t> checked_mul(uint64_t a, uint64_t b) {
  constexpr uint64_t kMax = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  if (a != 0 && b > kMax / a)
    return std::nullopt;
  return a * b;
}

uint64_t non_negative(const Json& v, const std::string& what) {
  if (v.is_number_unsigned())
    return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0)
    return static_cast<uint64_t>(v.get<int64_t>());
  fail(what + " must be a non-negative integer, got " + v.dump());
}

// Exactly `len` bytes at `offset`: a file shorter than its header says is a format error.
void pread_all(const File& file, void* dst, uint64_t len, uint64_t offset) {
  if (file.pread_some(dst, len, offset) < len)
    fail(file.path() + ": file ends early (truncated?)");
}

}  // namespace

int64_t TensorEntry::numel() const {
  int64_t n = 1;
  for (auto d : shape)
    n *= d;
  return n;
}

uint64_t TensorEntry::row_bytes() const {
  uint64_t b = torch::elementSize(dtype);
  for (size_t i = 1; i < shape.size(); ++i)
    b *= static_cast<uint64_t>(shape[i]);
  return b;
}

const TensorEntry* Header::find(const std::string& name) const {
  for (const auto& t : tensors) {
    if (t.name == name)
      return &t;
  }
  return nullptr;
}

std::string dtype_name(torch::ScalarType dtype) {
  for (const auto& d : kDtypes) {
    if (d.dtype == dtype)
      return d.name;
  }
  fail(std::string("safetensors has no dtype for ") + c10::toString(dtype));
}

torch::ScalarType dtype_from_name(const std::string& name) {
  for (const auto& d : kDtypes) {
    if (name == d.name)
      return d.dtype;
  }
  fail("unknown dtype '" + name + "'");
}

Header parse_header(std::string_view text, uint64_t data_bytes) {
  // Duplicate names would make one of two tensors silently win: refuse them. The parser
  // callback sees every key of the top-level object (depth 1) before it is stored.
  std::set<std::string> seen;
  std::string duplicate;
  if (const auto deep = json_too_deep(text); !deep.empty())
    fail("header is " + deep);
  Json root;
  try {
    root = Json::parse(
        text.begin(), text.end(), [&](int depth, Json::parse_event_t event, Json& parsed) {
          if (event == Json::parse_event_t::key && depth == 1 && parsed.is_string()) {
            if (!seen.insert(parsed.get<std::string>()).second && duplicate.empty())
              duplicate = parsed.get<std::string>();
          }
          return true;
        });
  } catch (const Json::exception& e) {
    fail(std::string("header is not valid JSON (") + e.what() + ")");
  }
  if (!duplicate.empty())
    fail("header names tensor '" + duplicate + "' twice");
  if (!root.is_object())
    fail("header is not a JSON object");

  Header h;
  h.data_bytes = data_bytes;
  for (const auto& [name, v] : root.items()) {
    if (name == "__metadata__") {
      if (!v.is_object())
        fail("__metadata__ is not an object");
      for (const auto& [k, s] : v.items()) {
        if (!s.is_string())
          fail("__metadata__ value of '" + k + "' is not a string");
        h.metadata[k] = s.get<std::string>();
      }
      continue;
    }
    const std::string what = "tensor '" + name + "'";
    if (name.empty())
      fail("a tensor has an empty name");
    if (!v.is_object())
      fail(what + " is not an object");
    for (const auto& [k, _] : v.items()) {
      if (k != "dtype" && k != "shape" && k != "data_offsets")
        fail(what + " has an unknown field '" + k + "'");
    }
    if (!v.contains("dtype") || !v["dtype"].is_string())
      fail(what + ": dtype missing or not a string");
    if (!v.contains("shape") || !v["shape"].is_array())
      fail(what + ": shape missing or not an array");
    if (!v.contains("data_offsets") || !v["data_offsets"].is_array() ||
        v["data_offsets"].size() != 2)
      fail(what + ": data_offsets must be an array of two offsets");
    TensorEntry t;
    t.name = name;
    try {
      t.dtype = dtype_from_name(v["dtype"].get<std::string>());
    } catch (const FormatError& e) {
      fail(what + ": " + e.what());
    }
    uint64_t bytes = torch::elementSize(t.dtype);
    if (v["shape"].size() > 64)
      fail(what + ": shape has " + std::to_string(v["shape"].size()) + " dimensions");
    for (const auto& d : v["shape"]) {
      const uint64_t dim = non_negative(d, what + ": a shape dimension");
      auto product = checked_mul(bytes, dim);
      if (!product)
        fail(what + ": shape " + v["shape"].dump() + " is too large");
      bytes = *product;
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    t.begin = non_negative(v["data_offsets"][0], what + ": data_offsets[0]");
    t.end = non_negative(v["data_offsets"][1], what + ": data_offsets[1]");
    if (t.begin > t.end)
      fail(what + ": data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
           "] end before they begin");
    if (t.end > data_bytes) {
      fail(what + ": data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
           "] run past the end of the data (" + std::to_string(data_bytes) +
           " bytes; file truncated?)");
    }
    if (t.end - t.begin != bytes) {
      fail(what + ": shape " + v["shape"].dump() + " of " + v["dtype"].get<std::string>() +
           " needs " + std::to_string(bytes) + " bytes, data_offsets give " +
           std::to_string(t.end - t.begin));
    }
    h.tensors.push_back(std::move(t));
  }
  // The tensors must tile the data: sorted by offset, each starts where the last ended.
  std::stable_sort(h.tensors.begin(), h.tensors.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t at = 0;
  for (const auto& t : h.tensors) {
    if (t.begin < at)
      fail("tensor '" + t.name + "' overlaps the tensor before it (offset " +
           std::to_string(t.begin) + " < " + std::to_string(at) + ")");
    if (t.begin > at)
      fail("bytes [" + std::to_string(at) + ", " + std::to_string(t.begin) + ") before tensor '" +
           t.name + "' belong to no tensor");
    at = t.end;
  }
  if (at != data_bytes)
    fail("the data has " + std::to_string(data_bytes) + " bytes but the tensors cover " +
         std::to_string(at) + " (trailing bytes or a truncated header?)");
  return h;
}

// ---- Reader -----------------------------------------------------------------------------------

Reader::Reader(std::string path) : path_(std::move(path)) {
  try {
    file_ = open_regular(path_);  // a FIFO would block, a device never end
  } catch (const std::runtime_error& e) {
    fail(e.what());  // a missing or unreadable file is the caller's bad input: FormatError
  }
  const uint64_t size = file_.size();
  if (size < 8)
    fail(path_ + ": " + std::to_string(size) + " bytes is too short for a safetensors file");
  unsigned char len_bytes[8];
  pread_all(file_, len_bytes, 8, 0);
  uint64_t len = 0;
  for (int i = 7; i >= 0; --i)
    len = (len << 8) | len_bytes[i];  // little-endian whatever the host
  if (len > kMaxHeaderBytes)
    fail(path_ + ": header length " + std::to_string(len) + " exceeds the " +
         std::to_string(kMaxHeaderBytes) + "-byte limit (not a safetensors file?)");
  if (len > size - 8)
    fail(path_ + ": header length " + std::to_string(len) + " runs past the end of the " +
         std::to_string(size) + "-byte file (truncated?)");
  std::string text(len, '\0');
  pread_all(file_, text.data(), len, 8);
  data_start_ = 8 + len;
  try {
    header_ = parse_header(text, size - data_start_);
  } catch (const FormatError& e) {
    fail(path_ + ": " + e.what());
  }
}

Reader::~Reader() = default;

const TensorEntry& Reader::entry(const std::string& name) const {
  const auto* t = header_.find(name);
  if (!t)
    fail(path_ + ": no tensor '" + name + "'");
  return *t;
}

void Reader::read_bytes(const TensorEntry& t, uint64_t offset, uint64_t len, void* dst) const {
  if (offset > t.end - t.begin || len > t.end - t.begin - offset)
    fail(path_ + ": tensor '" + t.name + "': read of bytes [" + std::to_string(offset) + ", +" +
         std::to_string(len) + ") is outside its " + std::to_string(t.end - t.begin) + " bytes");
  pread_all(file_, dst, len, data_start_ + t.begin + offset);
}

torch::Tensor Reader::read_rows(const std::string& name, int64_t row, int64_t rows) const {
  const auto& t = entry(name);
  const int64_t d0 = t.shape.empty() ? 1 : t.shape[0];
  if (row < 0 || rows < 0 || row > d0 || rows > d0 - row)
    fail(path_ + ": tensor '" + name + "': rows [" + std::to_string(row) + ", " +
         std::to_string(row + rows) + ") outside its " + std::to_string(d0) + " rows");
  std::vector<int64_t> shape = t.shape.empty() ? std::vector<int64_t>{} : t.shape;
  if (!shape.empty())
    shape[0] = rows;
  auto out = torch::empty(shape, torch::TensorOptions().dtype(t.dtype));
  const uint64_t rb = t.row_bytes();
  if (rows > 0)
    read_bytes(t, static_cast<uint64_t>(row) * rb, static_cast<uint64_t>(rows) * rb,
               out.data_ptr());
  return out;
}

torch::Tensor Reader::read(const std::string& name) const {
  const auto& t = entry(name);
  return read_rows(name, 0, t.shape.empty() ? 1 : t.shape[0]);
}

// ---- Writer -----------------------------------------------------------------------------------

Image::Image(const std::vector<TensorSpec>& specs,
             const std::map<std::string, std::string>& metadata) {
  const std::string first = layout_file(specs, metadata, header_);
  data_start_ = first.size();
  size_ = data_start_ + header_.data_bytes;
  constexpr uint64_t kPage = SequentialFile::kAlign;  // written from here without a copy
  bytes_ = torch::empty({static_cast<int64_t>(size_ + kPage)}, torch::kUInt8);
  const auto base = reinterpret_cast<uintptr_t>(bytes_.data_ptr<uint8_t>());
  at_ = reinterpret_cast<unsigned char*>((base + kPage - 1) / kPage * kPage);
  std::memcpy(at_, first.data(), first.size());
}

torch::Tensor Image::slot(const std::string& name) {
  const TensorEntry* t = header_.find(name);
  TORCH_CHECK(t, "safetensors::Image: no tensor '", name, "'");
  return torch::from_blob(at_ + data_start_ + t->begin, t->shape,
                          torch::TensorOptions().dtype(t->dtype));
}

bool Image::holds(const std::vector<TensorSpec>& specs) const {
  if (!header_.metadata.empty() || specs.size() != header_.tensors.size())
    return false;
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto& t = header_.tensors[i];
    if (specs[i].name != t.name || specs[i].dtype != t.dtype || specs[i].shape != t.shape)
      return false;
  }
  return true;
}

void Image::write(const std::string& path) const {
  SequentialFile file(path);
  file.pwrite(at_, size_, 0);
  file.finish();
}

std::string layout_file(const std::vector<TensorSpec>& specs,
                        const std::map<std::string, std::string>& metadata, Header& out) {
  out = Header();
  Json header = Json::object();
  if (!metadata.empty())
    header["__metadata__"] = metadata;
  std::set<std::string> names;
  uint64_t at = 0;
  for (const auto& s : specs) {
    TORCH_CHECK(!s.name.empty() && s.name != "__metadata__", "safetensors: invalid tensor name '",
                s.name, "'");
    TORCH_CHECK(names.insert(s.name).second, "safetensors: tensor '", s.name, "' given twice");
    TensorEntry t;
    t.name = s.name;
    t.dtype = s.dtype;
    t.shape = s.shape;
    t.begin = at;
    t.end = at + static_cast<uint64_t>(t.numel()) * torch::elementSize(t.dtype);
    at = t.end;
    header[t.name] = {
        {"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {t.begin, t.end}}};
    out.tensors.push_back(std::move(t));
  }
  out.data_bytes = at;
  out.metadata = metadata;
  std::string text = header.dump();
  // Pad with spaces so the data starts 8-byte aligned (readers that map the file can then
  // use the data in place).
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');
  std::string first(8, '\0');
  const uint64_t len = text.size();
  for (int i = 0; i < 8; ++i)
    first[static_cast<size_t>(i)] = static_cast<char>(len >> (8 * i));
  return first + text;
}

Writer::Writer(std::string path, std::vector<TensorSpec> specs,
               std::map<std::string, std::string> metadata)
    : path_(std::move(path)) {
  const std::string first = layout_file(specs, metadata, header_);
  for (size_t i = 0; i < header_.tensors.size(); ++i)
    index_.emplace(header_.tensors[i].name, i);
  written_.assign(header_.tensors.size(), 0);
  file_ = std::make_unique<SequentialFile>(path_);
  file_->pwrite(first.data(), first.size(), 0);
  data_start_ = first.size();
}

Writer::~Writer() = default;

void Writer::write_rows(const std::string& name, int64_t row, const torch::Tensor& rows) {
  auto it = index_.find(name);
  TORCH_CHECK(it != index_.end(), path_, ": no tensor '", name, "' in this file");
  const auto& t = header_.tensors[it->second];
  TORCH_CHECK(rows.scalar_type() == t.dtype, path_, ": tensor '", name, "' is ",
              c10::toString(t.dtype), ", got ", c10::toString(rows.scalar_type()));
  auto src = rows.to(torch::kCPU).contiguous();
  const uint64_t rb = t.row_bytes();
  const int64_t d0 = t.shape.empty() ? 1 : t.shape[0];
  const int64_t n = t.shape.empty() ? 1 : (src.dim() == 0 ? 1 : src.size(0));
  TORCH_CHECK(static_cast<uint64_t>(src.numel()) * torch::elementSize(t.dtype) ==
                  static_cast<uint64_t>(n) * rb,
              path_, ": tensor '", name, "': rows of the wrong shape ", src.sizes());
  TORCH_CHECK(row >= 0 && row + n <= d0, path_, ": tensor '", name, "': rows [", row, ", ", row + n,
              ") outside its ", d0, " rows");
  const uint64_t bytes = static_cast<uint64_t>(n) * rb;
  file_->pwrite(src.data_ptr(), bytes, data_start_ + t.begin + static_cast<uint64_t>(row) * rb);
  written_[it->second] += bytes;
}

void Writer::write(const std::string& name, const torch::Tensor& t) {
  write_rows(name, 0, t);
}

void Writer::finish() {
  for (size_t i = 0; i < header_.tensors.size(); ++i) {
    const auto& t = header_.tensors[i];
    TORCH_CHECK(written_[i] == t.end - t.begin, path_, ": tensor '", t.name, "' got ", written_[i],
                " of its ", t.end - t.begin, " bytes");
  }
  file_->finish();
}

}  // namespace fsdp::safetensors
