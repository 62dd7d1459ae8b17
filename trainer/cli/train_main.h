// fsdp-train's main() as a function (train_main.cpp; main.cpp calls it), so that a process
// other than a new fsdp-train can run it: the tests' zygote (tests/harness/zygote.h) serves the
// trainer tests' fsdp-train runs from copies of one loaded process instead of new ones.
#pragma once

namespace fsdp_trainer {

/// What fsdp-train's main() does and returns.
int train_main(int argc, char** argv);

}  // namespace fsdp_trainer
