// SentencePiece BPE training, loading, encoding and decoding for fsdp-train.
//
// Why these trainer settings: normalization "identity", no dummy prefix and no whitespace
// cleanup, so that decode(encode(text)) reproduces the text byte for byte (a language model's
// samples must read like the corpus, indentation included); byte fallback, so no text is ever
// <unk>; one thread and our own seeded line sampling, so the model is the same on every run.

#include "tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <algorithm>
#include <stdexcept>
#include <unordered_map>

#include <fsdp/core/durable_file.h>

#include "io/read_file.h"
#include "utf8.h"

// Exported by libsentencepiece (common.h) but absent from its public headers: it silences the
// trainer's pages of INFO logging.
namespace sentencepiece::logging {
int GetMinLogLevel();
void SetMinLogLevel(int v);
}  // namespace sentencepiece::logging

namespace fsdp_trainer {
namespace {

// Lines longer than this are cut (encoding and training): SentencePiece skips training
// sentences above max_sentence_length, and its BPE encoder slows down on long inputs.
constexpr size_t kMaxChunkBytes = 4096;
// Training text budget: BPE training time grows with it (~0.5 s per MB here).
constexpr size_t kMaxTrainingBytes = kTokenizerTrainingBytes;

[[noreturn]] void fail(const std::string& message) {
  throw std::runtime_error(message);
}

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Splits `text` into pieces that concatenate back to it: each line with its '\n', and lines
// longer than kMaxChunkBytes cut before a space (else at a UTF-8 character boundary), so that
// no cut falls inside a word or a multi-byte character.
template <typename Fn>
void for_each_chunk(std::string_view text, Fn&& fn) {
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    end = end == std::string_view::npos ? text.size() : end + 1;
    while (end - pos > kMaxChunkBytes) {
      size_t cut = pos + kMaxChunkBytes;
      size_t space = cut;
      while (space > pos + 1 && !(text[space] == ' ' && text[space - 1] != ' '))
        --space;
      if (space > pos + 1) {
        cut = space;
      } else {
        while (cut > pos + 1 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80)
          --cut;
      }
      fn(text.substr(pos, cut - pos));
      pos = cut;
    }
    fn(text.substr(pos, end - pos));
    pos = end;
  }
}

// Feeds the training sentences: the chunks of the text without their line ends, empty ones
// dropped, at most kMaxTrainingBytes of them chosen with `seed` (a fixed fraction of lines, in
// text order, so the choice does not depend on SentencePiece's own sampling).
class ChunkIterator : public sentencepiece::SentenceIterator {
 public:
  ChunkIterator(std::string_view text, uint64_t seed) {
    const double keep = text.size() <= kMaxTrainingBytes
                            ? 1.0
                            : static_cast<double>(kMaxTrainingBytes) / text.size();
    uint64_t rng = seed ^ 0x5A17C0DEull;
    for_each_chunk(text, [&](std::string_view chunk) {
      if (!chunk.empty() && chunk.back() == '\n')
        chunk.remove_suffix(1);
      if (chunk.empty())
        return;
      if (keep < 1.0 && static_cast<double>(splitmix64(rng) >> 11) * 0x1.0p-53 >= keep)
        return;
      chunks_.emplace_back(chunk);
    });
  }
  bool done() const override { return i_ >= chunks_.size(); }
  void Next() override { ++i_; }
  const std::string& value() const override { return chunks_[i_]; }
  sentencepiece::util::Status status() const override { return {}; }
  size_t count() const { return chunks_.size(); }

 private:
  std::vector<std::string> chunks_;
  size_t i_ = 0;
};

}  // namespace

// ---- Tokenizer --------------------------------------------------------------------------------

Tokenizer::Tokenizer() = default;
Tokenizer::Tokenizer(const std::string& path) {
  load(path);
}
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

void Tokenizer::load(const std::string& path) {
  load_from_bytes(read_file(path), path);
}

void Tokenizer::load_from_bytes(std::string_view serialized, const std::string& name) {
  auto sp = std::make_unique<sentencepiece::SentencePieceProcessor>();
  const auto status = sp->LoadFromSerializedProto(serialized);
  if (!status.ok())
    fail(name + ": not a tokenizer model: " + status.ToString());
  sp_ = std::move(sp);
  path_ = name;
}

const sentencepiece::SentencePieceProcessor& Tokenizer::sp() const {
  if (!sp_)
    fail("Tokenizer: used before load()");
  return *sp_;
}

std::vector<int> Tokenizer::encode(std::string_view text) const {
  const auto& sp = this->sp();
  std::vector<int> ids, piece;
  ids.reserve(text.size() / 3);
  for_each_chunk(text, [&](std::string_view chunk) {
    const auto status = sp.Encode(chunk, &piece);
    if (!status.ok())
      fail(path_ + ": encoding failed: " + status.ToString());
    ids.insert(ids.end(), piece.begin(), piece.end());
  });
  return ids;
}

