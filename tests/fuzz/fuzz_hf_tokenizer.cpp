// libFuzzer target for a Hugging Face tokenizer.json (BpeTokenizer::from_hf_json, trainer/text/
// bpe_hf_json.cpp): the input is the file's text. Invariants (traps): the file is read or refused
// with FormatError (no other exception: nlohmann's own type errors, a stack exhausted by nested
// Sequences, an ICU error on a hostile pattern must not escape as anything else); a tokenizer
// it reads keeps bpe_checks.h's invariants on a few texts (a pattern that makes ICU give up on
// one is a runtime_error at encode time, allowed); and to_hf_json() reads back as a tokenizer
// that encodes those texts the same. Built and run by scripts/fuzz.sh (docs/design.md,
// "Fuzzing").
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bpe_checks.h"
#include "gguf.h"
#include "text/bpe_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using fsdp_trainer::BpeTokenizer;
  const std::string json(reinterpret_cast<const char*>(data), size);
  std::optional<BpeTokenizer> tok;
  try {
    tok.emplace(BpeTokenizer::from_hf_json(json, "fuzz", "", ""));
  } catch (const fsdp_models::gguf::FormatError&) {
    return 0;
  }
  std::string bytes;
  for (int b = 0; b < 256; ++b)
    bytes.push_back(static_cast<char>(b));
  std::string specials;
  for (int64_t id = 0; id < tok->vocab_size(); ++id)
    if (tok->is_special(id))
      specials += "x " + tok->token(id);
  const std::vector<std::string> texts{
      bytes, specials, "Hello world, it's 2024!\n\n  \xF0\x9F\x98\x80 ab abc 123 a1b2"};
  auto again = BpeTokenizer::from_hf_json(tok->to_hf_json(), "fuzz (written back)", "", "");
  for (const auto& text : texts) {
    try {
      fsdp_fuzz::check_bpe(*tok, text);
    } catch (const fsdp_trainer::UnencodableByte&) {
      __builtin_trap();  // check_bpe handles these itself
    } catch (const std::runtime_error&) {
      continue;  // ICU gave up on the file's pattern (time limit): an error, not a wrong answer
    }
    std::vector<int64_t> a, b;
    bool a_ok = true, b_ok = true;
    try {
      a = tok->encode(text);
    } catch (const std::runtime_error&) {
      a_ok = false;
    }
    try {
      b = again.encode(text);
    } catch (const std::runtime_error&) {
      b_ok = false;
    }
    if (a_ok != b_ok || a != b)
      __builtin_trap();  // the written tokenizer.json encodes differently
  }
  return 0;
}
