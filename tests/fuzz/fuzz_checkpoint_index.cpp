// libFuzzer target for the sharded checkpoint's index parser (fsdp::detail::parse_index_text):
// any input must either parse into an index whose pieces tile every tensor (bands of columns,
// each band's rows covered once), or throw
// FormatError; the sanitizers catch the rest. Built and run by scripts/fuzz.sh (corpus:
// tests/fuzz/checkpoint_index/corpus); replayed by the normal suite as
// Fuzz.Replay.checkpoint_index. Campaigns: docs/design.md, "Fuzzing".
#include <algorithm>
#include <cstdint>
#include <string_view>
#include <vector>

#include <fsdp/checkpoint/safetensors.h>

#include "checkpoint/checkpoint_index.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto index = fsdp::detail::parse_index_text(
        std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
    for (const auto& [key, t] : index.tensors) {
      const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
      const int64_t cols = t.shape.size() < 2 ? 1 : t.shape[1];
      // Every cell of a coarse grid is covered by exactly one piece (the band boundaries and
      // row ends are the grid's lines, so this checks the whole tiling).
      std::vector<int64_t> row_lines{0, rows}, col_lines{0, cols};
      for (const auto& p : t.pieces) {
        if (p.end < p.begin || p.block_rows < 1 || p.at < 0 || p.col_end <= p.col_begin && cols > 0)
          __builtin_trap();  // the parser accepted what it must refuse
        const int64_t blocks = (p.end - p.begin + p.block_rows - 1) / p.block_rows;
        if (static_cast<int64_t>(p.sums.size()) != blocks || p.file.find('/') != std::string::npos)
          __builtin_trap();
        row_lines.insert(row_lines.end(), {p.begin, p.end});
        col_lines.insert(col_lines.end(), {p.col_begin, p.col_end});
      }
      for (auto* lines : {&row_lines, &col_lines}) {
        std::sort(lines->begin(), lines->end());
        lines->erase(std::unique(lines->begin(), lines->end()), lines->end());
      }
      for (size_t r = 0; r + 1 < row_lines.size(); ++r)
        for (size_t c = 0; c + 1 < col_lines.size(); ++c) {
          int covered = 0;
          for (const auto& p : t.pieces)
            covered += p.begin <= row_lines[r] && row_lines[r + 1] <= p.end &&
                       p.col_begin <= col_lines[c] && col_lines[c + 1] <= p.col_end;
          if (covered != 1)
            __builtin_trap();
        }
    }
  } catch (const fsdp::safetensors::FormatError&) {
  }
  return 0;
}
