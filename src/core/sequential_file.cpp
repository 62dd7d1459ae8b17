// See include/fsdp/core/sequential_file.h.
#include <fsdp/core/sequential_file.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

namespace fsdp {
namespace {

constexpr uint64_t kAlign = SequentialFile::kAlign;

unsigned char* aligned_buffer(uint64_t bytes) {
  void* p = std::aligned_alloc(kAlign, bytes);
  if (!p)
    throw std::bad_alloc();
  return static_cast<unsigned char*>(p);
}

// FSDP_DIRECT_WRITES=0: every write plain (through the page cache), for measuring what the
// direct path saves (bench/async_checkpoint.py). Read once.
bool direct_writes_allowed() {
  static const bool allowed = [] {
    const char* v = std::getenv("FSDP_DIRECT_WRITES");
    return !(v && std::string(v) == "0");
  }();
  return allowed;
}

}  // namespace

SequentialFile::SequentialFile(std::string path, uint64_t buffer_bytes)
    : file_(path, O_WRONLY | O_CREAT | O_TRUNC, 0644, "create"),
      buffer_(nullptr, std::free),
      capacity_(std::max(kAlign, buffer_bytes / kAlign * kAlign)) {
  if (!direct_writes_allowed())
    return;
  try {
    direct_ = File(path, O_WRONLY | O_DIRECT, 0644, "open for direct writes");
  } catch (const std::runtime_error&) {
    return;  // the filesystem does not do O_DIRECT (EINVAL): plain writes
  }
}

SequentialFile::~SequentialFile() = default;

void SequentialFile::pwrite(const void* src, uint64_t len, uint64_t offset) {
  end_ = std::max(end_, offset + len);
  if (direct_.is_open() && offset != buffer_at_ + buffered_)
    leave_direct();
  const auto* in = static_cast<const unsigned char*>(src);
  while (len > 0 && direct_.is_open()) {
    // Page-aligned memory at the (aligned) front with nothing buffered: its whole blocks go
    // straight to the file, with no copy (safetensors::Image's case).
    if (buffered_ == 0 && reinterpret_cast<uintptr_t>(in) % kAlign == 0 && len >= kAlign) {
      const uint64_t whole = len / kAlign * kAlign;
      write_blocks(in, whole, buffer_at_);
      buffer_at_ += whole, in += whole, len -= whole;
      continue;
    }
    if (!buffer_)
      buffer_.reset(aligned_buffer(capacity_));
    const uint64_t n = std::min(len, capacity_ - buffered_);
    std::memcpy(buffer_.get() + buffered_, in, n);
    buffered_ += n, in += n, len -= n;
    if (buffered_ == capacity_)
      flush(/*pad=*/false);
  }
  if (!direct_.is_open()) {  // plain from the start, left, or refused on the way
    drop_buffer();
    if (len > 0)
      file_.pwrite_all(in, len,
                       offset + static_cast<uint64_t>(in - static_cast<const unsigned char*>(src)));
  }
}

// O_DIRECT where it is still on; where the file system refuses a direct write (EINVAL: it wants
// a larger alignment than ours, or none of it), this write and every later one are plain.
void SequentialFile::write_blocks(const unsigned char* p, uint64_t n, uint64_t at) {
  while (n > 0 && direct_.is_open()) {
    const ssize_t put = ::pwrite(direct_.fd(), p, n, static_cast<off_t>(at));
    if (put < 0 && errno == EINTR)
      continue;
    if (put < 0 && errno == EINVAL) {
      direct_.close();
      break;
    }
    if (put <= 0)
      throw std::runtime_error(file_.path() +
                               ": write failed: " + errno_text(put < 0 ? errno : ENOSPC));
    p += put, at += static_cast<uint64_t>(put), n -= static_cast<uint64_t>(put);
  }
  if (n > 0)
    file_.pwrite_all(p, n, at);
}

// Writes the buffer's whole blocks at buffer_at_ (always block-aligned), and with `pad` its last
// partial block too, padded with zeros (finish() cuts the file back to end_). What is left (a
// partial block, without `pad`) moves to the buffer's start.
void SequentialFile::flush(bool pad) {
  if (buffered_ == 0)
    return;
  uint64_t whole = buffered_ / kAlign * kAlign;
  if (pad && whole < buffered_) {
    std::memset(buffer_.get() + buffered_, 0, kAlign - buffered_ % kAlign);
    whole += kAlign;
  }
  if (whole == 0)
    return;
  write_blocks(buffer_.get(), whole, buffer_at_);
  const uint64_t rest = buffered_ > whole ? buffered_ - whole : 0;
  std::memmove(buffer_.get(), buffer_.get() + whole, rest);
  buffer_at_ += whole;
  buffered_ = rest;
}

// What the buffer holds, written plainly, and the buffer freed.
void SequentialFile::drop_buffer() {
  if (buffered_ > 0)
    file_.pwrite_all(buffer_.get(), buffered_, buffer_at_);
  buffer_at_ += buffered_;
  buffered_ = 0;
  buffer_.reset();
}

void SequentialFile::leave_direct() {
  flush(/*pad=*/false);
  direct_.close();
  drop_buffer();  // the partial block
}

void SequentialFile::finish() {
  if (direct_.is_open()) {
    flush(/*pad=*/true);
    direct_.close();
  }
  drop_buffer();
  // The size is the furthest byte given: a padded last block is cut off.
  if (::ftruncate(file_.fd(), static_cast<off_t>(end_)) != 0)
    throw std::runtime_error(file_.path() + ": cannot set the size: " + errno_text(errno));
  file_.fsync();
  file_.close();
}

}  // namespace fsdp
