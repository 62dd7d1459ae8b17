// UTF-8 as RFC 3629 defines it (no overlong forms, surrogates or code points above U+10FFFF),
// for the tokenizers, which must keep every byte of their input, valid or not, and for showing
// generated text, which may end inside a character.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace fsdp_trainer {

/// The length of the UTF-8 character at the start of `s` (Unicode table 3-7), 0 if `s` does not
/// start with one.
size_t utf8_length(std::string_view s);

/// The bytes of the UTF-8 character whose first byte is `lead`, by that byte alone (1 for a
/// byte that cannot start one, so that splitting always advances): for vocabulary pieces, which
/// are valid UTF-8.
size_t utf8_lead_length(unsigned char lead);

/// `bytes` for display: each byte that is not part of valid UTF-8 (a character cut short at the
/// end of a generated text) becomes U+FFFD, as the `tokenizers` library's ByteFallback decoder
/// writes such bytes.
std::string printable_utf8(std::string_view bytes);

/// Appends a run of consecutive byte-fallback tokens' bytes as the `tokenizers` library's
/// ByteFallback decoder writes them (and so transformers shows them): the bytes if the whole run
/// is valid UTF-8, otherwise one U+FFFD per byte (SentencePiece's own decoder would keep the
/// valid ones).
void append_byte_run(std::string& out, std::string_view run);

}  // namespace fsdp_trainer
