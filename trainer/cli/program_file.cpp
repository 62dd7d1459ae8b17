// See program_file.h.
#include "program_file.h"

#include <utility>

namespace fsdp_trainer {
namespace {

std::string& path() {
  static std::string p = "/proc/self/exe";
  return p;
}

}  // namespace

const std::string& program_file() {
  return path();
}

void set_program_file(std::string file) {
  path() = std::move(file);
}

}  // namespace fsdp_trainer
