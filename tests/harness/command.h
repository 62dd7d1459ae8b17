// Runs a shell command as a user would, for tests of the programs and of Python's view of our
// files.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace fsdp::test {

struct CommandResult {
  int code = -1;       // exit status, 128 + signal if killed, -1 if it could not start
  std::string output;  // stdout and stderr
};

inline CommandResult run_command(const std::string& command) {
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

}  // namespace fsdp::test
