// libFuzzer target for the byte-level BPE tokenizer (trainer/text/bpe_tokenizer.h), both of its
// inputs from outside: the text it encodes and the vocabulary it reads from a model file. The
// first input byte picks which:
//   even: the rest is text, encoded with SmolLM2's tokenizer (smollm2.h);
//   odd:  the rest is a GGUF image whose tokenizer metadata is read (from_gguf_metadata, after
//         the GGUF parser); a tokenizer it accepts then encodes a few fixed texts.
// Invariants (traps): those of bpe_checks.h for every text; a vocabulary is either accepted or
// refused with FormatError. Built and run by scripts/fuzz.sh
// (docs/design.md, "Fuzzing").
#include <cstdint>
#include <string>
#include <vector>

#include "bpe_checks.h"
#include "gguf.h"
#include "smollm2.h"
#include "text/bpe_tokenizer.h"

using fsdp_trainer::BpeTokenizer;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0)
    return 0;
  if ((data[0] & 1) == 0) {
    fsdp_fuzz::check_bpe(fsdp_fuzz::smollm2().tok,
                         std::string(reinterpret_cast<const char*>(data) + 1, size - 1));
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
      fsdp_fuzz::check_bpe(tok, text);
  } catch (const gguf::FormatError&) {
  } catch (const gguf::NeedMoreBytes&) {
    __builtin_trap();  // the whole image was given: truncation must be a FormatError
  }
  return 0;
}
