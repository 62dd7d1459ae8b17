// The main() of every test binary: GoogleTest in the parent, a single worker in the ranks.
//
// run_workers() re-executes this binary with FSDP_TEST_WORKER=<name> (harness/multiprocess.h);
// such a process runs that worker and exits with its code instead of running the tests.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

#include "harness/multiprocess.h"

int main(int argc, char** argv) {
  if (const char* worker = std::getenv("FSDP_TEST_WORKER")) {
    const int code = fsdp::test::worker_main(worker);
    std::fflush(stdout);
    std::fflush(stderr);
    // Skip static destructors: a worker that kept a process group alive would otherwise race
    // its Gloo threads against LibTorch's teardown and could crash after having passed.
    std::_Exit(code);
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
