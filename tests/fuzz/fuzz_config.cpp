// libFuzzer target for fsdp-train's configuration (load_config, trainer/config/config.h): a TOML
// file and command-line overrides. The first input byte's bit 0 says `fsdp-train finetune`; the
// rest, up to the first NUL, is the file's text, and each NUL-separated piece after it (at most
// 8) one override "section.key=value", as the CLI passes them after stripping "--". Any input
// must load or be refused with ConfigError, never crash, hang or throw anything else.
// Invariants (traps): an error is one line; a loaded configuration passes validate() again, and
// its to_toml() (what --print-config writes) loads back to the same configuration. Built and run
// by scripts/fuzz.sh (docs/design.md, "Fuzzing").
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "config/config.h"

namespace {

std::string scratch_dir() {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir && *dir ? dir : "/tmp") + "/fuzz_config." + std::to_string(getpid());
}
const std::string& scratch(int which) {
  static const std::string paths[2] = {scratch_dir() + ".a.toml", scratch_dir() + ".b.toml"};
  static const bool cleanup = [] {
    return std::atexit([] {
             std::remove(scratch(0).c_str());
             std::remove(scratch(1).c_str());
           }) == 0;
  }();
  (void)cleanup;
  return paths[which];
}

void write(const std::string& path, const std::string& text) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(text.data(), 1, text.size(), f) != text.size() || std::fclose(f) != 0)
    std::abort();
}

void one_line(const fsdp_trainer::ConfigError& e) {
  if (std::string(e.what()).find('\n') != std::string::npos)
    __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0)
    return 0;
  const bool finetuning = data[0] & 1;
  const std::string input(reinterpret_cast<const char*>(data) + 1, size - 1);
  const size_t nul = input.find('\0');
  write(scratch(0), input.substr(0, nul));
  std::vector<std::string> overrides;
  for (size_t at = nul; at != std::string::npos && overrides.size() < 8;) {
    const size_t next = input.find('\0', at + 1);
    overrides.push_back(input.substr(at + 1, next == std::string::npos ? next : next - at - 1));
    at = next;
  }
  fsdp_trainer::Config config;
  try {
    config = fsdp_trainer::load_config(scratch(0), overrides, finetuning);
  } catch (const fsdp_trainer::ConfigError& e) {
    one_line(e);
    return 0;
  }
  try {
    fsdp_trainer::validate(config);
    const std::string printed = fsdp_trainer::to_toml(config);
    write(scratch(1), printed);
    if (fsdp_trainer::to_toml(fsdp_trainer::load_config(scratch(1), {}, finetuning)) != printed)
      __builtin_trap();  // --print-config's output does not load back to the same
  } catch (const fsdp_trainer::ConfigError&) {
    __builtin_trap();  // a configuration that loaded, refused when checked again or reloaded
  }
  return 0;
}
