// See include/fsdp/core/file.h.
#include <fsdp/core/file.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace fsdp {

std::string errno_text(int err) {
  return std::strerror(err);
}

File::File(std::string path, int flags, mode_t mode, const char* action)
    : path_(std::move(path)), fd_(::open(path_.c_str(), flags | O_CLOEXEC, mode)) {
  if (fd_ < 0)
    throw std::runtime_error(path_ + ": cannot " + action + ": " + errno_text(errno));
}

File::~File() {
  if (fd_ >= 0)
    ::close(fd_);  // errors are for close() to report; a destructor cannot
}

File::File(File&& other) noexcept
    : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)) {}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0)
      ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

uint64_t File::size() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0)
    throw std::runtime_error(path_ + ": cannot stat: " + errno_text(errno));
  return static_cast<uint64_t>(st.st_size);
}

uint64_t File::pread_some(void* dst, uint64_t len, uint64_t offset) const {
  auto* out = static_cast<char*>(dst);
  uint64_t done = 0;
  while (done < len) {
    const ssize_t got = ::pread(fd_, out + done, len - done, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR)
      continue;
    if (got < 0)
      throw std::runtime_error(path_ + ": read failed: " + errno_text(errno));
    if (got == 0)
      break;  // end of file
    done += static_cast<uint64_t>(got);
  }
  return done;
}

void File::pwrite_all(const void* src, uint64_t len, uint64_t offset) const {
  const auto* in = static_cast<const char*>(src);
  uint64_t done = 0;
  while (done < len) {
    const ssize_t put = ::pwrite(fd_, in + done, len - done, static_cast<off_t>(offset + done));
    if (put < 0 && errno == EINTR)
      continue;
    if (put <= 0)
      throw std::runtime_error(path_ + ": write failed: " + errno_text(put < 0 ? errno : ENOSPC));
    done += static_cast<uint64_t>(put);
  }
}

void File::write_all(const void* src, uint64_t len) const {
  const auto* in = static_cast<const char*>(src);
  uint64_t done = 0;
  while (done < len) {
    const ssize_t put = ::write(fd_, in + done, len - done);
    if (put < 0 && errno == EINTR)
      continue;
    if (put <= 0)
      throw std::runtime_error(path_ + ": write failed: " + errno_text(put < 0 ? errno : ENOSPC));
    done += static_cast<uint64_t>(put);
  }
}

void File::fsync() const {
  if (::fsync(fd_) != 0)
    throw std::runtime_error(path_ + ": fsync failed: " + errno_text(errno));
}

void File::close() {
  if (fd_ < 0)
    return;
  const int rc = ::close(std::exchange(fd_, -1));
  if (rc != 0)
    throw std::runtime_error(path_ + ": close failed: " + errno_text(errno));
}

}  // namespace fsdp
