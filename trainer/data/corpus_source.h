// Where a pretraining corpus comes from (`data.corpus`), read as a stream of documents so that a
// corpus of any size passes through the tokenizer without being held in memory.
//
//   "kjv", "fortunes"   a built-in corpus (corpus.h): one document;
//   a file              one document if it is text; one per line if it ends in .jsonl;
//   a directory         every .txt and .jsonl file under it, recursively, in path order;
//   a glob              ("books/*.txt", "shards/part-*.jsonl") the files it matches, in path
//                       order; each must end in .txt or .jsonl.
//
// A JSONL line is an object with a string field "text" (other fields are ignored; blank lines
// are skipped). Text must be UTF-8. Every error is one line naming the corpus, and for a bad
// line its file and line number.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace fsdp_trainer {

class CorpusSource {
 public:
  /// Resolves `spec` to its files. Throws std::runtime_error "corpus '<spec>': <problem>" when it
  /// names nothing readable (no such file, an empty directory or glob, a matched file that is
  /// neither .txt nor .jsonl).
  explicit CorpusSource(std::string spec);

  const std::string& spec() const { return spec_; }
  /// The files read, in order (empty for a built-in corpus).
  const std::vector<std::string>& files() const { return files_; }
  /// Bytes of all the files (of the text for a built-in corpus): what sizes the tokenizer's
  /// training sample before anything is read.
  int64_t bytes() const { return bytes_; }

  /// Calls `block(text, document_ends)` for the corpus's text in order. A document may come in
  /// several blocks (a text file in pieces of about kBlockBytes that end after a line end);
  /// `document_ends` is true on its last one. Empty documents (blank JSONL text) are skipped.
  void read(const std::function<void(std::string_view text, bool document_ends)>& block) const;

  /// A text file's blocks end at the first line end after this many bytes.
  static constexpr size_t kBlockBytes = 1 << 20;
  /// Longer lines (a text file with no line ends, a huge JSONL record) are refused by name.
  static constexpr size_t kMaxLineBytes = 64 << 20;

 private:
  std::string spec_;
  std::string builtin_;  // the text of "kjv" or "fortunes"
  std::vector<std::string> files_;
  int64_t bytes_ = 0;
};

}  // namespace fsdp_trainer
