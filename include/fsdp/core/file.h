// One open file, the POSIX way the checkpoint, optimizer-state and model-file code needs it:
// positioned reads and writes of exact byte ranges (pread/pwrite, retried on EINTR and on
// short transfers), fsync, and a close that reports write-back errors. Owned: the descriptor
// is closed when the File dies. Written by hand because std::fstream has neither positioned
// I/O without a shared cursor nor fsync, and every error here names the file.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

namespace fsdp {

/// strerror(err) ("No such file or directory").
std::string errno_text(int err);

class File;

/// Opens `path` for reading if it is a regular file (links followed). A FIFO, device, socket
/// or directory is refused at once: the open cannot block (O_NONBLOCK) and the check is the
/// descriptor's own fstat, so nothing can swap the file in between. Throws std::runtime_error
/// "<path>: cannot <action>: <reason>" or "<path>: not a regular file (a FIFO)".
File open_regular(const std::string& path, const char* action = "open");

/// The whole of the small file `path` (an index, a config.json, a meta.json): a regular file
/// (open_regular) of at most `max_bytes`, refused otherwise before anything is read, so that
/// a link to /dev/zero or a multi-GB file costs nothing. Throws std::runtime_error naming the
/// file ("<path>: 9000000000 bytes, more than the 67108864 a metadata file may have").
std::string read_small_file(const std::string& path, uint64_t max_bytes = uint64_t{64} << 20);

class File {
 public:
  File() = default;
  /// open(2) of `path` with `flags` (O_CLOEXEC is added). On failure throws
  /// std::runtime_error "<path>: cannot <action>: <reason>".
  File(std::string path, int flags, mode_t mode = 0644, const char* action = "open");
  ~File();
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  bool is_open() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  /// The file's size (fstat).
  uint64_t size() const;

  /// Reads up to `len` bytes at `offset`; fewer only where the file ends. Returns the count.
  /// Throws "<path>: read failed: <reason>".
  uint64_t pread_some(void* dst, uint64_t len, uint64_t offset) const;
  /// Writes all `len` bytes at `offset`. Throws "<path>: write failed: <reason>" (a write
  /// that makes no progress reports ENOSPC).
  void pwrite_all(const void* src, uint64_t len, uint64_t offset) const;
  /// Appends all `len` bytes at the current position (files opened for a sequential write).
  void write_all(const void* src, uint64_t len) const;
  /// Throws "<path>: fsync failed: <reason>".
  void fsync() const;
  /// Closes now and reports the error a delayed write-back may surface here. Idempotent.
  void close();

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace fsdp
