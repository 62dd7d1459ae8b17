// See include/fsdp/durable_file.h.
#include <fsdp/durable_file.h>

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace fsdp {
namespace {

namespace fs = std::filesystem;

std::string parent_of(const std::string& path) {
  const fs::path p(path);
  return p.has_parent_path() ? p.parent_path().string() : std::string(".");
}

}  // namespace

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_DIRECTORY : 0) | O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    throw std::runtime_error(path + ": cannot open to fsync: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0)
    throw std::runtime_error(path + ": fsync failed: " + std::strerror(err));
}

void rename_durably(const std::string& from, const std::string& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  if (ec)
    throw std::runtime_error("cannot rename " + from + " to " + to + ": " + ec.message());
  fsync_path(parent_of(to), /*directory=*/true);
}

void write_file_atomic(const std::string& path, std::string_view bytes) {
  static std::atomic<uint64_t> counter{0};
  const fs::path target(path);
  const fs::path dir = parent_of(path);
  // Hidden, and unique per process and call, so concurrent writers never share a temporary.
  std::string tmp_name(".");  // (built by appends: GCC 12 misreports "." + string as -Wrestrict)
  tmp_name += target.filename().string();
  tmp_name += ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  const fs::path tmp = dir / tmp_name;
  auto fail = [&](const std::string& step, int err) {
    ::unlink(tmp.c_str());
    throw std::runtime_error(path + ": cannot write: " + step + ": " + std::strerror(err));
  };
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0)
    throw std::runtime_error(path + ": cannot write: creating " + tmp.string() + ": " +
                             std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t put = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (put < 0) {
      if (errno == EINTR)
        continue;
      const int err = errno;
      ::close(fd);
      fail("write", err);
    }
    done += static_cast<size_t>(put);
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    fail("fsync", err);
  }
  if (::close(fd) != 0)
    fail("close", errno);
  if (::rename(tmp.c_str(), path.c_str()) != 0)
    fail("rename", errno);
  // The rename is durable only once the directory entry is.
  fsync_path(dir.string(), /*directory=*/true);
}

}  // namespace fsdp
