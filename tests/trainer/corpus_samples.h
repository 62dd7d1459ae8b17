// Text for the trainer's data tests: deterministic, English-like, with the structure of a real
// corpus, so that a tokenizer trains on it as on the KJV, in a fraction of the time.
#pragma once

#include <cstdint>
#include <string>

namespace fsdp::test {

// A few hundred KB of English-like text with structure (verse numbers, indentation, blank lines),
// deterministic.
inline std::string generated_corpus(int verses) {
  static const char* words[] = {"the",    "and",       "of",      "light",   "earth",
                                "waters", "God",       "said",    "created", "heaven",
                                "day",    "night",     "unto",    "them",    "was",
                                "good",   "firmament", "divided", "morning", "evening"};
  std::string out;
  uint64_t x = 12345;
  for (int v = 1; v <= verses; ++v) {
    if (v % 40 == 1)
      out += "\nChapter " + std::to_string(v / 40 + 1) + "\n\n";
    out += "  " + std::to_string(v % 40 + 1) + " And";
    const int n = 8 + static_cast<int>(x % 12);
    for (int i = 0; i < n; ++i) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      out += ' ';
      out += words[(x >> 33) % 20];
    }
    out += (v % 3 == 0) ? ".\n" : ";\nand it was so.\n";
  }
  return out;
}

}  // namespace fsdp::test
