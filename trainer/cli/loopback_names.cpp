// getnameinfo() for fsdp-train and the test binaries: a loopback address is named by its number,
// without asking DNS.
//
// c10d's TCPStore names the peer of every connection it makes or accepts (getnameinfo without
// NI_NUMERICHOST, for its log lines only), and the ranks of fsdp-train --nproc and of every
// multi-process test connect to a store on 127.0.0.1. A resolver that leaves some queries of a
// burst unanswered (our machines' does) makes glibc wait before asking again: 5 s per stalled
// connection by default, 1-2 s under the tests' RES_OPTIONS (tests/CMakeLists.txt).
// ProcessGroup.ThreeRanksRankZeroHostsTheStore took 0.34-0.47 s alone, and 5.45 s in one run of
// three before this file; nothing reads the name but a log line.
//
// Defined in the executable, it takes the place of libc's for LibTorch's calls too (the dynamic
// linker looks in the executable first); other addresses go to libc's own. Not in the library:
// a library has no business replacing a libc function for the program that links it.
#include <dlfcn.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

namespace {

bool is_loopback(const sockaddr* sa, socklen_t len) {
  if (sa == nullptr)
    return false;
  if (sa->sa_family == AF_INET && len >= static_cast<socklen_t>(sizeof(sockaddr_in))) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    return (ntohl(in->sin_addr.s_addr) >> 24) == 127;  // 127.0.0.0/8
  }
  if (sa->sa_family == AF_INET6 && len >= static_cast<socklen_t>(sizeof(sockaddr_in6))) {
    const auto& a = reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr;
    if (IN6_IS_ADDR_LOOPBACK(&a))
      return true;
    return IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127;  // ::ffff:127.x.y.z
  }
  return false;
}

}  // namespace

extern "C" int getnameinfo(const sockaddr* sa, socklen_t salen, char* host, socklen_t hostlen,
                           char* serv, socklen_t servlen, int flags) noexcept {
  using Fn = int (*)(const sockaddr*, socklen_t, char*, socklen_t, char*, socklen_t, int);
  static const Fn libc = reinterpret_cast<Fn>(::dlsym(RTLD_NEXT, "getnameinfo"));
  if (libc == nullptr)
    return EAI_SYSTEM;
  if (is_loopback(sa, salen))
    flags |= NI_NUMERICHOST;
  return libc(sa, salen, host, hostlen, serv, servlen, flags);
}
