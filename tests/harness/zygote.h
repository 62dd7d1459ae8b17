// A test binary serving CTest's runs of itself from one loaded copy (a "zygote").
//
// Each CTest entry of the two test binaries is one process that runs one GoogleTest test. Most
// tests take a tenth of a second; loading LibTorch and running its static initialisers (the
// operator registry) takes 0.25 s of CPU before main() on our 2-core machines, so process start
// was about a quarter of the suite's CPU. Under CTest, each binary instead runs once as a
// zygote: loaded and initialised, never having run a test, it forks a copy of itself for each
// run, which becomes that run's process (the client's arguments, working directory,
// environment, stdin, stdout and stderr; tests/harness/forkserver_client.cpp is the client
// CTest runs) and runs main() as a new process would. A copy is what a new process would be
// after its static initialisers: the zygote has run nothing else and has no thread but its own.
//
// A run's exit status goes back to its client; a client that dies (CTest's time-out) takes its
// run, and anything the run started, with it. A zygote refuses a request for another binary
// (unless it serves that program too: serve_also) or for its own file rebuilt since it started
// (the client then runs the binary itself) and ends when the process that started it (CTest) is
// gone, when its socket is removed, or when stopped.
#pragma once

#include <sys/types.h>

#include <string>

namespace fsdp::test {

/// Serves runs of this binary on the Unix socket `socket_path` until stopped; `run` is what a
/// new process would run (main's body). Returns the zygote's exit code (it never returns in a
/// copy: a run ends with exit()).
int serve_as_zygote(const std::string& socket_path, pid_t owner, int (*run)(int, char**));

/// Another program the zygote serves: a request whose argv[0] names `path` (the file as it was
/// when the zygote started) runs `run` (that program's main() body, linked into this binary) in
/// the copy. fsdp_trainer_tests serves fsdp-train this way (fsdp_trainer::train_main): the
/// trainer tests start it about 170 times, each start 0.2 s of LibTorch's static initialisers.
/// A request whose environment differs from the zygote's in a variable read only when a process
/// starts (the dynamic loader's, glibc's, OpenMP's, ATen's CPU dispatch, oneDNN's ISA limit:
/// kStartupOnlyPrefixes in zygote.cpp) is refused: the copy would run as the zygote started.
/// Call before serve_as_zygote (a static initialiser of the binary).
void serve_also(const std::string& path, int (*run)(int, char**));

}  // namespace fsdp::test
