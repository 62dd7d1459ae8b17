// Subword tokenizer for fsdp-train: a thin wrapper over SentencePiece (Debian's libsentencepiece).
//
// The model is BPE with byte fallback, trained with normalization off, so any UTF-8 text
// encodes (unknown characters become their bytes) and decode(encode(text)) == text exactly,
// newlines and runs of spaces included. SentencePiece stays out of this header.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace fsdp_trainer {

class Tokenizer {
 public:
  Tokenizer();
  /// Same as load(path).
  explicit Tokenizer(const std::string& path);
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  /// Loads a SentencePiece .model file. Throws "<path>: not a tokenizer model: <reason>".
  void load(const std::string& path);
  /// Loads a serialized model held in memory; `name` stands for it in errors.
  void load_from_bytes(std::string_view serialized, const std::string& name);
  bool loaded() const { return sp_ != nullptr; }

  /// Token ids of `text`, no BOS/EOS added. Encodes line by line (and long lines in pieces cut
  /// before a space): SentencePiece's BPE is slow on very long inputs, and as pieces never
  /// span a line end or start mid-word the ids are those of the whole text (up to how a run
  /// of spaces longer than a piece is cut), and the exact round trip holds.
  std::vector<int> encode(std::string_view text) const;
  std::string decode(const std::vector<int>& ids) const;
  /// decode() as transformers decodes our tokenizer.json (to_hf_json), to show generated text: a
  /// run of byte pieces that is not valid UTF-8 (text cut inside a character) becomes one U+FFFD
  /// per piece; the same as decode() for any other ids.
  std::string decode_for_display(const std::vector<int>& ids) const;

  int vocab_size() const;
  int bos_id() const;
  int eos_id() const;
  int unk_id() const;
  /// The text of one id's piece (spaces shown as U+2581, bytes as <0xXX>).
  std::string piece(int id) const;
  /// The piece's score (BPE: higher merges first) and kind, as SentencePiece keeps them.
  float score(int id) const;
  bool is_byte(int id) const;
  bool is_control(int id) const;
  bool is_unknown(int id) const;
  /// The file it was loaded from (or the name given to load_from_bytes).
  const std::string& path() const { return path_; }
  /// The model file's bytes, to write it elsewhere.
  std::string serialized() const;
  /// The model as a Hugging Face tokenizer.json (the `tokenizers` library's BPE with byte
  /// fallback), which encodes text to the same ids (tokenizer_hf_json.cpp says why). Throws
  /// "<path>: cannot be written as tokenizer.json: <reason>" for a model trained with text
  /// normalization.
  std::string to_hf_json() const;

 private:
  const sentencepiece::SentencePieceProcessor& sp() const;

  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
  std::string path_;
};

/// The files an export carries so that transformers uses the tokenizer as it is:
/// tokenizer.json, tokenizer_config.json (special tokens, `model_max_length`) and
/// generation_config.json (bos and eos ids). Throws what to_hf_json() throws.
std::map<std::string, std::string> tokenizer_export_files(const Tokenizer& tok,
                                                          int64_t model_max_length);

/// The most text train_tokenizer() learns from: beyond it, lines are sampled.
inline constexpr size_t kTokenizerTrainingBytes = 8u << 20;

/// Trains a BPE tokenizer of `vocab_size` ids (unk = 0, bos = 1, eos = 2, then 256 byte pieces,
/// then the merges) on `text`, deterministic for a given (text, vocab_size, seed). At most
/// ~8 MB of lines, sampled with `seed`, are used, which keeps training to a few seconds on one
/// core (the 4.3 MB KJV: ~2 s). If `model_prefix` is not empty, writes `<model_prefix>.model`
/// atomically. Not thread-safe: SentencePiece seeds a process-wide generator.
/// Throws "tokenizer training (vocab_size N on M bytes) failed: <SentencePiece's reason>".
Tokenizer train_tokenizer(const std::string& text, int vocab_size, const std::string& model_prefix,
                          uint64_t seed);

}  // namespace fsdp_trainer
