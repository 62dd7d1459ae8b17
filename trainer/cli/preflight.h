// What fsdp-train checks of a job before it starts any rank or joins one: the checks that need
// neither data nor a model built, so that a bad configuration fails once, in a second, with one
// line. main() runs them; the tests run the same function in-process for each way a
// configuration can be refused (a process per case costs ~0.5 s of LibTorch's start-up).
#pragma once

#include <string>

#include "config/config.h"

namespace fsdp_trainer {

/// Refuses (ConfigError) what the job's shape rules out for `config` run as `command` (train,
/// finetune, export or generate) on `world_size` ranks, `local_world_size` of them on this
/// host: a data.dir that prepared data must not go into (train), sizes that do not divide the
/// ranks (validate_world), a model that cannot fit this host (check_model_fits; not for
/// finetune, whose model is known once its file is read).
void preflight(const Config& config, const std::string& command, int world_size,
               int local_world_size);

}  // namespace fsdp_trainer
