// See include/fsdp/core/durable_file.h.
#include <fsdp/core/durable_file.h>

#include <fsdp/core/file.h>

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
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
  File f(path, (directory ? O_DIRECTORY : 0) | O_RDONLY, 0, "open to fsync");
  f.fsync();
  f.close();
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
  try {
    File f(tmp.string(), O_WRONLY | O_CREAT | O_EXCL, 0644, "create");
    f.write_all(bytes.data(), bytes.size());
    f.fsync();
    f.close();
  } catch (const std::exception& e) {
    ::unlink(tmp.c_str());
    throw std::runtime_error(path + ": cannot write: " + e.what());
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw std::runtime_error(path + ": cannot write: rename: " + errno_text(err));
  }
  // The rename is durable only once the directory entry is.
  fsync_path(dir.string(), /*directory=*/true);
}

}  // namespace fsdp
