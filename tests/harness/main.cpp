// The main() of every test binary: GoogleTest in the parent, a single worker in the ranks, and
// under CTest a zygote that forks a copy of itself per test (harness/zygote.h).
//
// run_workers() starts ranks with FSDP_TEST_WORKER=<name> (harness/multiprocess.h); such a
// process runs that worker and exits with its code instead of running the tests.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "harness/multiprocess.h"
#include "harness/zygote.h"

namespace {

// What a new process of this binary runs: in main(), or in a copy the zygote forked.
int run(int argc, char** argv) {
  if (const char* worker = std::getenv("FSDP_TEST_WORKER")) {
    const int code = fsdp::test::worker_main(worker);
    std::fflush(stdout);
    std::fflush(stderr);
    // Skip static destructors: a worker that kept a process group alive would otherwise race
    // its Gloo threads against LibTorch's teardown and could crash after having passed.
    std::_Exit(code);
  }
  // The tests' own computations (a reference, a file to load) run on one intra-op thread, as
  // each rank does: two tests run at once on two cores, and a test process without OpenMP's
  // threads has none but its own, so that run_workers() forks its ranks instead of executing
  // the binary anew (harness/multiprocess.h: 0.3 s of CPU per rank; the Hugging Face tests
  // executed about 40 a suite).
  at::set_num_threads(1);
  ::testing::InitGoogleTest(&argc, argv);
  const int code = RUN_ALL_TESTS();
  std::fflush(stdout);
  std::fflush(stderr);
  // Skip static destructors here too: LibTorch's (its operator registry) and freeing the heap
  // piece by piece took 0.12 s after every test, when most tests take a few milliseconds. The
  // tests leave nothing for a destructor to clean: their files and processes are theirs to end.
  std::_Exit(code);
}

}  // namespace

int main(int argc, char** argv) {
  // Started by tests/python/forkserver.py for CTest's fixture (tests/CMakeLists.txt).
  if (const char* socket = std::getenv("FSDP_TEST_ZYGOTE")) {
    const char* owner = std::getenv("FSDP_TEST_ZYGOTE_OWNER");
    const std::string path = socket;
    ::unsetenv("FSDP_TEST_ZYGOTE");
    ::unsetenv("FSDP_TEST_ZYGOTE_OWNER");
    return fsdp::test::serve_as_zygote(path, owner ? std::atoi(owner) : 1, run);
  }
  return run(argc, argv);
}
