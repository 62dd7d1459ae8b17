// libFuzzer target for the byte-level BPE tokenizer (trainer/text/bpe_tokenizer.h), both of its
// inputs from outside: the text it encodes and the vocabulary it reads from a model file. The
// first input byte picks which:
//   even: the rest is text, encoded with SmolLM2's tokenizer (smollm2.h);
//   odd:  the rest is a GGUF image whose tokenizer metadata is read (from_gguf_metadata, after
//         the GGUF parser); a tokenizer it accepts then encodes a few fixed texts.
// Invariants (traps): any byte string, valid UTF-8 or not, decodes back to itself, through encode
// and through encode_plain, unless it holds a byte the vocabulary has no token for, which both
// refuse (UnencodableByte, naming a byte that is there); encode_plain never yields a special
// token's id; encode without a special id equals encode_plain; ids lie in the vocabulary. A
// vocabulary is either accepted or refused with FormatError. Built and run by scripts/fuzz.sh
// (docs/design.md, "Fuzzing").
#include <cstdint>
#include <string>
#include <vector>

#include "gguf.h"
#include "smollm2.h"
#include "text/bpe_tokenizer.h"

namespace {

using fsdp_trainer::BpeTokenizer;

void check(const BpeTokenizer& tok, const std::string& text) {
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
  if (unencodable)
    __builtin_trap();  // a byte without a token was encoded (dropped)
  const auto ids = tok.encode(text);
  bool special = false;
  for (auto id : ids) {
    if (id < 0 || id >= tok.vocab_size())
      __builtin_trap();
    special = special || tok.is_special(id);
  }
  if (tok.decode(ids) != text)
    __builtin_trap();  // text lost or changed
  const auto plain = tok.encode_plain(text);
  for (auto id : plain)
    if (id < 0 || id >= tok.vocab_size() || tok.is_special(id))
      __builtin_trap();  // plain text became a control token
  if (tok.decode(plain) != text)
    __builtin_trap();
  if (!special && plain != ids)
    __builtin_trap();  // the two encodings differ where no special token was matched
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0)
    return 0;
  if ((data[0] & 1) == 0) {
    check(fsdp_fuzz::smollm2().tok, std::string(reinterpret_cast<const char*>(data) + 1, size - 1));
    return 0;
  }
  namespace gguf = fsdp_models::gguf;
  try {
    const auto h = gguf::parse(data + 1, size - 1, size - 1, "fuzz");
    const auto tok = BpeTokenizer::from_gguf_metadata(h.metadata, "fuzz");
    std::string bytes;
    for (int b = 0; b < 256; ++b)
      bytes.push_back(static_cast<char>(b));
    std::string specials;
    for (int64_t id = 0; id < tok.vocab_size(); ++id)
      if (tok.is_special(id))
        specials += "x " + tok.token(id);
    for (const auto& text :
         {bytes, specials, std::string("Hello world, it's 2024!\n\n  \xF0\x9F\x98\x80")})
      check(tok, text);
  } catch (const gguf::FormatError&) {
  } catch (const gguf::NeedMoreBytes&) {
    __builtin_trap();  // the whole image was given: truncation must be a FormatError
  }
  return 0;
}
