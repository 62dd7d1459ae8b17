// Byte-level BPE, the tokenizer of SmolLM2 (and GPT-2, Llama 3 style models), read from a GGUF
// file's metadata: tokenizer.ggml.tokens, .merges, .token_type and the special token ids.
//
// Encoding: special (control) tokens are matched first as whole strings; the text between
// them is cut into pre-tokens by GPT-2's pattern (contractions, letters, digits, other
// symbols, whitespace), each pre-token's UTF-8 bytes are mapped to GPT-2's printable byte
// alphabet and merged pair by pair, the lowest-ranked merge first, as the BPE was trained.
// Decoding maps the alphabet back to bytes. The pattern needs Unicode categories (\p{L},
// \p{N}), which std::regex lacks: ICU's regex engine (Debian libicu-dev) provides them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gguf.h"

namespace fsdp_trainer {

class BpeTokenizer {
 public:
  /// FormatError (naming the file and key) if the metadata is not a byte-level BPE ("gpt2").
  static BpeTokenizer from_gguf(const fsdp_models::gguf::File& file);
  ~BpeTokenizer();
  BpeTokenizer(BpeTokenizer&&) noexcept;
  BpeTokenizer& operator=(BpeTokenizer&&) noexcept;

  std::vector<int64_t> encode(const std::string& text) const;
  std::string decode(const std::vector<int64_t>& ids) const;
  int64_t vocab_size() const { return static_cast<int64_t>(tokens_.size()); }
  int64_t bos_id() const { return bos_; }
  int64_t eos_id() const { return eos_; }
  const std::string& token(int64_t id) const { return tokens_.at(id); }

 private:
  BpeTokenizer();
  void bpe(const std::string& piece, std::vector<int64_t>& out) const;

  std::vector<std::string> tokens_;
  std::unordered_map<std::string, int64_t> ids_;
  std::unordered_map<std::string, int> merge_rank_;        // "left right" -> rank
  std::vector<std::pair<std::string, int64_t>> specials_;  // longest first
  std::vector<bool> is_special_;
  std::string byte_char_[256];  // byte -> UTF-8 of its alphabet letter
  std::unordered_map<std::string, uint8_t> char_byte_;
  int64_t bos_ = -1, eos_ = -1;
  struct Regex;
  std::unique_ptr<Regex> regex_;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache_;
};

}  // namespace fsdp_trainer
