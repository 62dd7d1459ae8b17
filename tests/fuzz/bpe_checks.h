// The invariants every BPE tokenizer keeps, whatever it was read from (GGUF metadata,
// tokenizer.json): the fuzz targets bpe_tokenizer and hf_tokenizer trap when one breaks.
//   Any byte string, valid UTF-8 or not, decodes back to itself through encode and through
//   encode_plain (SentencePiece-style: its tokens spell it after the prefix space, U+2581 as a
//   space, and decoding gives it back, after the prefix space if the decoder keeps it, if it is
//   valid UTF-8 that neither starts with a space nor holds U+2581), unless it holds a byte the
//   vocabulary has no token for, which both refuse (UnencodableByte, naming a byte that is there);
//   encode_plain never yields a special token's id; encode without a special id equals
//   encode_plain; ids lie in the vocabulary.
#pragma once

#include <string>

#include "text/bpe_tokenizer.h"
#include "text/utf8.h"

namespace fsdp_fuzz {

inline void check_bpe(const fsdp_trainer::BpeTokenizer& tok, const std::string& text) {
  // A byte the vocabulary lacks (outside special tokens, which encode_plain does not match):
  // both encodings refuse the text, naming a byte that is in it.
  bool unencodable = false;
  for (unsigned char c : text)
    unencodable = unencodable || !tok.can_encode_byte(c);
  try {
    tok.encode_plain(text);
  } catch (const fsdp_trainer::UnencodableByte& e) {
    if (tok.can_encode_byte(e.byte) || text.find(static_cast<char>(e.byte)) == std::string::npos)
      __builtin_trap();
    try {
      tok.encode(text);
    } catch (const fsdp_trainer::UnencodableByte& e2) {
      if (tok.can_encode_byte(e2.byte))
        __builtin_trap();
    }
    return;
  }
  // (SentencePiece-style: a character in the vocabulary needs no byte tokens.)
  if (unencodable && tok.byte_level())
    __builtin_trap();  // a byte without a token was encoded (dropped)
  const auto ids = tok.encode(text);
  bool special = false;
  for (auto id : ids) {
    if (id < 0 || id >= tok.vocab_size())
      __builtin_trap();
    special = special || tok.is_special(id);
  }
  if (tok.byte_level() && tok.decode(ids) != text)
    __builtin_trap();  // text lost or changed
  const auto plain = tok.encode_plain(text);
  for (auto id : plain)
    if (id < 0 || id >= tok.vocab_size() || tok.is_special(id))
      __builtin_trap();  // plain text became a control token
  if (tok.byte_level() && tok.decode(plain) != text)
    __builtin_trap();
  // SentencePiece-style: the tokens spell the text, after the prefix space if one was put, with
  // its U+2581 as spaces (decoding may drop leading spaces, as the file's decoder says).
  std::string spelled, expected = tok.adds_space_prefix(text, true) ? " " : "";
  for (auto id : plain)
    spelled += tok.token_bytes(id);
  const std::string meta = "\xE2\x96\x81";
  for (size_t i = 0; i < text.size(); ++i) {
    if (!tok.byte_level() && text.compare(i, meta.size(), meta) == 0) {
      expected += ' ';
      i += meta.size() - 1;
    } else {
      expected += text[i];
    }
  }
  if (spelled != expected)
    __builtin_trap();
  // Decoding gives the text back, after the prefix space if the file's decoder keeps it; unless
  // the text is not UTF-8, holds U+2581 or starts with a space, or the first token holds a
  // space past its start (Metaspace's decoder drops every U+2581 of the first token).
  const bool valid = fsdp_trainer::printable_utf8(text) == text;
  if (!tok.byte_level() && valid && text.find(meta) == std::string::npos && !text.empty() &&
      text[0] != ' ' && !plain.empty() &&
      tok.token_bytes(plain[0]).find(' ', 1) == std::string::npos) {
    const auto decoded = tok.decode(plain);
    if (decoded != text && decoded != " " + text)
      __builtin_trap();
  }
  if (!special && plain != ids)
    __builtin_trap();  // the two encodings differ where no special token was matched
}

}  // namespace fsdp_fuzz
