// See zygote.h. The wire format is tests/python/forkserver.py's: the client
// (tests/harness/forkserver_client.cpp) sends an 8-byte little-endian length, then that many
// bytes of JSON ({"argv", "cwd", "env"}, or {"stop": true}), with its stdin, stdout and stderr
// attached (SCM_RIGHTS) to the first bytes; the reply is the run's exit status in decimal, or
// "refused".
#include "harness/zygote.h"

#include <nlohmann/json.hpp>

#include <fsdp/distributed/local_launch.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::test {
namespace {

constexpr uint64_t kMaxRequestBytes = 1 << 20;
constexpr auto kIdleLimit = std::chrono::hours(1);

struct Request {
  std::vector<int> fds;  // stdin, stdout, stderr
  nlohmann::json body;
};

void close_all(const std::vector<int>& fds) {
  for (int fd : fds)
    ::close(fd);
}

// Reads one request; nullopt on a malformed one (its descriptors closed).
std::optional<Request> receive(int conn) {
  Request r;
  std::string data;
  uint64_t need = 8;
  while (data.size() < need) {
    char buf[65536];
    alignas(cmsghdr) char control[CMSG_SPACE(3 * sizeof(int))];
    iovec iov{buf, sizeof(buf)};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = ::recvmsg(conn, &msg, MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR)
      continue;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; ++i) {
          int fd = -1;
          std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
          r.fds.push_back(fd);
        }
      }
    }
    if (n <= 0)
      break;
    data.append(buf, static_cast<size_t>(n));
    if (data.size() >= 8) {
      uint64_t len = 0;
      for (int i = 7; i >= 0; --i)
        len = (len << 8) | static_cast<unsigned char>(data[static_cast<size_t>(i)]);
      if (len > kMaxRequestBytes)
        break;
      need = 8 + len;
    }
  }
  if (r.fds.size() != 3 || data.size() != need) {
    close_all(r.fds);
    return std::nullopt;
  }
  r.body = nlohmann::json::parse(data.begin() + 8, data.end(), nullptr, /*exceptions=*/false);
  if (r.body.is_discarded() || !r.body.is_object()) {
    close_all(r.fds);
    return std::nullopt;
  }
  return r;
}

