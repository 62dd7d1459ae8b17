// Byte-level BPE, the tokenizer of SmolLM2 (and GPT-2, Llama 3 style models), read from a GGUF
// file's metadata (tokenizer.ggml.tokens, .merges, .token_type and the special token ids) or
// from a Hugging Face tokenizer.json (bpe_hf_json.cpp).
//
// Encoding: special (control) tokens are matched first as whole strings; the text between
// them is cut into pre-tokens by GPT-2's pattern (contractions, letters, digits, other
// symbols, whitespace; a tokenizer.json may chain other patterns before it, or replace it), each
// pre-token's UTF-8 bytes are mapped to GPT-2's printable byte
// alphabet and merged pair by pair, the lowest-ranked merge first, as the BPE was trained.
// Decoding maps the alphabet back to bytes. The pattern needs Unicode categories (\p{L},
// \p{N}), which std::regex lacks: ICU's regex engine (Debian libicu-dev) provides them.
//
// Any byte string encodes and decodes back to itself, decode(encode(x)) == x: a byte that is not
// part of valid UTF-8 is a pre-token of its own (its byte token), where ICU would have replaced
// it with U+FFFD. Except that a vocabulary may lack some byte tokens (SmolLM2's has none for
// 21 bytes: six control characters, and 0xC0, 0xC1, 0xF1, 0xF2, 0xF5..0xFF); text that needs one
// is refused (UnencodableByte), where it used to lose those bytes silently. encode_plain() is
// encode without the special tokens: text that spells
// "<|im_end|>" becomes ordinary tokens, never the control token (user content in a chat).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gguf.h"

namespace fsdp_trainer {

/// GPT-2's pre-tokenizer pattern (Hugging Face's ByteLevel pre-tokenizer with use_regex).
inline constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

/// Text holding a byte the vocabulary cannot spell (see above).
struct UnencodableByte : std::runtime_error {
  explicit UnencodableByte(uint8_t b);
  uint8_t byte;
};

class BpeTokenizer {
 public:
  /// FormatError (naming the file and key) if the metadata is not a byte-level BPE ("gpt2").
  /// Refused too: a bos/eos id outside the vocabulary.
  static BpeTokenizer from_gguf(const fsdp_models::gguf::File& file);
  /// The same from a GGUF header's metadata; `path` names the file in errors.
  static BpeTokenizer from_gguf_metadata(
      const std::map<std::string, fsdp_models::gguf::Value>& metadata, const std::string& path);
  /// A Hugging Face tokenizer.json's text (`path` names it in errors) holding a byte-level BPE:
  /// model BPE without byte fallback, pre-tokenizers ByteLevel, Split (a regex or string,
  /// "Isolated") and Digits, in a Sequence ending with ByteLevel; added tokens matched whole.
  /// Anything else is refused by name (FormatError): another model type, a normalizer, other
  /// pre-tokenizers or split behaviours, a prefix space, subword prefixes or suffixes.
  /// `bos` and `eos` are the texts of those tokens ("" for none), as tokenizer_config.json
  /// names them.
  static BpeTokenizer from_hf_json(const std::string& json_text, const std::string& path,
                                   const std::string& bos, const std::string& eos);
  /// This tokenizer as a tokenizer.json that the `tokenizers` library (and so transformers'
  /// fast tokenizers) loads and encodes with exactly as encode() does: the vocabulary, the
  /// merges in rank order, the special tokens as added tokens, the pre-tokenizer's patterns as
  /// Split steps before ByteLevel (GGUF's: ByteLevel with GPT-2's pattern). FormatError for a
  /// vocabulary tokenizer.json cannot hold: a token that is not valid UTF-8, or two ids with the
  /// same text.
  std::string to_hf_json() const;
  ~BpeTokenizer();
  BpeTokenizer(BpeTokenizer&&) noexcept;
  BpeTokenizer& operator=(BpeTokenizer&&) noexcept;

  /// Ids of `text`, special tokens matched wherever their text occurs. UnencodableByte if the
  /// text (outside special tokens) holds a byte the vocabulary has no token for.
  std::vector<int64_t> encode(const std::string& text) const;
  /// Ids of `text` as ordinary text: no special token id, whatever the text holds.
  std::vector<int64_t> encode_plain(const std::string& text) const;
  std::string decode(const std::vector<int64_t>& ids) const;
  int64_t vocab_size() const { return static_cast<int64_t>(tokens_.size()); }
  int64_t bos_id() const { return bos_; }
  int64_t eos_id() const { return eos_; }
  const std::string& token(int64_t id) const { return tokens_.at(id); }
  bool is_special(int64_t id) const { return is_special_.at(id); }
  /// Whether the vocabulary has the ordinary token for byte `b`.
  bool can_encode_byte(uint8_t b) const;
  /// The id of the special token spelled `text`, or -1 if there is none.
  int64_t special_id(const std::string& text) const;

 private:
  BpeTokenizer();
  void init_byte_alphabet();
  /// The pre-tokenizer's patterns, applied in turn (pattern, literal: a plain string). A
  /// tokenizer.json's own patterns (`from_file`) are compiled as Oniguruma, which the
  /// `tokenizers` library uses, reads them: `.`, `^` and `$` know only "\n" as a line end, and
  /// `^` / `$` match at every line.
  void set_splits(const std::vector<std::pair<std::string, bool>>& patterns,
                  const std::string& where, bool from_file);
  void bpe(const std::string& piece, std::vector<int64_t>& out) const;
  void encode_text(std::string_view text, std::vector<int64_t>& out) const;

  std::vector<std::string> tokens_;
  std::unordered_map<std::string, int64_t> ids_;  // ordinary tokens only: BPE never makes a special
  std::unordered_map<std::string, int> merge_rank_;        // "left right" -> rank
  std::vector<std::pair<std::string, int64_t>> specials_;  // longest first
  std::vector<bool> is_special_;
  std::string byte_char_[256];  // byte -> UTF-8 of its alphabet letter
  std::unordered_map<std::string, uint8_t> char_byte_;
  int64_t bos_ = -1, eos_ = -1;
  bool ignore_merges_ = false;  // a pre-token that is in the vocabulary is taken whole
  // The pre-tokenizer's patterns as read (pattern, literal), to write them back (to_hf_json).
  std::vector<std::pair<std::string, bool>> splits_;
  struct Regex;
  std::unique_ptr<Regex> regex_;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache_;
};

}  // namespace fsdp_trainer
