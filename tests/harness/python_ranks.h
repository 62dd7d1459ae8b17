// Ranks of a Python script started as torchrun starts them, without torchrun: for tests that
// compare fsdp-cpp with PyTorch's own distributed code on the same machine.
//
// Why not torchrun: its agent is a Python process of its own, and each rank is a new Python
// that imports torch; on 2 cores that was about 10 s of a 22 s test. Through the tests' Python
// server (FSDP_PYTHON, tests/python/forkserver.py) each rank is a fork of a process that has
// imported torch already.
#pragma once

#include <string>

#include "harness/ports.h"

namespace fsdp::test {

/// A shell command that runs `ranks` copies of `python script_and_args` with the environment
/// torchrun gives its workers on one node (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
/// MASTER_ADDR=127.0.0.1 and a MASTER_PORT reserved for this test, on which rank 0 serves the
/// store), `env` ("NAME=value ..."), and one intra-op thread each; it waits for all of them,
/// and when one fails ends the others and exits 1, as torchrun's agent does. Neither argument
/// may hold a single quote.
inline std::string python_ranks_command(int ranks, const std::string& python,
                                        const std::string& script_and_args,
                                        const std::string& env = "") {
  const std::string n = std::to_string(ranks);
  std::string ids;
  for (int r = 0; r < ranks; ++r)
    ids += (r ? " " : "") + std::to_string(r);
  // The ranks' pids are polled: `wait PID` reports a rank that ended before it was called
  // (`wait -n` does not, and answers 127 once every rank has ended).
  const std::string body =
      "export OMP_NUM_THREADS=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
      std::to_string(reserved_port()) + " WORLD_SIZE=" + n + " LOCAL_WORLD_SIZE=" + n + " " + env +
      "; pids=; for r in " + ids + "; do RANK=$r LOCAL_RANK=$r " + python + " " + script_and_args +
      " & pids=\"$pids $!\"; done; while [ -n \"$pids\" ]; do left=; for p in $pids; do"
      " if kill -0 $p 2>/dev/null; then left=\"$left $p\"; elif ! wait $p; then kill $pids"
      " 2>/dev/null; exit 1; fi; done; pids=$left; [ -z \"$pids\" ] || sleep 0.1; done";
  return "bash -c '" + body + "'";
}

}  // namespace fsdp::test
