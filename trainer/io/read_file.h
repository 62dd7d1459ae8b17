// Whole-file reads for the trainer's inputs, below both data/ and text/ (each reads files; neither
// includes the other for it). Writes go through the library's atomic replace
// (fsdp/core/durable_file.h).
#pragma once

#include <string>

namespace fsdp_trainer {

/// The whole file. Throws "<path>: cannot read: <reason>"; a FIFO or a device is refused at once.
std::string read_file(const std::string& path);

}  // namespace fsdp_trainer
