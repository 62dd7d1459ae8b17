// libFuzzer target for the GGUF parser (formats/gguf.h, fsdp_models::gguf::parse): any input must
// either parse into a header whose tensors all lie inside the input, without overlapping, or
// throw FormatError; every accepted tensor is then dequantised from the input (the sanitizers
// catch any read past it). Built and run by scripts/fuzz.sh; its corpus, tests/fuzz/gguf/corpus,
// grew from small.gguf (written by the gguf package: F32, F16, Q8_0, Q4_0, Q4_1 tensors).
// Replayed by the normal suite as Fuzz.Replay.gguf. Campaigns: docs/design.md, "Fuzzing".
#include <cstdint>
#include <vector>

#include "gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fsdp_models::gguf;
  try {
    const Header h = parse(data, size, size, "fuzz");
    for (const auto& t : h.tensors) {
      if (t.offset > size || t.nbytes > size - t.offset || t.offset < h.data_offset)
        __builtin_trap();  // the parser accepted a tensor outside the input
      if (t.numel() > (1 << 20))
        continue;
      std::vector<float> out(t.numel());
      dequantize(t.type, data + t.offset, t.numel(), out.data());
    }
  } catch (const FormatError&) {
  } catch (const NeedMoreBytes&) {
    __builtin_trap();  // the whole input was given: truncation must be a FormatError
  }
  return 0;
}
