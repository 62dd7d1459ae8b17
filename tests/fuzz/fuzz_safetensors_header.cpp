// libFuzzer target for the safetensors header parser (fsdp::safetensors::parse_header): the
// first 8 input bytes give the data size the header is checked against, the rest is the
// header text. Any input must either parse or throw FormatError; the sanitizers catch the rest.
// Built and run by scripts/fuzz.sh (corpus: tests/fuzz/safetensors_header/corpus); replayed by
// the normal suite as Fuzz.Replay.safetensors_header. Campaigns: docs/design.md, "Fuzzing".
#include <cstdint>
#include <cstring>
#include <string_view>

#include <fsdp/checkpoint/safetensors.h>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8)
    return 0;
  uint64_t data_bytes = 0;
  std::memcpy(&data_bytes, data, 8);
  data_bytes %= uint64_t{1} << 40;
  try {
    auto h = fsdp::safetensors::parse_header(
        std::string_view(reinterpret_cast<const char*>(data) + 8, size - 8), data_bytes);
    for (const auto& t : h.tensors) {
      if (t.end > data_bytes || t.begin > t.end)
        __builtin_trap();  // the parser accepted what it must refuse
    }
  } catch (const fsdp::safetensors::FormatError&) {
  }
  return 0;
}
