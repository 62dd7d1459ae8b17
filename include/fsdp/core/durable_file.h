// Files that survive a crash whole or not at all: what checkpoints, exports and the trainer's
// outputs are written with.
//
// A rename is atomic, but durable only once the directory that holds the new name is fsynced;
// a file's bytes are durable only once the file is. Every writer here therefore writes to a
// temporary name, fsyncs it, renames it into place and fsyncs the directory.
#pragma once

#include <string>
#include <string_view>

namespace fsdp {

/// Replaces `path` with `bytes` so that a reader sees either the old file or the complete new
/// one, never a prefix, even after a crash: the bytes go to a temporary name in the same
/// directory (unique per process and call), are fsynced, renamed over `path`, and the directory
/// is fsynced. The temporary is removed if anything fails. Throws std::runtime_error
/// "<path>: cannot write: <reason>".
void write_file_atomic(const std::string& path, std::string_view bytes);

/// fsync of a file or a directory (to make the names in it durable). Throws
/// std::runtime_error naming `path`.
void fsync_path(const std::string& path, bool directory);

/// Renames `from` to `to` (files or directories, on one file system) and fsyncs the directory
/// of `to`. Throws std::runtime_error naming both.
void rename_durably(const std::string& from, const std::string& to);

}  // namespace fsdp
