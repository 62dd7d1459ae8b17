// fsdp_trainer_tests' zygote serves fsdp-train's and fsdp-plan's runs as well as its own tests
// (harness/zygote.h, serve_also): the trainer tests start fsdp-train about 170 times and fsdp-plan
// about 20, through the zygote's client (train_cmd() and plan_cmd() in test_trainer.cpp), and
// each run is then a copy of the loaded test binary running the program's main body
// (fsdp_trainer::train_main, fsdp_trainer::plan_main: the same libraries the programs link)
// instead of a new process paying LibTorch's static initialisers. Processes that must be new
// (a fault-tolerant job's restarted ranks, fsdp-plan's calibration ranks) are started from the
// program's own file, as the program starts them. A served run's /proc/PID/environ shows the
// zygote's start-up environment, not the run's (the kernel shows a process's environment as it
// was at exec), and so do its forked ranks': the tests find a fault-tolerant job's ranks by the
// pids its launcher prints, and torchrun's workers (clients of the zygote) by their environment
// (find_process_with_env).
#include "cli/launcher.h"
#include "cli/plan_main.h"
#include "cli/program_file.h"
#include "cli/train_main.h"
#include "harness/zygote.h"

namespace {

int run_fsdp_train(int argc, char** argv) {
  fsdp_trainer::set_program_file(FSDP_TRAIN_PATH);
  return fsdp_trainer::train_main(argc, argv);
}

int run_fsdp_plan(int argc, char** argv) {
  fsdp_trainer::set_program_file(FSDP_PLAN_PATH);
  return fsdp_trainer::plan_main(argc, argv);
}

[[maybe_unused]] const bool registered =
    (fsdp::test::serve_also(FSDP_TRAIN_PATH, run_fsdp_train),
     fsdp::test::serve_also(FSDP_PLAN_PATH, run_fsdp_plan), true);

}  // namespace
