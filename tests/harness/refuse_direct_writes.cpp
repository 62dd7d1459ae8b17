// Preloaded (LD_PRELOAD) into fsdp_tests by the test DirectWritesRefused.*: pwrite on a
// descriptor opened with O_DIRECT fails with EINVAL, as on a file system that takes the O_DIRECT
// open but wants another alignment, or checks only at write time. fsdp::SequentialFile must then
// write plainly (every checkpoint and export goes through it), not fail the save; no file system
// of our machines refuses at write time, so the refusal is made here.
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>

namespace {

using Pwrite = ssize_t (*)(int, const void*, size_t, off_t);

bool direct(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  return flags != -1 && (flags & O_DIRECT) != 0;
}

ssize_t refuse_direct(int fd, const void* buf, size_t n, off_t off, Pwrite real) {
  if (direct(fd)) {
    errno = EINVAL;
    return -1;
  }
  return real(fd, buf, n, off);
}

}  // namespace

extern "C" ssize_t pwrite(int fd, const void* buf, size_t n, off_t off) {
  static const auto real = reinterpret_cast<Pwrite>(::dlsym(RTLD_NEXT, "pwrite"));
  return refuse_direct(fd, buf, n, off, real);
}

extern "C" ssize_t pwrite64(int fd, const void* buf, size_t n, off_t off) {
  static const auto real = reinterpret_cast<Pwrite>(::dlsym(RTLD_NEXT, "pwrite64"));
  return refuse_direct(fd, buf, n, off, real);
}
