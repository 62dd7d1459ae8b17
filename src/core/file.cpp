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

File open_regular(const std::string& path, const char* action) {
  File f(path, O_RDONLY | O_NONBLOCK, 0644, action);
  struct stat st {};
  if (::fstat(f.fd(), &st) != 0)
    throw std::runtime_error(path + ": cannot stat: " + errno_text(errno));
  if (!S_ISREG(st.st_mode)) {
    const char* kind = S_ISDIR(st.st_mode)    ? "a directory"
                       : S_ISFIFO(st.st_mode) ? "a FIFO"
                       : S_ISCHR(st.st_mode)  ? "a character device"
                       : S_ISBLK(st.st_mode)  ? "a block device"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                                              : "not a file";
    throw std::runtime_error(path + ": not a regular file (" + kind + ")");
  }
  // Reads of a regular file never block anyway; clearing the flag keeps the descriptor plain.
  const int flags = ::fcntl(f.fd(), F_GETFL);
  if (flags >= 0)
    ::fcntl(f.fd(), F_SETFL, flags & ~O_NONBLOCK);
  return f;
}

std::string read_small_file(const std::string& path, uint64_t max_bytes) {
  const File f = open_regular(path);
  const uint64_t size = f.size();
  if (size > max_bytes)
    throw std::runtime_error(path + ": " + std::to_string(size) + " bytes, more than the " +
                             std::to_string(max_bytes) + " this file may have");
  std::string out(static_cast<size_t>(size), '\0');
  const uint64_t got = f.pread_some(out.data(), size, 0);
  out.resize(static_cast<size_t>(got));  // a file that shrank meanwhile: what is there
  return out;
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
