// See preflight.h.
#include "preflight.h"

#include "data/data.h"
#include "train/model_factory.h"

namespace fsdp_trainer {

void preflight(const Config& config, const std::string& command, int world_size,
               int local_world_size) {
  // Where prepared data would go (prepare_data checks again when it writes).
  if (command == "train") {
    if (const auto problem = data_dir_problem(config.data.dir); !problem.empty())
      throw ConfigError("'data.dir' " + problem);
  }
  validate_world(config, world_size, local_world_size);
  if (command != "finetune")
    check_model_fits(config, world_size, local_world_size);
}

}  // namespace fsdp_trainer
