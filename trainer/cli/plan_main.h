// fsdp-plan's main() as a function (plan_main.cpp; plan_program.cpp calls it), so that a process
// other than a new fsdp-plan can run it: the tests' zygote (tests/harness/zygote.h) serves the
// trainer tests' fsdp-plan runs from copies of one loaded process, as it serves fsdp-train's.
#pragma once

namespace fsdp_trainer {

/// fsdp-plan's main(): returns its exit code.
int plan_main(int argc, char** argv);

}  // namespace fsdp_trainer
