// A loopback port that stays free for the rest of the test process, for tests that must name
// MASTER_PORT themselves (rank 0 hosting the store, or no one listening at all).
//
// Why not bind(port 0) and close: the kernel hands that same port to the next bind(0) of any
// process, and ctest -j runs other tests whose stores bind(0) meanwhile. CI once saw a test whose
// rank 0 was absent reach another test's live store on "its" port. So the port comes from below
// the ephemeral range (which bind(0) and outgoing connections never use) and is claimed with a
// lock file that this process holds until it exits, so concurrent tests never share one.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>

namespace fsdp::test {

namespace detail {

// The lower end of /proc/sys/net/ipv4/ip_local_port_range (Linux's default 32768).
inline int ephemeral_port_floor() {
  std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
  int lo = 0;
  if (!(in >> lo) || lo <= 0 || lo > 65535)
    lo = 32768;
  return lo;
}

inline bool bindable(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return ok;
}

}  // namespace detail

/// A port on 127.0.0.1 that nothing listens on now and that no other test process (of this
/// user) is handed while this process lives. Throws if none is found in 500 tries.
inline int reserved_port() {
  const int hi = detail::ephemeral_port_floor();  // exclusive
  const int lo = hi > 12000 ? hi - 10000 : 1024;
  if (hi - lo < 100)
    throw std::runtime_error("reserved_port: the ephemeral port range leaves no room below it");
  const auto dir =
      std::filesystem::temp_directory_path() / ("fsdp-test-ports-" + std::to_string(::getuid()));
  std::filesystem::create_directories(dir);
  std::mt19937 pick(std::random_device{}());
  std::uniform_int_distribution<int> in_range(lo, hi - 1);
  for (int attempt = 0; attempt < 500; ++attempt) {
    const int port = in_range(pick);
    const auto lock = dir / (std::to_string(port) + ".lock");
    const int fd = ::open(lock.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0)
      continue;
    // Held (the descriptor deliberately left open) until this process exits; the kernel
    // drops the lock then, even on a crash.
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0 && detail::bindable(port))
      return port;
    ::close(fd);
  }
  throw std::runtime_error("reserved_port: no free port below " + std::to_string(hi) +
                           " after 500 tries (lock files in " + dir.string() + ")");
}

}  // namespace fsdp::test
