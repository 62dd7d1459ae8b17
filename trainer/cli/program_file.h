// The file of the program this process runs (fsdp-train, fsdp-plan), for the processes it
// starts from that file: a fault-tolerant job's restarted ranks, the CUDA trainer beside
// fsdp-train, fsdp-plan's calibration ranks.
#pragma once

#include <string>

namespace fsdp_trainer {

/// "/proc/self/exe", this process's own file, unless set: a process that runs a program's main
/// without being that program's file (the tests' zygote, tests/harness/zygote.h) sets the
/// program's path first.
const std::string& program_file();
void set_program_file(std::string path);

}  // namespace fsdp_trainer
