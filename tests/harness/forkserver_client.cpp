// The client of the tests' fork servers (tests/python/forkserver.py, a Python that has imported
// torch and transformers; tests/harness/zygote.h, a test binary loaded once):
//
//     fsdp_forkserver_client SOCKET PROGRAM [ARGS...]
//
// runs PROGRAM (a .py script, or a program the server serves) through the server listening on
// SOCKET, as a process of the server's forking, with this process's arguments, working
// directory, environment, stdin, stdout and stderr, and exits with its status. Where no server
// answers, or it refuses the request (not its program, its binary rebuilt, an environment it
// cannot take), the client becomes PROGRAM itself (a script in FSDP_CLIENT_PYTHON): the same
// result, slower.
//
// CTest runs it for each of ~470 tests and the tests for ~230 programs: a process that starts in
// about a millisecond, where the same client in Python took 20 ms of CPU (interpreter and imports),
// 15 CPU-seconds a suite. It links nothing but the C++ library and nlohmann/json; why C++ and not
// a shell script: the request carries three file descriptors (SCM_RIGHTS), which no shell sends.
//
// The wire format (zygote.cpp and forkserver.py read it): an 8-byte little-endian length, then
// that many bytes of JSON {"argv", "cwd", "env"}, the first bytes sent with the descriptors of
// stdin, stdout and stderr; the server answers with the run's exit status in decimal, or
// "refused", and closes. The connection stays open while the run runs: this client's death
// closes it, and the server kills the run.
#include <nlohmann/json.hpp>

#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

// A server still importing (started with the tests, CTest's fixture) is waited for this long.
constexpr auto kStartupWait = std::chrono::seconds(120);

bool ends_with(const std::string& s, const std::string& end) {
  return s.size() >= end.size() && s.compare(s.size() - end.size(), end.size(), end) == 0;
}

// Becomes `argv` (a script: in FSDP_CLIENT_PYTHON).
[[noreturn]] void run_directly(std::vector<std::string> argv) {
  if (ends_with(argv[0], ".py") || argv[0].rfind('-', 0) == 0)
    argv.insert(argv.begin(), FSDP_CLIENT_PYTHON);
  std::vector<char*> args;
  for (auto& a : argv)
    args.push_back(a.data());
  args.push_back(nullptr);
  ::execv(args[0], args.data());
  std::fprintf(stderr, "fsdp_forkserver_client: cannot run %s: %s\n", args[0],
               std::strerror(errno));
  std::exit(127);
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// Waits while the server loads: SOCKET.starting exists (empty, then holding the server's pid)
// until the socket listens. A server that died loading is not waited for.
void wait_for_server(const std::string& sock) {
  const auto deadline = std::chrono::steady_clock::now() + kStartupWait;
  while (!exists(sock) && std::chrono::steady_clock::now() < deadline) {
    std::ifstream marker(sock + ".starting");
    if (!marker)
      return;
    long pid = 0;
    if (marker >> pid && pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0)
      return;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

int connect_to(const std::string& sock) {
  sockaddr_un addr{};
  if (sock.size() >= sizeof(addr.sun_path))
    return -1;
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, sock.c_str(), sock.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return -1;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// {"argv", "cwd", "env"}; empty where a string is not UTF-8 (JSON cannot carry it: run directly).
std::string request_of(const std::vector<std::string>& argv) {
  nlohmann::json body;
  body["argv"] = argv;
  std::vector<char> cwd(4096);
  body["cwd"] = ::getcwd(cwd.data(), cwd.size()) ? std::string(cwd.data()) : std::string("/");
  auto& env = body["env"] = nlohmann::json::object();
  for (char** e = environ; *e; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (eq)
      env[std::string(*e, static_cast<size_t>(eq - *e))] = std::string(eq + 1);
  }
  std::string json;
  try {
    json = body.dump();
  } catch (const nlohmann::json::type_error&) {  // invalid UTF-8
    return {};
  }
  std::string framed(8, '\0');
  for (int i = 0; i < 8; ++i)
    framed[static_cast<size_t>(i)] = static_cast<char>((uint64_t{json.size()} >> (8 * i)) & 0xff);
  return framed + json;
}

// Sends the request, the descriptors 0, 1, 2 with its first bytes.
bool send_request(int conn, const std::string& request) {
  iovec iov{const_cast<char*>(request.data()), request.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(3 * sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(3 * sizeof(int));
  const int fds[3] = {0, 1, 2};
  std::memcpy(CMSG_DATA(cmsg), fds, sizeof(fds));
  ssize_t sent;
  do {
    sent = ::sendmsg(conn, &msg, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  if (sent < 0)
    return false;
  for (size_t at = static_cast<size_t>(sent); at < request.size();) {
    const ssize_t n = ::send(conn, request.data() + at, request.size() - at, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return false;
    at += static_cast<size_t>(n);
  }
  return true;
}

// The server's answer, read until it closes.
std::string reply_of(int conn) {
  std::string reply;
  char buf[64];
  for (;;) {
    const ssize_t n = ::recv(conn, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      break;
    reply.append(buf, static_cast<size_t>(n));
  }
  return reply;
}

// The run's status: "-?[0-9]+" (surrounding blanks allowed), else 1 (the run died before
// reporting one: killed, or the server stopped).
int status_of(const std::string& reply) {
  const auto first = reply.find_first_not_of(" \t\r\n");
  if (first == std::string::npos)
    return 1;
  const auto last = reply.find_last_not_of(" \t\r\n");
  const std::string s = reply.substr(first, last - first + 1);
  const size_t digits = s[0] == '-' ? 1 : 0;
  if (s.size() == digits || s.find_first_not_of("0123456789", digits) != std::string::npos ||
      s.size() > 12)
    return 1;
  return static_cast<int>(std::stol(s));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s SOCKET PROGRAM [ARGS...]\n", argv[0]);
    return 2;
  }
  const std::string sock = argv[1];
  const std::vector<std::string> program(argv + 2, argv + argc);
  if (program[0].rfind('-', 0) == 0)  // Python's own options: never served
    run_directly(program);
  wait_for_server(sock);
  const std::string request = request_of(program);
  const int conn = request.empty() ? -1 : connect_to(sock);
  if (conn < 0)
    run_directly(program);
  if (!send_request(conn, request)) {
    ::close(conn);
    run_directly(program);
  }
  const std::string reply = reply_of(conn);
  ::close(conn);
  if (reply == "refused")
    run_directly(program);
  return status_of(reply);
}