std::string Tokenizer::decode_for_display(const std::vector<int>& ids) const {
  const auto& sp = this->sp();
  std::string out, run;
  std::vector<int> pieces;  // a run of other pieces, decoded by SentencePiece
  for (const int id : ids) {
    if (id >= 0 && id < sp.GetPieceSize() && sp.IsByte(id)) {
      if (!pieces.empty())
        out += decode(pieces);
      pieces.clear();
      const auto piece = sp.IdToPiece(id);  // "<0xXX>"
      run.push_back(static_cast<char>(std::stoi(piece.substr(3, 2), nullptr, 16)));
    } else {
      append_byte_run(out, run);
      run.clear();
      pieces.push_back(id);
    }
  }
  append_byte_run(out, run);
  if (!pieces.empty())
    out += decode(pieces);
  return out;
}

std::string Tokenizer::decode(const std::vector<int>& ids) const {
  const auto& sp = this->sp();
  const int n = sp.GetPieceSize();
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= n)
      fail(path_ + ": cannot decode id " + std::to_string(ids[i]) + " at position " +
           std::to_string(i) + ": the vocabulary has " + std::to_string(n) + " ids");
  std::string out;
  const auto status = sp.Decode(ids, &out);
  if (!status.ok())
    fail(path_ + ": decoding failed: " + status.ToString());
  return out;
}

int Tokenizer::vocab_size() const {
  return sp().GetPieceSize();
}
int Tokenizer::bos_id() const {
  return sp().bos_id();
}
int Tokenizer::eos_id() const {
  return sp().eos_id();
}
int Tokenizer::unk_id() const {
  return sp().unk_id();
}
std::string Tokenizer::piece(int id) const {
  if (id < 0 || id >= vocab_size())
    fail(path_ + ": no piece " + std::to_string(id));
  return sp().IdToPiece(id);
}

float Tokenizer::score(int id) const {
  piece(id);  // checks the id
  return sp().GetScore(id);
}

bool Tokenizer::is_byte(int id) const {
  piece(id);
  return sp().IsByte(id);
}

bool Tokenizer::is_control(int id) const {
  piece(id);
  return sp().IsControl(id);
}

bool Tokenizer::is_unknown(int id) const {
  piece(id);
  return sp().IsUnknown(id);
}
std::string Tokenizer::serialized() const {
  const auto bytes = sp().serialized_model_proto();
  return std::string(bytes.data(), bytes.size());
}

// ---- Training ---------------------------------------------------------------------------------

Tokenizer train_tokenizer(const std::string& text, int vocab_size, const std::string& model_prefix,
                          uint64_t seed) {
  const std::string what = "tokenizer training (vocab_size " + std::to_string(vocab_size) + " on " +
                           std::to_string(text.size()) + " bytes)";
  // 3 special ids + 256 byte pieces are reserved before any learned piece.
  if (vocab_size < 260)
    fail(what +
         " failed: vocab_size must be at least 260 (3 special ids "
         "and 256 byte pieces come first)");
  ChunkIterator sentences(text, seed);
  if (sentences.count() == 0)
    fail(what + " failed: the text has no non-empty line");

  const std::unordered_map<std::string, std::string> args = {
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(vocab_size)},
      {"byte_fallback", "true"},
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"add_dummy_prefix", "false"},
      {"allow_whitespace_only_pieces", "true"},  // indentation becomes one piece
      {"split_digits", "true"},                  // numbers spell out: no arbitrary merges
      {"character_coverage", "0.9995"},          // rarer characters go through bytes
      {"max_sentence_length", std::to_string(2 * kMaxChunkBytes)},
      {"input_sentence_size", "0"},  // we sampled already (ChunkIterator)
      {"num_threads", "1"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      {"model_prefix", ""},
  };
  // SentencePiece reserves the seed 0xFFFFFFFF for "random device".
  uint64_t mix = seed;
  sentencepiece::SetRandomGeneratorSeed(static_cast<unsigned>(splitmix64(mix) % 0xFFFFFFFFull));
  const int old_level = sentencepiece::logging::GetMinLogLevel();
  sentencepiece::logging::SetMinLogLevel(1);  // warnings and errors only
  std::string model;
  const auto status = sentencepiece::SentencePieceTrainer::Train(args, &sentences, &model);
  sentencepiece::logging::SetMinLogLevel(old_level);
  if (!status.ok())
    fail(what + " failed: " + status.ToString());

  Tokenizer tok;
  tok.load_from_bytes(model,
                      model_prefix.empty() ? "<trained tokenizer>" : model_prefix + ".model");
  if (!model_prefix.empty())
    fsdp::write_file_atomic(model_prefix + ".model", model);
  return tok;
}

}  // namespace fsdp_trainer
