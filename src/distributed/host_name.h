// This machine's host name, as the flight recorder's dumps and the peers' progress reports
// name a rank's host. Private to src/distributed.
#pragma once

#include <unistd.h>

#include <string>

namespace fsdp::detail {

inline std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0)
    return "?";
  return buf;
}

}  // namespace fsdp::detail
