// fsdp_trainer_tests' zygote serves fsdp-train's runs as well as its own tests
// (harness/zygote.h, serve_also): the trainer tests start fsdp-train about 170 times, through
// the zygote's client (train_cmd() in test_trainer.cpp), and each run is then a copy of the
// loaded test binary running fsdp-train's main body (fsdp_trainer::train_main, the same
// library fsdp-train links) instead of a new process paying LibTorch's static initialisers.
// Ranks that must be new processes (a fault-tolerant job's, restarted ones) are started from
// fsdp-train's file, as fsdp-train starts them. A served run's /proc/PID/environ shows the
// zygote's start-up environment, not the run's (the kernel shows a process's environment as it
// was at exec): tests that find a process by its environment (find_process_with_env) find
// those new processes, and torchrun's workers, which are their clients.
#include "cli/launcher.h"
#include "cli/train_main.h"
#include "harness/zygote.h"

namespace {

int run_fsdp_train(int argc, char** argv) {
  fsdp_trainer::set_trainer_executable(FSDP_TRAIN_PATH);
  return fsdp_trainer::train_main(argc, argv);
}

[[maybe_unused]] const bool registered =
    (fsdp::test::serve_also(FSDP_TRAIN_PATH, run_fsdp_train), true);

}  // namespace
