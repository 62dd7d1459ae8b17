// Runs a shell command as a user would, for tests of the programs and of Python's view of our
// files.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

namespace fsdp::test {

struct CommandResult {
  int code = -1;       // exit status, 128 + signal if killed, -1 if it could not start
  std::string output;  // stdout and stderr
};

// FSDP_TEST_COMMAND_LOG=FILE: each command a test runs appends a line to FILE (the test, the
// command's wall seconds, the CPU seconds of the children this process reaped meanwhile, the
// command): where a test's time goes. The CPU figure is the command's own when it runs alone;
// a command started beside the test's work also counts what the test reaped in between, and a
// script run through the Python server (tests/python/forkserver.py) counts only its client.
class CommandTimer {
 public:
  explicit CommandTimer(std::string command)
      : command_(std::move(command)), start_(std::chrono::steady_clock::now()) {
    ::getrusage(RUSAGE_CHILDREN, &usage_);
  }
  ~CommandTimer() {
    const char* log = std::getenv("FSDP_TEST_COMMAND_LOG");
    if (!log || !*log)
      return;
    rusage now{};
    ::getrusage(RUSAGE_CHILDREN, &now);
    const auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec / 1e6; };
    const double cpu = seconds(now.ru_utime) + seconds(now.ru_stime) - seconds(usage_.ru_utime) -
                       seconds(usage_.ru_stime);
    const double wall =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
    std::ofstream(log, std::ios::app)
        << (test ? std::string(test->test_suite_name()) + "." + test->name() : "?") << '\t' << wall
        << '\t' << cpu << '\t' << command_.substr(0, 300) << '\n';
  }

 private:
  std::string command_;
  std::chrono::steady_clock::time_point start_;
  rusage usage_{};
};

inline CommandResult run_command(const std::string& command) {
  const CommandTimer timer(command);
  CommandResult r;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (!pipe)
    return r;
  std::array<char, 4096> buf{};
  while (fgets(buf.data(), buf.size(), pipe))
    r.output += buf.data();
  const int status = pclose(pipe);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

// A command started now and waited for later: a Python reference spends seconds importing torch
// and transformers (5-8 s on our 2-core machine), which then overlap with the test's own work.
// A reference that reads our output (an exported adapter, say) takes --wait: it imports and
// loads what it can, then blocks on a line of its standard input, which finish() writes once
// the test has written its files. Destroyed unfinished (a failed ASSERT), the command sees its
// input end, and a waiting reference exits.
class StartedCommand {
 public:
  explicit StartedCommand(const std::string& command)
      : timer_(std::make_unique<CommandTimer>(command)) {
    char path[] = "/tmp/fsdp-test-command-XXXXXX";
    const int fd = ::mkstemp(path);
    if (fd < 0)
      return;
    ::close(fd);
    output_path_ = path;
    pipe_ = ::popen((command + " > " + output_path_ + " 2>&1").c_str(), "w");
  }
  StartedCommand(const StartedCommand&) = delete;
  StartedCommand& operator=(const StartedCommand&) = delete;
  ~StartedCommand() { finish(); }

  // Writes `line` (if any) to the command's input, closes it and waits for the command.
  CommandResult finish(const std::string& line = "") {
    CommandResult r;
    if (!pipe_)
      return r;
    if (!line.empty()) {
      // A command that already exited has closed its end: without this, writing to it would
      // raise SIGPIPE and kill the test instead of failing it.
      struct sigaction ignore {
      }, previous{};
      ignore.sa_handler = SIG_IGN;
      ::sigaction(SIGPIPE, &ignore, &previous);
      std::fputs((line + "\n").c_str(), pipe_);
      std::fflush(pipe_);
      ::sigaction(SIGPIPE, &previous, nullptr);
    }
    const int status = ::pclose(pipe_);
    pipe_ = nullptr;
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    std::ifstream in(output_path_, std::ios::binary);
    std::ostringstream out;
    out << in.rdbuf();
    r.output = out.str();
    ::unlink(output_path_.c_str());
    timer_.reset();
    return r;
  }

 private:
  FILE* pipe_ = nullptr;
  std::string output_path_;
  std::unique_ptr<CommandTimer> timer_;
};

}  // namespace fsdp::test
