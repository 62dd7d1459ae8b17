// TensorBoard event files: the protobuf wire encoding of the few messages we write, the TFRecord
// framing around them, and the file's atomic creation. See tensorboard.h for the format.
//
// Why no protobuf library: the LibTorch in this process (the torch wheel's libtorch_cpu.so)
// exports its own copy of protobuf (`nm -D --defined-only libtorch_cpu.so | grep -c
// google8protobuf`: 259 symbols); linking Debian's libprotobuf as well would put two protobuf
// runtimes of different versions in one process, where the dynamic linker may bind one's
// symbols to the other's. The messages we write have five scalar or string fields, so the
// encoder below writes the wire format (varints, 64- and 32-bit values, length-delimited
// fields) by hand, as a protobuf library would byte for byte.
#include "tensorboard.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <stdexcept>
#include <string_view>

#include <fmt/format.h>
#include <fsdp/core/durable_file.h>

#include "crc32c.h"

namespace fsdp_trainer {
namespace {

// ---- Protobuf wire format ------------------------------------------------------------------
//
// A field is a key varint (field number << 3 | wire type) followed by its value. The field
// numbers are those of tensorflow/core/util/event.proto and framework/summary.proto:
//   Event      { double wall_time = 1; int64 step = 2; string file_version = 3;
//                Summary summary = 5; SessionLog session_log = 7; }
//   Summary    { repeated Value value = 1; }
//   Value      { string tag = 1; float simple_value = 2; }
//   SessionLog { SessionStatus status = 1; }   (START = 1)

enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

static_assert(std::endian::native == std::endian::little,
              "the fixed-width protobuf and TFRecord fields are little-endian; this file "
              "copies them from memory as they are");

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_key(std::string& out, uint32_t field, WireType type) {
  put_varint(out, (uint64_t{field} << 3) | type);
}

template <typename T>
void put_fixed(std::string& out, T v) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));
  out.append(bytes, sizeof(T));
}

// int64 fields are varints of the two's complement: a negative value takes ten bytes.
void put_int64_field(std::string& out, uint32_t field, int64_t v) {
  put_key(out, field, kVarint);
  put_varint(out, static_cast<uint64_t>(v));
}

void put_double_field(std::string& out, uint32_t field, double v) {
  put_key(out, field, kFixed64);
  put_fixed(out, v);
}

void put_float_field(std::string& out, uint32_t field, float v) {
  put_key(out, field, kFixed32);
  put_fixed(out, v);
}

// Strings and embedded messages alike: the length, then the bytes.
void put_bytes_field(std::string& out, uint32_t field, std::string_view bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out.append(bytes);
}

// ---- Events --------------------------------------------------------------------------------

std::string event_header(double wall_time, int64_t step) {
  std::string event;
  put_double_field(event, 1, wall_time);
  put_int64_field(event, 2, step);
  return event;
}

std::string file_version_event(double wall_time) {
  std::string event = event_header(wall_time, 0);
  put_bytes_field(event, 3, "brain.Event:2");
  return event;
}

std::string session_start_event(double wall_time, int64_t step) {
  std::string session_log;
  put_int64_field(session_log, 1, 1);  // status = START
  std::string event = event_header(wall_time, step);
  put_bytes_field(event, 7, session_log);
  return event;
}

std::string scalars_event(double wall_time, int64_t step,
                          const std::vector<TensorBoardScalar>& values) {
  std::string summary;
  for (const TensorBoardScalar& v : values) {
    std::string value;
    put_bytes_field(value, 1, v.tag);
    put_float_field(value, 2, static_cast<float>(v.value));
    put_bytes_field(summary, 1, value);
  }
  std::string event = event_header(wall_time, step);
  put_bytes_field(event, 5, summary);
  return event;
}

// ---- Files ---------------------------------------------------------------------------------

// The masking TFRecords apply to their CRCs (a CRC of data that itself holds CRCs is weak).
uint32_t masked_crc32c(std::string_view data) {
  const uint32_t crc = crc32c(data);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0')
    return "localhost";
  return name;
}

