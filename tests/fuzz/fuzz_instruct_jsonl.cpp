// libFuzzer target for the JSONL instruction loader (load_instruct_jsonl,
// trainer/data/instruct_data.h), with SmolLM2's tokenizer and template (smollm2.h): the input is
// the file's bytes. Any input must load or be refused with ConfigError; never another exception.
// Invariants (traps): an error is one line that starts with the file's path; a loaded example
// has as many targets as ids, at most max_tokens of them, target[0] == 0, at least one target,
// an increasing line number within the file, ids that decode to a ChatML conversation, and no
// special token but <|im_start|>/<|im_end|>, as many of one as of the other. Built and run by
// scripts/fuzz.sh (docs/design.md, "Fuzzing").
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "config/config.h"
#include "data/instruct_data.h"
#include "smollm2.h"

namespace {

// One file per process, rewritten for each input (the loader reads a path), removed at exit.
const std::string& scratch() {
  static const std::string path = [] {
    const char* dir = std::getenv("TMPDIR");
    std::atexit([] { std::remove(scratch().c_str()); });
    return std::string(dir && *dir ? dir : "/tmp") + "/fuzz_instruct_jsonl." +
           std::to_string(getpid()) + ".jsonl";
  }();
  return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto& s = fsdp_fuzz::smollm2();
  const auto& path = scratch();
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(data, 1, size, f) != size || std::fclose(f) != 0)
    std::abort();
  constexpr int64_t kMaxTokens = 512;  // small enough that inputs reach the limit
  try {
    const auto examples = fsdp_trainer::load_instruct_jsonl(path, s.tok, s.tmpl, kMaxTokens);
    const auto lines = std::count(data, data + size, '\n') + 1;
    int64_t last = 0;
    for (const auto& ex : examples) {
      if (ex.ids.size() != ex.target.size() || ex.ids.empty() ||
          static_cast<int64_t>(ex.ids.size()) > kMaxTokens || ex.target[0] != 0 ||
          std::find(ex.target.begin(), ex.target.end(), 1) == ex.target.end())
        __builtin_trap();
      if (ex.line <= last || ex.line > lines)
        __builtin_trap();
      last = ex.line;
      int64_t starts = 0, ends = 0;
      for (auto id : ex.ids) {
        starts += id == s.im_start;
        ends += id == s.im_end;
        if (s.tok.is_special(id) && id != s.im_start && id != s.im_end)
          __builtin_trap();
      }
      if (starts != ends || ex.ids[0] != s.im_start || ex.ids.back() == s.im_start ||
          !s.tok.decode(ex.ids).starts_with("<|im_start|>"))
        __builtin_trap();
    }
  } catch (const fsdp_trainer::ConfigError& e) {
    const std::string m = e.what();
    if (!m.starts_with(path + ":") || m.find('\n') != std::string::npos)
      __builtin_trap();  // an error must name the file and fit on one line
  }
  return 0;
}
