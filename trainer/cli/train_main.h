// fsdp-train's main() as a function (train_main.cpp; main.cpp calls it), so that a process
// other than a new fsdp-train can run it: the tests' zygote (tests/harness/zygote.h) serves the
// trainer tests' fsdp-train runs from copies of one loaded process instead of new ones.
#pragma once

namespace fsdp_trainer {

/// fsdp-train's main(): returns its exit code, or ends the process itself with it once a
/// command has run (quick_exit after flushing: LibTorch's static destructors are skipped).
int train_main(int argc, char** argv);

}  // namespace fsdp_trainer