constexpr const char* kEventFilePrefix = "events.out.tfevents.";

// The time in the new file's name: now, or one second after the latest event file already in
// `dir` if that is later. TensorBoard reads a run's files in name order and a file's SessionLog
// START hides the steps from there on that the files before it logged, so a file that continues
// a run (a resumed run, or a fault-tolerant job's new writer, possibly on another host with its
// own clock, possibly within the same second) must sort after the files it continues.
constexpr long long kLatestFileTime = 9'999'999'999LL;

long long next_file_time(const std::string& dir) {
  long long latest = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!is_tensorboard_event_file(name))
      continue;
    const std::string_view digits = std::string_view(name).substr(std::strlen(kEventFilePrefix));
    long long t = 0;
    const auto [end, err] = std::from_chars(digits.data(), digits.data() + digits.size(), t);
    // Ten digits at most (as the names are written), so that the next one keeps ten as well.
    if (err == std::errc() && end != digits.data() && t < kLatestFileTime)
      latest = std::max(latest, t);
  }
  return std::max(static_cast<long long>(std::time(nullptr)), latest + 1);
}

}  // namespace

std::string tfrecord(std::string_view data) {
  std::string record;
  record.reserve(data.size() + 16);
  put_fixed(record, static_cast<uint64_t>(data.size()));
  put_fixed(record, masked_crc32c(record));
  record.append(data);
  put_fixed(record, masked_crc32c(data));
  return record;
}

bool is_tensorboard_event_file(const std::string& file_name) {
  return file_name.starts_with(kEventFilePrefix);
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir, int64_t first_step) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw std::runtime_error(fmt::format("{}: cannot create directory: {}", dir, ec.message()));
  // The same pattern as TensorFlow's writer ("%010lld"): zero-padded, so that TensorBoard,
  // which reads a run's files in name order, reads them in time order (next_file_time).
  const std::string path =
      (fs::path(dir) / fmt::format("{}{:010d}.{}.{}", kEventFilePrefix, next_file_time(dir),
                                   host_name(), ::getpid()))
          .string();
  // The temporary name must not contain "tfevents": TensorBoard reads every such file in the
  // directory, and would read this one half-written.
  static std::atomic<int> counter{0};
  const std::string tmp =
      (fs::path(dir) / fmt::format(".tensorboard-create.{}.{}", ::getpid(), counter++)).string();
  const double wall_time = now_seconds();
  const std::string first = tfrecord(file_version_event(wall_time)) +
                            tfrecord(session_start_event(wall_time, first_step));
  try {
    fsdp::File created(tmp, O_WRONLY | O_CREAT | O_EXCL, 0644, "create");
    created.write_all(first.data(), first.size());
    created.fsync();
    created.close();
  } catch (const std::exception& e) {
    ::unlink(tmp.c_str());
    throw std::runtime_error(
        fmt::format("{}: cannot create TensorBoard event file: {}", path, e.what()));
  }
  // link(2), unlike rename(2), fails when the name exists: two runs that start in the same
  // second on one host never overwrite each other's file.
  if (::link(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw std::runtime_error(
        fmt::format("{}: cannot create TensorBoard event file: {}{}", path, fsdp::errno_text(err),
                    err == EEXIST ? " (another run started in this directory this second)" : ""));
  }
  ::unlink(tmp.c_str());
  fsdp::fsync_path(dir, /*directory=*/true);
  file_ = fsdp::File(path, O_WRONLY | O_APPEND, 0644, "open for appending");
}

void TensorBoardWriter::write_scalars(int64_t step, const std::vector<TensorBoardScalar>& values,
                                      std::optional<double> wall_time) {
  const std::string record =
      tfrecord(scalars_event(wall_time.value_or(now_seconds()), step, values));
  file_.write_all(record.data(), record.size());
}

}  // namespace fsdp_trainer
