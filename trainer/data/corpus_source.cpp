// Resolving data.corpus to files and reading them as documents (corpus_source.h).
//
// Files are read in chunks and handed on in blocks that end after a line end, so memory stays
// at a few blocks whatever the corpus's size, and no block splits a line (the tokenizer encodes
// line by line, so the ids are those of the whole text) or a UTF-8 character.
#include "corpus_source.h"

#include <fsdp/core/file.h>

#include <glob.h>
#include <unistd.h>

#include <fsdp/core/json_depth.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <utility>

#include "corpus.h"

namespace fsdp_trainer {
namespace {

namespace fs = std::filesystem;

[[noreturn]] void fail(const std::string& message) {
  throw std::runtime_error(message);
}

bool is_builtin(const std::string& spec) {
  return spec == "kjv" || spec == "fortunes";
}

bool is_jsonl(const std::string& path) {
  return path.ends_with(".jsonl");
}

bool is_glob(const std::string& spec) {
  return spec.find_first_of("*?[") != std::string::npos;
}

int64_t count_lines(std::string_view s) {
  return static_cast<int64_t>(std::count(s.begin(), s.end(), '\n'));
}

// The UTF-8 check of one block, naming the file and line of the first bad byte.
void check_utf8(std::string_view text, const std::string& where, int64_t first_line) {
  const size_t bad = first_invalid_utf8(text);
  if (bad == std::string_view::npos)
    return;
  const size_t line_start = text.rfind('\n', bad == 0 ? 0 : bad - 1);
  const size_t column =
      bad - (line_start == std::string_view::npos || bad == 0 ? 0 : line_start + 1) + 1;
  char byte[8];
  std::snprintf(byte, sizeof byte, "0x%02x", static_cast<unsigned char>(text[bad]));
  fail(where + ":" + std::to_string(first_line + count_lines(text.substr(0, bad))) +
       ": not UTF-8 text: invalid byte " + byte + " at column " + std::to_string(column));
}

// Reads `path` in chunks and calls piece(text, first_line, last) with pieces that end after a
// line end (or at the end of the file) and hold at least `min_bytes` (0: every line alone).
// A line longer than kMaxLineBytes is refused.
void for_each_piece(const std::string& path, size_t min_bytes,
                    const std::function<void(std::string_view, int64_t, bool)>& piece) {
  constexpr size_t kChunk = 1 << 20;
  const fsdp::File f = fsdp::open_regular(path, "read");
  std::string buf;
  int64_t line = 1;
  uint64_t at = 0;
  size_t scanned = 0;  // buf[min_bytes - 1, scanned) is known to hold no line end
  for (bool eof = false;;) {
    const size_t old = buf.size();
    buf.resize(old + kChunk);
    const uint64_t got = f.pread_some(buf.data() + old, kChunk, at);
    buf.resize(old + static_cast<size_t>(got));
    at += got;
    eof = got < kChunk;
    size_t start = 0;
    for (;;) {
      const size_t from = std::max(start + (min_bytes ? min_bytes - 1 : 0), scanned);
      const size_t nl = from < buf.size() ? buf.find('\n', from) : std::string::npos;
      if (nl == std::string::npos)
        break;
      const bool last = eof && nl + 1 == buf.size();
      const std::string_view text(buf.data() + start, nl + 1 - start);
      piece(text, line, last);
      if (last)
        return;
      line += count_lines(text);
      start = nl + 1;
      scanned = 0;
    }
    buf.erase(0, start);
    if (eof) {  // the rest, without a final line end (or nothing: the document's end alone)
      piece(buf, line, true);
      return;
    }
    scanned = buf.size();
    if (buf.size() > CorpusSource::kMaxLineBytes)
      fail(path + ":" + std::to_string(line) + ": a line longer than " +
           std::to_string(CorpusSource::kMaxLineBytes >> 20) +
           " MiB (text needs line ends, and JSONL one record per line)");
  }
}

void add_file(std::vector<std::string>& files, int64_t& bytes, const std::string& path,
              const std::string& what) {
  if (!path.ends_with(".txt") && !is_jsonl(path))
    fail(what + ": '" + path + "' is neither .txt nor .jsonl");
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  if (ec)
    fail(what + ": '" + path + "': " + ec.message());
  files.push_back(path);
  bytes += static_cast<int64_t>(size);
}

}  // namespace

CorpusSource::CorpusSource(std::string spec) : spec_(std::move(spec)) {
  const std::string what = "corpus '" + spec_ + "'";
  if (is_builtin(spec_)) {
    builtin_ = load_corpus(spec_);
    bytes_ = static_cast<int64_t>(builtin_.size());
    return;
  }
  std::error_code ec;
  if (fs::is_directory(spec_, ec)) {
    std::vector<std::string> found;
    for (auto it = fs::recursive_directory_iterator(
             spec_, fs::directory_options::skip_permission_denied, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      const auto name = it->path().filename().string();
      // Per-entry checks have their own error: a dangling link is skipped, not the end of the
      // listing. Links to folders are not followed (a cycle would never end); links to files
      // are read.
      std::error_code entry;
      if (!name.empty() && name[0] == '.') {  // hidden files and folders (.git)
        if (it->is_directory(entry))
          it.disable_recursion_pending();
        continue;
      }
      const auto path = it->path().string();
      if (it->is_regular_file(entry) && (path.ends_with(".txt") || is_jsonl(path)))
        found.push_back(path);
    }
    if (ec)
      fail(what + ": cannot list the directory: " + ec.message());
    std::sort(found.begin(), found.end());
    for (const auto& f : found)
      add_file(files_, bytes_, f, what);
    if (files_.empty())
      fail(what + ": the directory holds no .txt or .jsonl file");
    return;
  }
  if (!fs::exists(spec_, ec) && is_glob(spec_)) {
    glob_t g{};
    const int rc = ::glob(spec_.c_str(), GLOB_ERR, nullptr, &g);
    std::vector<std::string> found;
    for (size_t i = 0; rc == 0 && i < g.gl_pathc; ++i)
      found.emplace_back(g.gl_pathv[i]);
    ::globfree(&g);
    if (rc == GLOB_NOMATCH)
      fail(what + ": the pattern matches no file");
    if (rc != 0)
      fail(what + ": the pattern cannot be expanded (a folder cannot be read)");
    for (const auto& f : found) {  // glob() sorts them
      if (fs::is_regular_file(f, ec))
        add_file(files_, bytes_, f, what);
    }
    if (files_.empty())
      fail(what + ": the pattern matches no regular file");
    return;
  }
  // One file: text of any name (as data.corpus always took), or JSONL.
  if (::access(spec_.c_str(), R_OK) != 0)
    fail(what + ": cannot read: " + fsdp::errno_text(errno) +
         " (a corpus is 'kjv', 'fortunes', a file, a directory or a glob of .txt and .jsonl)");
  const fsdp::File f = fsdp::open_regular(spec_, "read");  // (a FIFO or device: refused)
  if (f.size() == 0)
    fail(what + ": the file is empty");
  files_.push_back(spec_);
  bytes_ = static_cast<int64_t>(f.size());
}

void CorpusSource::read(
    const std::function<void(std::string_view text, bool document_ends)>& block) const {
  if (!builtin_.empty()) {
    std::string_view rest = builtin_;
    while (rest.size() > kBlockBytes) {
      const size_t nl = rest.find('\n', kBlockBytes - 1);
      if (nl == std::string_view::npos || nl + 1 == rest.size())
        break;
      block(rest.substr(0, nl + 1), false);
      rest.remove_prefix(nl + 1);
    }
    block(rest, true);
    return;
  }
  for (const auto& path : files_) {
    if (!is_jsonl(path)) {
      bool any = false;
      for_each_piece(path, kBlockBytes, [&](std::string_view text, int64_t line, bool last) {
        check_utf8(text, path, line);
        if (!last || any || !text.empty())
          block(text, last);
        any = true;
      });
      continue;
    }
    for_each_piece(path, 0, [&](std::string_view text, int64_t line, bool) {
      if (text.find_first_not_of(" \t\r\n") == std::string_view::npos)
        return;
      const std::string where = path + ":" + std::to_string(line);
      if (const auto deep = fsdp::json_too_deep(text); !deep.empty())
        fail(where + ": " + deep);
      nlohmann::json record;
      try {
        record = nlohmann::json::parse(text);
      } catch (const nlohmann::json::exception& e) {
        fail(where + ": not JSON: " + e.what());
      }
      if (!record.is_object() || !record.contains("text") || !record["text"].is_string())
        fail(where + ": a JSONL record needs a string field \"text\"");
      const auto& doc = record["text"].get_ref<const std::string&>();
      check_utf8(doc, where + " (its text)", 1);
      if (!doc.empty())
        block(doc, true);
    });
  }
}

}  // namespace fsdp_trainer