void reply(int conn, const std::string& text) {
  size_t off = 0;
  while (off < text.size()) {
    const ssize_t n = ::send(conn, text.data() + off, text.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return;
    off += static_cast<size_t>(n);
  }
}

bool same_file(const struct stat& a, const struct stat& b) {
  return a.st_dev == b.st_dev && a.st_ino == b.st_ino && a.st_mtim.tv_sec == b.st_mtim.tv_sec &&
         a.st_mtim.tv_nsec == b.st_mtim.tv_nsec;
}

// Whether argv[0] names the file `file` as it was when the zygote started.
bool names_file(const nlohmann::json& argv, const struct stat& file) {
  if (!argv.is_array() || argv.empty() || !argv[0].is_string())
    return false;
  struct stat st {};
  return ::stat(argv[0].get<std::string>().c_str(), &st) == 0 && same_file(st, file);
}

struct OtherProgram {
  std::string path;
  int (*run)(int, char**);
  struct stat file {};
};

std::vector<OtherProgram>& other_programs() {
  static std::vector<OtherProgram> programs;
  return programs;
}

// Variables a process reads as it starts (the dynamic loader, glibc's malloc and tunables,
// libgomp's and OpenBLAS's constructors) or at its first use of a kernel or primitive, which a copy
// that ran nothing would still do with its own environment (ATen's CPU capability, oneDNN's ISA
// limit): the zygote refuses another program's request whose values of these differ from its own,
// rather than rely on which are read when.
constexpr const char* kStartupOnlyPrefixes[] = {
    "LD_",   "GLIBC_", "MALLOC_", "OMP_",    "GOMP_", "KMP_",   "OPENBLAS_",
    "GOTO_", "MKL_",   "ATEN_",   "ONEDNN_", "DNNL_", "TORCH_", "PYTORCH_"};

bool startup_only(const std::string& name) {
  for (const char* prefix : kStartupOnlyPrefixes) {
    if (name.rfind(prefix, 0) == 0)
      return true;
  }
  return false;
}

std::map<std::string, std::string> startup_environment(const nlohmann::json& env) {
  std::map<std::string, std::string> out;
  if (!env.is_object())
    return out;
  for (auto it = env.begin(); it != env.end(); ++it) {
    if (startup_only(it.key()) && it->is_string())
      out[it.key()] = it->get<std::string>();
  }
  return out;
}

std::map<std::string, std::string> own_startup_environment() {
  std::map<std::string, std::string> out;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const size_t eq = entry.find('=');
    if (eq != std::string::npos && startup_only(entry.substr(0, eq)))
      out[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  return out;
}

// What runs a request in the copy: this binary's main() body, another program's, or nothing
// (refused).
int (*program_for(const nlohmann::json& body, const struct stat& self,
                  const std::map<std::string, std::string>& own_env,
                  int (*run)(int, char**)))(int, char**) {
  const auto argv = body.value("argv", nlohmann::json());
  if (names_file(argv, self))
    return run;
  for (const auto& other : other_programs()) {
    if (names_file(argv, other.file))
      return startup_environment(body.value("env", nlohmann::json())) == own_env ? other.run
                                                                                 : nullptr;
  }
  return nullptr;
}

// In the run's process: becomes what the client would have started, and runs main's body.
[[noreturn]] void become_run(const Request& r, int conn, int (*run)(int, char**)) {
  ::setpgid(0, 0);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sig != SIGKILL && sig != SIGSTOP)
      ::signal(sig, SIG_DFL);
  }
  for (int i = 0; i < 3; ++i)
    ::dup2(r.fds[static_cast<size_t>(i)], i);
  close_all(r.fds);
  ::close(conn);
  const std::string cwd = r.body.value("cwd", std::string("/"));
  if (::chdir(cwd.c_str()) != 0) {
    std::fprintf(stderr, "zygote: cannot enter %s: %s\n", cwd.c_str(), std::strerror(errno));
    std::_Exit(127);
  }
  ::clearenv();
  const auto env = r.body.find("env");
  if (env != r.body.end() && env->is_object()) {
    for (auto it = env->begin(); it != env->end(); ++it) {
      if (it->is_string())
        ::setenv(it.key().c_str(), it->get<std::string>().c_str(), 1);
    }
  }
  // Owned for the rest of the process, as main()'s argv is.
  auto* args = new std::vector<std::string>();
  for (const auto& a : r.body.at("argv"))
    args->push_back(a.get<std::string>());
  auto* argv = new std::vector<char*>();
  for (auto& a : *args)
    argv->push_back(a.data());
  argv->push_back(nullptr);
  std::exit(run(static_cast<int>(args->size()), argv->data()));
}

int decode(int status) {
  if (WIFEXITED(status))
    return WEXITSTATUS(status);
  if (WIFSIGNALED(status))
    return 128 + WTERMSIG(status);
  return 255;
}

// FSDP_TEST_CPU_LOG=FILE in the zygote's environment (CTest's): each run served appends its
// CPU seconds (its own and those of the processes it waited for: a test's forked ranks), its
// wall seconds and its arguments, tab-separated. What a test's time is spent on, beside
// FSDP_TEST_COMMAND_LOG's commands (docs/design.md, "Where a test's time goes").
void log_run(const Request& r, const rusage& usage, std::chrono::steady_clock::time_point started) {
  const char* path = std::getenv("FSDP_TEST_CPU_LOG");
  if (path == nullptr || *path == '\0')
    return;
  auto seconds = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  std::string line =
      std::to_string(seconds(usage.ru_utime) + seconds(usage.ru_stime)) + "\t" +
      std::to_string(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  for (const auto& a : r.body.at("argv"))
    line += "\t" + (a.is_string() ? a.get<std::string>() : std::string());
  line += "\n";
  // One write of the whole line (O_APPEND): the runs' managers append at once.
  const int fd = ::open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0)
    return;
  [[maybe_unused]] const ssize_t n = ::write(fd, line.data(), line.size());
  ::close(fd);
}

