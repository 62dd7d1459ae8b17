// fsdp-plan's main() as a function (plan_main.cpp; plan_program.cpp calls it), so that a process
// other than a new fsdp-plan can run it: the tests' zygote (tests/harness/zygote.h) serves the
// trainer tests' fsdp-plan runs from copies of one loaded process, as it serves fsdp-train's.
#pragma once

#include <string>

namespace fsdp_trainer {

/// fsdp-plan's main(): returns its exit code.
int plan_main(int argc, char** argv);

/// The program whose `--calibration-rank FILE` runs a rank of the machine's calibration:
/// "/proc/self/exe", this process's own, unless set (a process that serves fsdp-plan's runs is
/// another program).
const std::string& plan_executable();
void set_plan_executable(std::string path);

}  // namespace fsdp_trainer
