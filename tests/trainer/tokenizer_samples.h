// Text to compare tokenizers on: 300 lines each of the King James Bible and the fortunes, 100
// lines of instruction JSONL, and a sample of what the corpora lack (scripts, emoji, digits, code,
// runs of spaces and tabs, Windows line ends, ChatML delimiters, leading and trailing spaces).
#pragma once

#include <filesystem>
#include <string>

#include "data/corpus.h"
#include "harness/files.h"

namespace fsdp::test {

inline std::string tokenizer_corpus() {
  std::string corpus = first_lines(fsdp_trainer::load_corpus("kjv"), 300);
  corpus += first_lines(fsdp_trainer::load_corpus("fortunes"), 300);
  corpus += first_lines(
      file_bytes(std::filesystem::path(FSDP_SOURCE_DIR) / "data/instruct/kjv_train.jsonl"), 100);
  corpus +=
      "Voilà l'été, déjà! Größe und Übermaß. "
      "Привет, мир. "
      "こんにちは世界。你好，世界。\n"
      "Emoji: 🚀🔥👍🏽 👨‍👩‍👧 — "
      "“quotes” ‘single’ … "
      "naïve café x² ½ ∑ ∞\n"
      "Numbers 1234567890 3.14159 -42 1e-5 0x1F and   many    spaces\t\ttabs   \n"
      "Code: for (int i = 0; i < n; ++i) { sum += a[i]; } // it's can't we'll they've I'm I'd\n"
      "SHOUTING IT'S WE'LL Don'T\r\nwindows\r\n\r\n  lines\n\n\n"
      "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|endoftext|>\n"
      "   leading spaces and trailing   ";
  return corpus;
}

// Mistral-7B-Instruct's chat template: v0.1 writes `after_eos` = " + ' ' " after each answer's
// eos, v0.2 nothing.
inline std::string mistral_template(const std::string& after_eos) {
  return "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
         "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
         "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
         "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == "
         "'assistant' %}{{ message['content'] + eos_token" +
         after_eos +
         "}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
         "{% endif %}{% endfor %}";
}

}  // namespace fsdp::test
