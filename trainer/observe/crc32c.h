// CRC-32C (Castagnoli): the checksum TensorBoard's record format puts after each record's length
// and data (tensorboard.h). Table-driven, one byte at a time: an event file grows by a few hundred
// bytes per step, so speed does not matter here.
//
// Why by hand: Debian 12 packages no C or C++ CRC32C library (only python3-crc32c), its abseil
// (20220623) predates absl/crc, and Boost.CRC would bring all of Boost's headers for what is
// twenty lines.
#pragma once

#include <cstdint>
#include <string_view>

namespace fsdp_trainer {

/// CRC-32C of `data` (reflected polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF):
/// crc32c("123456789") == 0xE3069283. `crc` continues a checksum over data split in pieces:
/// crc32c(b, crc32c(a)) == crc32c(a + b).
uint32_t crc32c(std::string_view data, uint32_t crc = 0);

}  // namespace fsdp_trainer
