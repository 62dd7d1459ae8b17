// A file written front to back, bypassing the page cache where the filesystem allows it.
//
// Why: a checkpoint's shard file is written once and not read back by this process, and on our
// machines a buffered write costs the CPU its copy into the page cache and its write-back: 512 MB
// written with fsync took 1.17 s of kernel CPU on a 2-core VM (dd conv=fsync), against 0.08 s
// with O_DIRECT (oflag=direct), which also finished sooner (0.45 s against 1.37 s). An
// asynchronous checkpoint's writer shares the cores with training, so that CPU is taken from
// the steps. O_DIRECT wants the memory, the file offset and the length of every write aligned
// to the device's block: the bytes go through an aligned buffer and leave it in whole blocks,
// and the last, padded block is cut off with ftruncate when the file is finished.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <fsdp/core/file.h>

namespace fsdp {

class SequentialFile {
 public:
  /// The alignment of O_DIRECT writes' memory, offsets and lengths: a multiple of every block
  /// size in use (512 B and 4 KiB devices). Memory aligned to it is written without a copy.
  static constexpr uint64_t kAlign = 4096;

  /// Creates (or truncates) `path`. Where the filesystem refuses O_DIRECT (at open: tmpfs before
  /// Linux 6.6; or at the first write, EINVAL), or with FSDP_DIRECT_WRITES=0 in the
  /// environment, every write (from then on) is a plain one. The
  /// buffer (`buffer_bytes`, 16 MiB by default) is host memory outside fsdp::memory's tensor
  /// accounting, allocated on the first write that needs it. Throws std::runtime_error naming
  /// the file.
  explicit SequentialFile(std::string path, uint64_t buffer_bytes = uint64_t{16} << 20);
  ~SequentialFile();
  SequentialFile(const SequentialFile&) = delete;
  SequentialFile& operator=(const SequentialFile&) = delete;

  /// Writes `len` bytes at `offset`. Bytes that continue the file's front (offset = every byte
  /// before it already given) go through the aligned buffer (allocated on first use), or
  /// straight to the file where they are page-aligned in memory and nothing is buffered (a
  /// whole image written from aligned memory is never copied); any other write first writes what
  /// the buffer holds and ends direct writing for the rest of the file (plain pwrite from then
  /// on), so writes in any order still give the same file.
  void pwrite(const void* src, uint64_t len, uint64_t offset);
  /// Writes what the buffer holds, sets the size to the furthest byte given, fsyncs and closes.
  /// Throws on an I/O error.
  void finish();

  const std::string& path() const { return file_.path(); }
  /// Whether writes still bypass the page cache.
  bool direct() const { return direct_.is_open(); }

 private:
  void write_blocks(const unsigned char* p, uint64_t n, uint64_t at);
  void flush(bool pad);
  void drop_buffer();
  void leave_direct();

  File file_;    // the plain descriptor (size, fsync, out-of-order writes)
  File direct_;  // O_DIRECT on the same file while writes come in order
  std::unique_ptr<unsigned char, void (*)(void*)> buffer_;
  uint64_t capacity_ = 0;
  uint64_t buffer_at_ = 0;  // the file offset of the buffer's first byte
  uint64_t buffered_ = 0;
  uint64_t end_ = 0;  // the furthest byte given
};

}  // namespace fsdp
