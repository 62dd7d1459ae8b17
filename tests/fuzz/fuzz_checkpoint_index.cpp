// libFuzzer target for the sharded checkpoint's index parser (fsdp::detail::parse_index_text):
// any input must either parse into an index whose pieces tile every tensor's rows, or throw
// FormatError; the sanitizers catch the rest. Built and run by scripts/fuzz.sh (corpus:
// tests/fuzz/checkpoint_index/corpus); replayed by the normal suite as
// Fuzz.Replay.checkpoint_index. Campaigns: docs/design.md, "Fuzzing".
#include <cstdint>
#include <string_view>

#include <fsdp/checkpoint/safetensors.h>

#include "checkpoint/checkpoint_index.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto index = fsdp::detail::parse_index_text(
        std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
    for (const auto& [key, t] : index.tensors) {
      const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
      int64_t at = 0;
      for (const auto& p : t.pieces) {
        if (p.begin != at || p.end < p.begin || p.block_rows < 1)
          __builtin_trap();  // the parser accepted what it must refuse
        const int64_t blocks = (p.end - p.begin + p.block_rows - 1) / p.block_rows;
        if (static_cast<int64_t>(p.sums.size()) != blocks || p.file.find('/') != std::string::npos)
          __builtin_trap();
        at = p.end;
      }
      if (at != rows)
        __builtin_trap();
    }
  } catch (const fsdp::safetensors::FormatError&) {
  }
  return 0;
}
