// Table-driven CRC-32C: see crc32c.h.
#include "crc32c.h"

#include <array>

namespace fsdp_trainer {
namespace {

// Castagnoli's polynomial 0x1EDC6F41, bit-reversed: the reflected form works on bytes from the
// least significant bit, as the CRC is defined for TFRecords (and iSCSI, ext4, SSE4.2's crc32).
constexpr uint32_t kPolynomial = 0x82F63B78u;

// table[b] = the CRC register after shifting byte b through it: eight steps of the bitwise
// algorithm, computed at compile time.
constexpr std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t r = b;
    for (int bit = 0; bit < 8; ++bit)
      r = (r & 1u) ? (r >> 1) ^ kPolynomial : r >> 1;
    table[b] = r;
  }
  return table;
}

constexpr std::array<uint32_t, 256> kTable = make_table();

}  // namespace

uint32_t crc32c(std::string_view data, uint32_t crc) {
  // The register starts at all ones and is inverted at the end; undoing the final inversion
  // first lets a caller pass the previous piece's result to continue it.
  uint32_t r = ~crc;
  for (const char c : data)
    r = kTable[(r ^ static_cast<uint8_t>(c)) & 0xFFu] ^ (r >> 8);
  return ~r;
}

}  // namespace fsdp_trainer
