// See read_file.h.
#include "read_file.h"

#include <cstdint>

#include <fsdp/core/file.h>

namespace fsdp_trainer {

std::string read_file(const std::string& path) {
  // "<path>: cannot read: <reason>"; a FIFO or a device (tokenizer.model linked to /dev/zero)
  // is refused at once instead of blocking or reading without end.
  const fsdp::File f = fsdp::open_regular(path, "read");
  std::string out;
  out.reserve(static_cast<size_t>(f.size()));
  char buf[1 << 16];
  for (uint64_t at = 0;;) {
    const uint64_t got = f.pread_some(buf, sizeof buf, at);
    out.append(buf, static_cast<size_t>(got));
    at += got;
    if (got < sizeof buf)
      return out;  // end of file
  }
}

}  // namespace fsdp_trainer
