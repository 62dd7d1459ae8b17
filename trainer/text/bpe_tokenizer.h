// BPE tokenizers of pretrained models, in the two families they come in:
// - byte-level BPE, the tokenizer of SmolLM2 (and GPT-2, Llama 3 style models), read from a GGUF
//   file's metadata (tokenizer.ggml.tokens, .merges, .token_type and the special token ids) or
//   from a Hugging Face tokenizer.json (bpe_hf_json.cpp);
// - SentencePiece-style BPE with byte fallback (Llama 2, Mistral, TinyLlama, and the tokenizer
//   our pretraining exports write), read from a tokenizer.json or a GGUF file's "llama"
//   tokenizer (bpe_gguf.cpp). It is described at the end.
//
// Byte-level BPE.
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
//
// SentencePiece-style BPE. The text between special tokens is one piece: each space becomes
// U+2581 ("\u2581", the visible space), and a U+2581 may be put in front as a word boundary
// (SpacePrefix: Llama 2's "legacy" Prepend normalizer before every piece, or a Metaspace
// pre-tokenizer's "always" / "first" scheme); a Metaspace pre-tokenizer with `split` cuts the
// piece before each U+2581. BPE starts from the piece's characters; a character outside the
// vocabulary becomes its UTF-8 bytes' tokens <0xXX> (byte fallback), and a byte that is not part
// of valid UTF-8 its byte token. Decoding writes U+2581 back as a space and byte tokens as their
// bytes (a run of byte tokens that is not valid UTF-8 as one U+FFFD per token, as the
// ByteFallback decoder does), and removes the prefix as the file's decoder does: Strip takes one
// leading space of the text, Metaspace's decoder every U+2581 of the first token. So for valid
// UTF-8 that holds no U+2581 and does not start with a space, decode(encode_plain(x)) is x, or
// " " + x where the file's decoder keeps the prefix (with Llama 2's Prepend and Strip it is x
// whatever the start); otherwise a U+2581 of the text comes back as a space and leading spaces
// are lost, exactly as in the `tokenizers` library, and around special tokens the prefixes show
// as spaces. token_bytes() spells what was encoded
// (U+2581 as a space), invalid bytes included.
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
  /// FormatError (naming the file and key) if the metadata is neither a byte-level BPE ("gpt2")
  /// nor a SentencePiece BPE ("llama", bpe_gguf.cpp says how its scores become merges).
  /// Refused too: a bos/eos id outside the vocabulary, arrays of other lengths than the tokens'.
  static BpeTokenizer from_gguf(const fsdp_models::gguf::File& file);
  /// The same from a GGUF header's metadata; `path` names the file in errors.
  static BpeTokenizer from_gguf_metadata(
      const std::map<std::string, fsdp_models::gguf::Value>& metadata, const std::string& path);
  /// A Hugging Face tokenizer.json's text (`path` names it in errors) holding
  /// - a byte-level BPE: model BPE without byte fallback, pre-tokenizers ByteLevel, Split (a
  ///   regex or string, "Isolated") and Digits, in a Sequence ending with ByteLevel; or
  /// - a SentencePiece-style BPE: model BPE with byte fallback, spaces made U+2581 by a Replace
  ///   normalizer or a Metaspace pre-tokenizer, optionally a Prepend("\u2581") normalizer; the
  ///   decoder undoing it (Replace, ByteFallback, Fuse, Strip, Metaspace);
  /// added tokens matched whole. Anything else is refused by name (FormatError): another model
  /// type, other normalizers, pre-tokenizers, decoders or split behaviours, a prefix space on
  /// byte-level BPE, subword prefixes or suffixes.
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
  /// `at_input_start` says whether the text begins the input, for a "first" prefix scheme.
  std::vector<int64_t> encode_plain(const std::string& text, bool at_input_start = true) const;
  std::string decode(const std::vector<int64_t>& ids) const;
  /// The bytes one token stands for in the text it was encoded from, a prefix U+2581 included
  /// (as a space): encode_plain's tokens spell " " + text if adds_space_prefix(), else text.
  std::string token_bytes(int64_t id) const;
  /// Whether encode_plain(text, at_input_start) puts a word-boundary U+2581 before the text
  /// (SentencePiece-style tokenizers with a prefix scheme; never for byte-level BPE).
  bool adds_space_prefix(std::string_view text, bool at_input_start) const;
  /// Whether this is a byte-level BPE (false: SentencePiece-style).
  bool byte_level() const { return byte_level_; }
  int64_t vocab_size() const { return static_cast<int64_t>(tokens_.size()); }
  int64_t bos_id() const { return bos_; }
  int64_t eos_id() const { return eos_; }
  const std::string& token(int64_t id) const { return tokens_.at(id); }
  bool is_special(int64_t id) const { return is_special_.at(id); }
  /// Whether the vocabulary has the ordinary token for byte `b` (SentencePiece-style: <0xXX>).
  bool can_encode_byte(uint8_t b) const;
  /// The id of the special token spelled `text`, or -1 if there is none.
  int64_t special_id(const std::string& text) const;

 private:
  BpeTokenizer();
  void init_byte_alphabet();
  /// SentencePiece-style: finds the byte tokens <0xXX> among the ordinary tokens; FormatError
  /// (naming `where`) if U+2581 is not one of them.
  void index_byte_tokens(const std::string& where);
  /// A GGUF `llama` tokenizer (SentencePiece BPE: pieces with scores, no merges).
  static BpeTokenizer from_gguf_sentencepiece(
      const std::map<std::string, fsdp_models::gguf::Value>& metadata, const std::string& path);
  /// The pre-tokenizer's patterns, applied in turn (pattern, literal: a plain string). A
  /// tokenizer.json's own patterns (`from_file`) are compiled as Oniguruma, which the
  /// `tokenizers` library uses, reads them: `.`, `^` and `$` know only "\n" as a line end, and
  /// `^` / `$` match at every line.
  void set_splits(const std::vector<std::pair<std::string, bool>>& patterns,
                  const std::string& where, bool from_file);
  void bpe(const std::string& piece, std::vector<int64_t>& out) const;
  /// BPE's merges of a piece's initial symbols (characters, or byte tokens' texts): the
  /// lowest-ranked adjacent pair, the leftmost first, until none is in the table.
  std::vector<std::string> merge(std::vector<std::string> initial) const;
  /// The ids of merged symbols into `ids`; one the vocabulary lacks by its bytes (byte-level)
  /// or UnencodableByte.
  void symbol_ids(const std::vector<std::string>& symbols, std::vector<int64_t>& ids) const;
  void encode_text(std::string_view text, bool at_input_start, std::vector<int64_t>& out) const;
  void encode_sentencepiece(std::string_view text, bool at_input_start,
                            std::vector<int64_t>& out) const;
  /// SentencePiece-style: the initial symbols of a piece (characters, or byte tokens' texts).
  std::vector<std::string> sentencepiece_symbols(const std::string& piece) const;

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

  // SentencePiece-style BPE (byte_level_ false): where the word-boundary U+2581 goes, and how
  // decoding removes it again.
  enum class SpacePrefix {
    kNone,
    kEverySegment,  // a Prepend normalizer: before every non-empty text between special tokens
    kUnlessSpace,   // Metaspace "always": before every such text not starting with a space
    kFirstSegment,  // Metaspace "first": as "always", only for the text that begins the input
  };
  enum class DecodePrefix {
    kKeep,
    kStripLeadingSpace,  // the Strip decoder: one space at the start of the decoded text
    kStripFirstToken,    // the Metaspace decoder: every U+2581 of the first token
  };
  bool byte_level_ = true;
  SpacePrefix space_prefix_ = SpacePrefix::kNone;
  DecodePrefix decode_prefix_ = DecodePrefix::kKeep;
  bool metaspace_ = false;       // spaces are replaced by a Metaspace pre-tokenizer (to write back)
  bool split_at_space_ = false;  // Metaspace's split: pieces start at each U+2581
  int64_t unk_ = -1;             // the model's unk_token (written back only)
  int64_t byte_token_[256] = {};  // id of <0xXX>, -1 if the vocabulary lacks it
  std::unordered_map<int64_t, uint8_t> byte_of_token_;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache_;
};

}  // namespace fsdp_trainer