// Between the zygote and a run: starts the run, reports its status to the client, and kills
// it (its whole process group) if the client goes away first.
[[noreturn]] void manage_run(const Request& r, int conn, int (*run)(int, char**)) {
  ::signal(SIGCHLD, SIG_DFL);  // the zygote ignores its children; this one waits for its own
  const pid_t child = ::fork();
  if (child < 0) {
    reply(conn, "refused");
    std::_Exit(1);
  }
  if (child == 0)
    become_run(r, conn, run);
  ::setpgid(child, child);
  close_all(r.fds);
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, child, 0));
  int status = 0;
  rusage usage{};
  const auto started = std::chrono::steady_clock::now();
  while (true) {
    pollfd fds[2] = {{conn, POLLIN, 0}, {pidfd, POLLIN, 0}};
    // Without pidfds (Linux before 5.3), the child is polled every 20 ms.
    ::poll(fds, pidfd >= 0 ? 2 : 1, pidfd >= 0 ? -1 : 20);
    if (::wait4(child, &status, WNOHANG, &usage) == child)
      break;
    if (fds[0].revents != 0) {
      char byte = 0;
      if (::recv(conn, &byte, 1, MSG_DONTWAIT) == 0 || (fds[0].revents & (POLLHUP | POLLERR))) {
        ::kill(-child, SIGKILL);
        ::kill(child, SIGKILL);
        while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
        }
        std::_Exit(1);
      }
    }
  }
  log_run(r, usage, started);  // before the reply: its client's exit means the line is there
  reply(conn, std::to_string(decode(status)));
  std::_Exit(0);
}

bool alive(pid_t pid) {
  return ::kill(pid, 0) == 0 || errno == EPERM;
}

int listen_on(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const std::string tmp = path + "." + std::to_string(::getpid());
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (fd < 0 || tmp.size() >= sizeof(addr.sun_path))
    return -1;
  std::memcpy(addr.sun_path, tmp.c_str(), tmp.size() + 1);
  ::unlink(tmp.c_str());
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 64) != 0 ||
      ::rename(tmp.c_str(), path.c_str()) != 0) {  // clients see the socket once it listens
    ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

void serve_also(const std::string& path, int (*run)(int, char**)) {
  other_programs().push_back({path, run});
}

int serve_as_zygote(const std::string& socket_path, pid_t owner, int (*run)(int, char**)) {
  const std::string marker = socket_path + ".starting";
  std::ofstream(marker) << ::getpid();
  struct stat self {};
  std::error_code ec;
  const auto self_path = std::filesystem::read_symlink("/proc/self/exe", ec);
  for (auto& other : other_programs()) {
    if (::stat(other.path.c_str(), &other.file) != 0)
      other.file = {};  // matches no request (st_ino 0): that program runs as a process
  }
  const auto own_env = own_startup_environment();
  if (!fsdp::single_threaded() || ec || ::stat(self_path.c_str(), &self) != 0) {
    std::fprintf(stderr, "zygote: not single-threaded after static initialisation; not serving\n");
    ::unlink(marker.c_str());
    return 1;
  }
  const int listener = listen_on(socket_path);
  ::unlink(marker.c_str());
  if (listener < 0) {
    std::fprintf(stderr, "zygote: cannot listen on %s: %s\n", socket_path.c_str(),
                 std::strerror(errno));
    return 1;
  }
  ::signal(SIGCHLD, SIG_IGN);  // the managers are reaped by the kernel
  auto last = std::chrono::steady_clock::now();
  while (true) {
    pollfd p{listener, POLLIN, 0};
    if (::poll(&p, 1, 1000) <= 0) {
      struct stat st {};
      if (!alive(owner) || ::stat(socket_path.c_str(), &st) != 0 ||
          std::chrono::steady_clock::now() - last > kIdleLimit)
        break;
      continue;
    }
    const int conn = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0)
      continue;
    last = std::chrono::steady_clock::now();
    auto request = receive(conn);
    if (!request) {
      ::close(conn);
      continue;
    }
    if (request->body.value("stop", false)) {
      close_all(request->fds);
      ::close(conn);
      break;
    }
    const auto program = program_for(request->body, self, own_env, run);
    if (program == nullptr) {
      // Another binary, one rebuilt, or another program's request in another environment: the
      // client runs it itself.
      reply(conn, "refused");
      close_all(request->fds);
      ::close(conn);
      struct stat now {};
      if (::stat(self_path.c_str(), &now) != 0 || !same_file(now, self))
        break;  // rebuilt: every later request would be refused too
      continue;
    }
    const pid_t manager = ::fork();
    if (manager == 0) {
      ::close(listener);
      manage_run(*request, conn, program);
    }
    close_all(request->fds);
    ::close(conn);
  }
  ::close(listener);
  ::unlink(socket_path.c_str());
  return 0;
}

}  // namespace fsdp::test
