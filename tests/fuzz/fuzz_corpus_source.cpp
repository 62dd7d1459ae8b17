// libFuzzer target for reading a pretraining corpus file (CorpusSource, trainer/data/
// corpus_source.h). The first input byte picks the file's kind (bit 0: .jsonl, else .txt); the
// rest is the file's bytes. Any input must read or be refused with std::runtime_error.
// Invariants (traps): an error is one line that starts with "corpus '" (the corpus named) or
// with the file's path; a .txt file reads back byte for byte as one document whose blocks end
// after a line end (but the last), and is refused only if it is empty or not UTF-8; a .jsonl
// file's documents are each one block, non-empty, valid UTF-8, at most one per line. Built and
// run by scripts/fuzz.sh (docs/design.md, "Fuzzing").
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "data/corpus.h"
#include "data/corpus_source.h"

namespace {

std::string base_path() {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir && *dir ? dir : "/tmp") + "/fuzz_corpus_source." +
         std::to_string(getpid());
}

void remove_scratch() {
  std::remove((base_path() + ".txt").c_str());
  std::remove((base_path() + ".jsonl").c_str());
}

// The scratch file of one kind, rewritten for each input (removed at exit).
std::string scratch(bool jsonl) {
  static const bool registered = [] { return std::atexit(remove_scratch) == 0; }();
  (void)registered;
  return base_path() + (jsonl ? ".jsonl" : ".txt");
}

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0)
    return 0;
  const bool jsonl = data[0] & 1;
  const std::string content(reinterpret_cast<const char*>(data) + 1, size - 1);
  const std::string path = scratch(jsonl);
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(content.data(), 1, content.size(), f) != content.size() ||
      std::fclose(f) != 0)
    std::abort();  // the machine, not the parser

  std::string text;
  size_t blocks = 0, documents = 0;
  bool open = false;
  try {
    const fsdp_trainer::CorpusSource source(path);
    source.read([&](std::string_view block, bool ends) {
      if (!jsonl && !ends && (block.empty() || block.back() != '\n'))
        __builtin_trap();  // a text block ends after a line end
      if (jsonl && (!ends || block.empty() ||
                    fsdp_trainer::first_invalid_utf8(block) != std::string_view::npos))
        __builtin_trap();  // a JSONL document is one non-empty block of UTF-8
      text.append(block);
      ++blocks;
      documents += ends;
      open = !ends;
    });
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    if (what.find('\n') != std::string::npos ||
        !(starts_with(what, "corpus '") || starts_with(what, path)))
      __builtin_trap();
    // A text file is refused only when empty or not UTF-8.
    if (!jsonl && !content.empty() &&
        fsdp_trainer::first_invalid_utf8(content) == std::string_view::npos)
      __builtin_trap();
    return 0;
  }
  if (open)
    __builtin_trap();  // the last document never ended
  if (!jsonl && (text != content || documents != 1))
    __builtin_trap();
  if (jsonl &&
      documents > static_cast<size_t>(std::count(content.begin(), content.end(), '\n')) + 1)
    __builtin_trap();
  return 0;
}
