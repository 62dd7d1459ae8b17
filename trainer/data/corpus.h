// Training text for fsdp-train: the corpora available offline (Debian packages) or a user's file,
// and the file helpers the data pipeline uses (io/read_file.h; atomic replace:
// fsdp/core/durable_file.h).
//
// A corpus is returned as one UTF-8 string; the tokenizer and the token files are built from it
// (data.h). Every error is one line naming the corpus or file and, where there is one, the fix.
#pragma once

#include <string>
#include <string_view>

#include <fsdp/core/durable_file.h>

#include "io/read_file.h"

namespace fsdp_trainer {

/// The text of a corpus. `spec` is
///   "kjv"       the King James Bible, printed by Debian's bible-kjv (~4.3 MB);
///   "fortunes"  every file of Debian's fortunes under /usr/share/games/fortunes (~2.5 MB), one
///               entry after another, each followed by a line "%" (the entry boundary the
///               model can learn; fortune files use the same separator);
///   otherwise   a path to a UTF-8 text file, returned byte for byte.
/// The names win over files of the same name: write "./kjv" for a file called kjv.
/// Throws std::runtime_error, e.g. "corpus 'kjv' needs Debian's bible-kjv: apt-get install
/// bible-kjv bible-kjv-text" or "corpus 'x.txt': cannot read: No such file or directory".
std::string load_corpus(const std::string& spec);

/// What a built-in corpus whose text a program prints is made from, as a string that changes
/// whenever one of those files does (the command that prints it, and each file's path, device,
/// inode, size, modification and change times): "" for every corpus but "kjv", or when a file is
/// missing. It lets a prepared directory be reused
/// without printing the whole Bible again to checksum it (0.1 s of every fsdp-train start).
std::string corpus_fingerprint(const std::string& spec);

/// Offset of the first byte that does not start a well-formed UTF-8 sequence (RFC 3629: no
/// overlong forms, no surrogates, nothing above U+10FFFF), or npos. Corpora must be UTF-8: the
/// tokenizer's normalizer would silently rewrite invalid sequences and break the exact text
/// round trip.
size_t first_invalid_utf8(std::string_view s);

/// Atomic replace of a file: the library's (fsdp/core/durable_file.h).
using fsdp::write_file_atomic;

}  // namespace fsdp_trainer
