#include "bpe_tokenizer.h"

#include "utf8.h"

#include <unicode/regex.h>
#include <unicode/unistr.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <queue>
#include <stdexcept>

namespace fsdp_trainer {

namespace gguf = fsdp_models::gguf;

// The pre-tokenizer: patterns applied in turn, each cutting every piece so far into its matches
// and the text between them (Hugging Face's Split with the "Isolated" behaviour). GGUF's
// byte-level models use GPT-2's pattern alone (as Hugging Face's ByteLevel pre-tokenizer does);
// tokenizer.json may chain several (Digits, Split, then ByteLevel).
struct BpeTokenizer::Regex {
  std::vector<std::unique_ptr<icu::RegexPattern>> splits;
};

namespace {

constexpr int32_t kRegexTimeLimit = 10000;

const std::string kMetaSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's visible space

std::string byte_token_text(uint8_t b) {
  char text[8];
  std::snprintf(text, sizeof text, "<0x%02X>", b);
  return text;
}

std::string utf8(char32_t cp) {
  std::string out;
  icu::UnicodeString(static_cast<UChar32>(cp)).toUTF8String(out);
  return out;
}

// The UTF-8 characters of s.
std::vector<std::string> characters(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : c < 0xe0 ? 2 : c < 0xf0 ? 3 : 4;
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

}  // namespace

UnencodableByte::UnencodableByte(uint8_t b)
    : std::runtime_error([b] {
        char hex[8];
        std::snprintf(hex, sizeof hex, "0x%02X", b);
        return std::string("the tokenizer's vocabulary has no token for the byte ") + hex +
               ", so text holding it cannot be encoded";
      }()),
      byte(b) {}

bool BpeTokenizer::can_encode_byte(uint8_t b) const {
  return byte_level_ ? ids_.count(byte_char_[b]) != 0 : byte_token_[b] >= 0;
}

BpeTokenizer::BpeTokenizer() {
  std::fill(std::begin(byte_token_), std::end(byte_token_), int64_t{-1});
}
BpeTokenizer::~BpeTokenizer() = default;
BpeTokenizer::BpeTokenizer(BpeTokenizer&&) noexcept = default;
BpeTokenizer& BpeTokenizer::operator=(BpeTokenizer&&) noexcept = default;

void BpeTokenizer::index_byte_tokens(const std::string& where) {
  for (int b = 0; b < 256; ++b) {
    if (auto it = ids_.find(byte_token_text(static_cast<uint8_t>(b))); it != ids_.end()) {
      byte_token_[b] = it->second;
      byte_of_token_[it->second] = static_cast<uint8_t>(b);
    }
  }
  // Every SentencePiece vocabulary has it; without it a space would be three byte tokens, which
  // the decoders leave as U+2581 rather than a space.
  if (!ids_.count(kMetaSpace))
    throw gguf::FormatError(
        where + ": the vocabulary has no ordinary token U+2581 (SentencePiece's space)");
}

void BpeTokenizer::init_byte_alphabet() {
  // GPT-2's byte alphabet: printable bytes stand for themselves, the others for 256 + n.
  int next = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    byte_char_[b] = utf8(printable ? b : 256 + next++);
    char_byte_[byte_char_[b]] = static_cast<uint8_t>(b);
  }
}

void BpeTokenizer::set_splits(const std::vector<std::pair<std::string, bool>>& patterns,
                              const std::string& where, bool from_file) {
  regex_ = std::make_unique<Regex>();
  splits_ = patterns;
  for (const auto& [pattern, literal] : patterns) {
    UErrorCode status = U_ZERO_ERROR;
    UParseError parse{};
    uint32_t flags = literal ? UREGEX_LITERAL : 0;
    if (from_file && !literal)
      flags |= UREGEX_UNIX_LINES | UREGEX_MULTILINE;
    std::unique_ptr<icu::RegexPattern> p(
        icu::RegexPattern::compile(icu::UnicodeString::fromUTF8(pattern), flags, parse, status));
    if (U_FAILURE(status))
      throw gguf::FormatError(where + ": the pre-tokenizer pattern '" + pattern +
                              "' is not a regular expression ICU reads (" + u_errorName(status) +
                              ")");
    regex_->splits.push_back(std::move(p));
  }
}

int64_t BpeTokenizer::special_id(const std::string& text) const {
  for (const auto& [s, id] : specials_)
    if (s == text)
      return id;
  return -1;
}

std::vector<std::string> BpeTokenizer::sentencepiece_symbols(const std::string& piece) const {
  std::vector<std::string> out;
  for (size_t i = 0; i < piece.size();) {
    const size_t n = utf8_length(std::string_view(piece).substr(i));
    if (n > 0 && ids_.count(piece.substr(i, n))) {
      out.push_back(piece.substr(i, n));
    } else {  // byte fallback: the character's bytes (or the one invalid byte)
      for (size_t k = i; k < i + std::max<size_t>(n, 1); ++k)
        out.push_back(byte_token_text(static_cast<uint8_t>(piece[k])));
    }
    i += std::max<size_t>(n, 1);
  }
  return out;
}

std::vector<std::string> BpeTokenizer::merge(std::vector<std::string> initial) const {
  // Merge the lowest-ranked adjacent pair, the leftmost first, until none is in the table.
  // The symbols form a linked list and the candidate pairs a heap, so a piece of n characters
  // costs O(n log n): rescanning the whole piece after each merge made one long word (a hostile
  // line of a megabyte of letters) take minutes.
  struct Symbol {
    std::string text;
    int prev, next;
    int version = 0;  // bumped when the symbol changes or dies: stale heap entries are skipped
  };
  std::vector<Symbol> syms;
  for (auto& ch : initial) {
    const int i = static_cast<int>(syms.size());
    syms.push_back({std::move(ch), i - 1, i + 1});
  }
  if (!syms.empty())
    syms.back().next = -1;
  struct Candidate {
    int rank, left, left_version, right_version;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto consider = [&](int left) {
    const int right = left >= 0 ? syms[static_cast<size_t>(left)].next : -1;
    if (left < 0 || right < 0)
      return;
    const auto& l = syms[static_cast<size_t>(left)];
    const auto& r = syms[static_cast<size_t>(right)];
    if (auto it = merge_rank_.find(l.text + " " + r.text); it != merge_rank_.end())
      heap.push({it->second, left, l.version, r.version});
  };
  for (int i = 0; i + 1 < static_cast<int>(syms.size()); ++i)
    consider(i);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    auto& l = syms[static_cast<size_t>(c.left)];
    if (l.version != c.left_version || l.next < 0)
      continue;
    auto& r = syms[static_cast<size_t>(l.next)];
    if (r.version != c.right_version)
      continue;
    l.text += r.text;
    ++l.version;
    ++r.version;
    l.next = r.next;
    if (r.next >= 0)
      syms[static_cast<size_t>(r.next)].prev = c.left;
    r.next = -2;  // dead
    consider(l.prev);
    consider(c.left);
  }
  std::vector<std::string> symbols;
  for (int i = syms.empty() ? -1 : 0; i >= 0; i = syms[static_cast<size_t>(i)].next)
    symbols.push_back(std::move(syms[static_cast<size_t>(i)].text));
  return symbols;
}

void BpeTokenizer::symbol_ids(const std::vector<std::string>& symbols,
                              std::vector<int64_t>& ids) const {
  for (const auto& s : symbols) {
    auto it = ids_.find(s);
    if (it != ids_.end()) {
      ids.push_back(it->second);
    } else if (!byte_level_) {  // a byte token the vocabulary lacks: "<0xXX>"
      unsigned byte = 0;
      if (s.size() != 6 || std::sscanf(s.c_str(), "<0x%2X>", &byte) != 1)
        throw std::logic_error("BpeTokenizer: the symbol '" + s + "' is not in the vocabulary");
      throw UnencodableByte(static_cast<uint8_t>(byte));
    } else {  // not in the vocabulary: by bytes
      for (const auto& ch : characters(s)) {
        auto b = ids_.find(ch);
        if (b == ids_.end())
          throw UnencodableByte(char_byte_.at(ch));
        ids.push_back(b->second);
      }
    }
  }
}

void BpeTokenizer::bpe(const std::string& piece, std::vector<int64_t>& out) const {
  if (auto it = cache_.find(piece); it != cache_.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  // Byte-level: the piece's bytes in GPT-2's alphabet; SentencePiece-style: its characters.
  std::string mapped;
  if (byte_level_) {
    for (unsigned char c : piece)
      mapped += byte_char_[c];
  } else {
    mapped = piece;
  }
  if (ignore_merges_) {  // a piece that is a word of the vocabulary is that word, unmerged
    if (auto it = ids_.find(mapped); it != ids_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  std::vector<int64_t> ids;
  symbol_ids(merge(byte_level_ ? characters(mapped) : sentencepiece_symbols(mapped)), ids);
  // Words repeat, whole lines (SentencePiece-style pieces) rarely: only short pieces are kept.
  if (cache_.size() < 200000 && piece.size() <= 64)
    cache_.emplace(piece, ids);
  out.insert(out.end(), ids.begin(), ids.end());
}

// Ordinary text: pre-tokens by the pattern, each merged by bpe(). A byte that is not part of
// valid UTF-8 (RFC 3629: no overlong forms, surrogates or code points above U+10FFFF) is a
// pre-token of its own, so that it is kept as its byte token, not replaced by U+FFFD.
void BpeTokenizer::encode_text(std::string_view text, bool at_input_start,
                               std::vector<int64_t>& out) const {
  if (!byte_level_) {
    encode_sentencepiece(text, at_input_start, out);
    return;
  }
  size_t i = 0;
  while (i < text.size()) {
    size_t end = i;
    while (end < text.size()) {
      const size_t n = utf8_length(text.substr(end));
      if (n == 0)
        break;
      end += n;
    }
    if (end > i) {
      std::vector<icu::UnicodeString> pieces{icu::UnicodeString::fromUTF8(
          icu::StringPiece(text.data() + i, static_cast<int32_t>(end - i)))};
      for (const auto& split : regex_->splits) {
        // Copies, not tempSubStringBetween's aliases: `pieces` is replaced below.
        std::vector<icu::UnicodeString> next;
        for (const auto& u : pieces) {
          UErrorCode status = U_ZERO_ERROR;
          std::unique_ptr<icu::RegexMatcher> m(split->matcher(u, status));
          // A tokenizer.json's own pattern may backtrack catastrophically on some text: ICU
          // stops it (U_REGEX_TIME_OUT, an error below) instead of running for hours. The limit
          // is in ICU's steps of about a millisecond; real patterns take microseconds a piece.
          if (U_SUCCESS(status))
            m->setTimeLimit(kRegexTimeLimit, status);
          int32_t at = 0;
          while (U_SUCCESS(status) && m->find(status)) {
            const int32_t b = m->start(status), e = m->end(status);
            if (b > at)
              next.emplace_back(u, at, b - at);
            if (e > b)
              next.emplace_back(u, b, e - b);
            at = e;
          }
          if (U_FAILURE(status))
            throw std::runtime_error(std::string("BpeTokenizer: ICU regex: ") +
                                     u_errorName(status));
          if (at < u.length())
            next.emplace_back(u, at);
        }
        pieces = std::move(next);
      }
      for (const auto& u : pieces) {
        std::string piece;
        u.toUTF8String(piece);
        bpe(piece, out);
      }
    }
    if (end < text.size())  // an invalid byte
      bpe(std::string(1, text[end]), out);
    i = end + 1;
  }
}

bool BpeTokenizer::adds_space_prefix(std::string_view text, bool at_input_start) const {
  if (byte_level_ || text.empty())
    return false;
  const bool space = text[0] == ' ' || text.starts_with(kMetaSpace);
  switch (space_prefix_) {
    case SpacePrefix::kNone:
      return false;
    case SpacePrefix::kEverySegment:
      return true;
    case SpacePrefix::kUnlessSpace:
      return !space;
    case SpacePrefix::kFirstSegment:
      return at_input_start && !space;
  }
  return false;
}

// SentencePiece-style text: spaces as U+2581, the prefix, then BPE over the whole text (or over
// the pieces Metaspace's split cuts before each U+2581), as `tokenizers` does.
void BpeTokenizer::encode_sentencepiece(std::string_view text, bool at_input_start,
                                        std::vector<int64_t>& out) const {
  std::string s;
  s.reserve(text.size() + text.size() / 4 + 3);
  if (adds_space_prefix(text, at_input_start))
    s += kMetaSpace;
  for (char c : text) {
    if (c == ' ')
      s += kMetaSpace;
    else
      s.push_back(c);
  }
  if (s.empty())
    return;
  if (!split_at_space_) {
    bpe(s, out);
    return;
  }
  size_t begin = 0;
  for (size_t at = s.find(kMetaSpace, 1); at != std::string::npos;
       at = s.find(kMetaSpace, at + 1)) {
    bpe(s.substr(begin, at - begin), out);
    begin = at;
  }
  bpe(s.substr(begin), out);
}

std::vector<int64_t> BpeTokenizer::encode(const std::string& text) const {
  std::vector<int64_t> out;
  size_t start = 0, pos = 0;
  while (pos < text.size()) {
    bool matched = false;
    for (const auto& [s, id] : specials_) {
      if (!s.empty() && text.compare(pos, s.size(), s) == 0) {
        encode_text(std::string_view(text).substr(start, pos - start), start == 0, out);
        out.push_back(id);
        pos += s.size();
        start = pos;
        matched = true;
        break;
      }
    }
    if (!matched)
      ++pos;
  }
  encode_text(std::string_view(text).substr(start), start == 0, out);
  return out;
}

std::vector<int64_t> BpeTokenizer::encode_plain(const std::string& text,
                                                bool at_input_start) const {
  std::vector<int64_t> out;
  encode_text(text, at_input_start, out);
  return out;
}

std::string BpeTokenizer::token_bytes(int64_t id) const {
  const auto& tok = tokens_.at(static_cast<size_t>(id));
  if (is_special_[static_cast<size_t>(id)])
    return tok;
  std::string out;
  if (byte_level_) {
    for (const auto& ch : characters(tok)) {
      auto it = char_byte_.find(ch);
      if (it != char_byte_.end())
        out.push_back(static_cast<char>(it->second));
    }
    return out;
  }
  if (auto b = byte_of_token_.find(id); b != byte_of_token_.end())
    return std::string(1, static_cast<char>(b->second));
  for (size_t i = 0; i < tok.size();) {
    if (tok.compare(i, kMetaSpace.size(), kMetaSpace) == 0) {
      out.push_back(' ');
      i += kMetaSpace.size();
    } else {
      out.push_back(tok[i++]);
    }
  }
  return out;
}

std::string BpeTokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string out, run;  // run: consecutive byte tokens (SentencePiece-style)
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!byte_level_) {
      if (auto b = byte_of_token_.find(ids[i]); b != byte_of_token_.end()) {
        run.push_back(static_cast<char>(b->second));
        continue;
      }
      append_byte_run(out, run);
      run.clear();
    }
    std::string bytes = token_bytes(ids[i]);
    // Metaspace's decoder turns every U+2581 of the first token into nothing, not a space.
    if (i == 0 && decode_prefix_ == DecodePrefix::kStripFirstToken &&
        !is_special_.at(static_cast<size_t>(ids[0])))
      std::erase(bytes, ' ');
    out += bytes;
  }
  append_byte_run(out, run);
  // The Strip decoder: one space at the start of the text.
  if (decode_prefix_ == DecodePrefix::kStripLeadingSpace && !out.empty() && out[0] == ' ')
    out.erase(0, 1);
  return out;
}

}  // namespace fsdp_trainer
