#include "instruct_data.h"

#include <fsdp/core/json_depth.h>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string_view>
#include <utility>

#include "config/config.h"

namespace fsdp_trainer {

namespace {

// The longest line accepted: about 250k tokens of text, far beyond any context length, so only a
// file that is not JSONL (or is corrupt) reaches it; such a line is refused before it is buffered
// whole, so that a multi-gigabyte "line" cannot exhaust memory.
constexpr size_t kMaxLineBytes = size_t{1} << 20;

[[noreturn]] void fail(const std::string& where, const std::string& problem) {
  throw ConfigError(where + problem);
}

// s on one line of at most `max` bytes: control characters become spaces (an error message is
// one line), a cut falls on a character boundary (s is valid UTF-8).
std::string one_line(std::string s, size_t max) {
  for (auto& c : s)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
      c = ' ';
  if (s.size() <= max)
    return s;
  size_t cut = max;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80)
    --cut;
  return s.substr(0, cut) + "...";
}

// A user's string in a message: JSON-quoted (escapes shown as escapes), shortened.
std::string quoted(const std::string& s) {
  return one_line(nlohmann::json(s).dump(), 40);
}

// What a JSON value is, for "found ..." in messages.
std::string kind(const nlohmann::json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::null:
      return "null";
    case nlohmann::json::value_t::object:
      return "an object";
    case nlohmann::json::value_t::array:
      return "an array";
    case nlohmann::json::value_t::string:
      return "a string";
    case nlohmann::json::value_t::boolean:
      return "a boolean";
    default:
      return "a number";
  }
}

// "" if s is valid UTF-8 as RFC 3629 defines it (shortest form only, no UTF-16 surrogates,
// nothing above U+10FFFF), else the first problem and its 1-based column. nlohmann's parser
// checks strings too, but says only "ill-formed UTF-8 byte"; this names the kind of damage
// (a file in Latin-1, a string cut mid-character, CESU-8 surrogates) and covers the whole line.
std::string utf8_problem(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    if (b < 0x80) {
      ++i;
      continue;
    }
    auto at = [&](const char* what) {
      char byte[8];
      std::snprintf(byte, sizeof byte, "0x%02X", b);
      return "invalid UTF-8 at column " + std::to_string(i + 1) + " (byte " + byte + "): " + what;
    };
    size_t n = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // the range of the second byte (Unicode table 3-7)
    if (b < 0xC0)
      return at("a continuation byte with no lead byte");
    if (b < 0xC2)
      return at("an overlong encoding");
    if (b < 0xE0) {
      n = 2;
    } else if (b < 0xF0) {
      n = 3;
      lo = b == 0xE0 ? 0xA0 : 0x80;
      hi = b == 0xED ? 0x9F : 0xBF;
    } else if (b < 0xF5) {
      n = 4;
      lo = b == 0xF0 ? 0x90 : 0x80;
      hi = b == 0xF4 ? 0x8F : 0xBF;
    } else {
      return at("a byte that never occurs in UTF-8");
    }
    for (size_t k = 1; k < n; ++k) {
      if (i + k >= s.size())
        return at("a sequence truncated by the end of the line");
      const auto c = static_cast<unsigned char>(s[i + k]);
      if (c < 0x80 || c > 0xBF)
        return at("a truncated sequence");
      if (k == 1 && (c < lo || c > hi))
        return at(b == 0xED   ? "a UTF-16 surrogate (U+D800..U+DFFF)"
                  : b == 0xF4 ? "a code point above U+10FFFF"
                              : "an overlong encoding");
    }
    i += n;
  }
  return "";
}

// nlohmann's reason without its exception tag, and with "line 1" dropped: a JSONL line is
// parsed alone, so the column is what locates the problem.
std::string json_reason(const nlohmann::json::exception& e) {
  std::string r = e.what();
  if (auto p = r.find("] "); p != std::string::npos)
    r = r.substr(p + 2);
  constexpr std::string_view lead = "parse error at line 1, ";
  if (r.starts_with(lead))
    return " at " + one_line(r.substr(lead.size()), 200);
  return ": " + one_line(r, 200);
}

// Message `which`'s string under `key`, or an error naming what is there instead.
const std::string& string_field(const nlohmann::json& m, const char* key, const std::string& which,
                                const std::string& where) {
  const auto it = m.find(key);
  if (it == m.end())
    fail(where, which + " has no \"" + key + "\"");
  if (!it->is_string())
    fail(where, which + "'s \"" + key + "\" is " + kind(*it) + ", not a string");
  return it->get_ref<const std::string&>();
}

// Only whitespace (or nothing).
bool blank(std::string_view line) {
  return line.find_first_not_of(" \t\n\r\f\v") == std::string_view::npos;
}

// The conversation on one line; `where` is "<path>:<line>: ".
std::vector<ChatMessage> parse_line(std::string_view line, const std::string& where) {
  if (auto nul = line.find('\0'); nul != std::string_view::npos)
    fail(where, "NUL byte at column " + std::to_string(nul + 1) +
                    " (a binary file, or UTF-16 rather than UTF-8?)");
  if (auto bad = utf8_problem(line); !bad.empty())
    fail(where, bad);
  if (const auto deep = fsdp::json_too_deep(line); !deep.empty())
    fail(where, deep);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(line.begin(), line.end());
  } catch (const nlohmann::json::exception& e) {  // parse_error, and out_of_range for 1e999
    fail(where, "invalid JSON" + json_reason(e));
  }
  if (!j.is_object())
    fail(where, "the line is " + kind(j) +
                    ", not an object; each line is one conversation, {\"messages\": [...]}");
  const auto it = j.find("messages");
  if (it == j.end())
    fail(where, "no \"messages\" key; each line is one conversation, {\"messages\": [...]}");
  if (!it->is_array())
    fail(where, "\"messages\" is " + kind(*it) + ", not an array");
  std::vector<ChatMessage> messages;
  bool has_assistant = false;
  for (size_t k = 0; k < it->size(); ++k) {
    const auto& m = (*it)[k];
    const std::string which = "message " + std::to_string(k + 1);
    if (!m.is_object())
      fail(where, which + " is " + kind(m) + ", not an object {\"role\": ..., \"content\": ...}");
    const auto& r = string_field(m, "role", which, where);
    if (r != "system" && r != "user" && r != "assistant")
      fail(where, which + " has the unknown role " + quoted(r) + " (system, user or assistant)");
    const auto& c = string_field(m, "content", which, where);
    // "\u0000" in JSON: valid, but no text has it; it marks binary data pasted into a data set.
    if (c.find('\0') != std::string::npos)
      fail(where, which + "'s content has a NUL character (\\u0000)");
    // The order ChatML models are trained on, and the only one their templates render
    // sensibly: an optional system message first, then user and assistant in turn. A system
    // message later on would be a second system prompt the model never sees at inference;
    // an answer with no question, or two questions in a row, is a data set's mistake (a lost
    // line, turns merged wrongly) better shown than learned.
    if (r == "system") {
      if (k != 0)
        fail(where, which +
                        " is a system message after the conversation began; a system "
                        "message may only come first");
    } else {
      const bool first = messages.empty() || messages.back().role == "system";
      if (first && r == "assistant")
        fail(where, which +
                        " is an assistant message with no user message before it; the "
                        "conversation starts with the user (after an optional system message)");
      if (!first && messages.back().role == r)
        fail(where, "messages " + std::to_string(k) + " and " + std::to_string(k + 1) +
                        " are both " + r + " messages; user and assistant must take turns");
      // An empty question prompts nothing, an empty answer teaches the model to answer nothing.
      // (An empty system message is kept: it is how a data set says "no system prompt".)
      if (blank(c))
        fail(where, which + " (" + r + ") is empty");
    }
    has_assistant = has_assistant || r == "assistant";
    messages.push_back({r, c});
  }
  if (!has_assistant)
    fail(where, "no assistant message: the conversation has nothing to learn");
  return messages;
}

// ex.target from the ids of `text`: the byte spans [begin, end) that are targets, and where
// the tokenizer put a word-boundary space before a stretch of plain text (`prefixed`: the
// index of its first id).
void mark_targets(const std::string& text, const std::vector<std::pair<size_t, size_t>>& spans,
                  const std::vector<std::pair<size_t, bool>>& prefixed, const BpeTokenizer& tok,
                  InstructExample& ex) {
  ex.target.assign(ex.ids.size(), 0);
  // Each token's bytes, in order, are the text (BPE loses nothing; a prefix space aside): a
  // token is a target if its bytes overlap a span, or if it has none (a lone prefix space)
  // and stands inside one. Checking the bytes as we go verifies the offsets.
  size_t pos = 0, s = 0, next_prefix = 0;
  for (size_t i = 0; i < ex.ids.size(); ++i) {
    std::string bytes = tok.token_bytes(ex.ids[i]);
    if (next_prefix < prefixed.size() && prefixed[next_prefix].first == i) {
      ++next_prefix;
      if (bytes.empty() || bytes[0] != ' ')
        throw std::logic_error("encode_conversation: no prefix space where one was put");
      bytes.erase(0, 1);
    }
    // A SentencePiece-style token spells a space and a U+2581 of the text alike (both are
    // U+2581 to it).
    size_t end = pos;
    for (const char c : bytes) {
      if (end < text.size() && text[end] == c)
        ++end;
      else if (c == ' ' && !tok.byte_level() && text.compare(end, 3, "\xE2\x96\x81") == 0)
        end += 3;
      else
        throw std::logic_error("encode_conversation: the tokens do not spell the text at byte " +
                               std::to_string(end));
    }
    while (s < spans.size() && spans[s].second <= pos)
      ++s;
    ex.target[i] = s < spans.size() && pos < spans[s].second &&
                   (spans[s].first < end || (bytes.empty() && spans[s].first <= pos));
    pos = end;
  }
  if (pos != text.size())
    throw std::logic_error("encode_conversation: the tokens spell " + std::to_string(pos) +
                           " of the text's " + std::to_string(text.size()) + " bytes");
}

}  // namespace

InstructExample encode_conversation(const std::vector<ChatMessage>& messages,
                                    const BpeTokenizer& tok, const ChatTemplate& tmpl) {
  const auto pieces = tmpl.pieces(messages, /*add_generation_prompt=*/false);
  std::string text;
  // The template's own delimiters (and only these) are control tokens, at these byte offsets;
  // the targets are byte ranges [begin, end) of the text.
  std::vector<std::pair<size_t, std::string_view>> delims;
  std::vector<std::pair<size_t, size_t>> spans;
  for (const auto& p : pieces) {
    if (p.special)
      delims.emplace_back(text.size(), p.text);
    if (p.target) {
      if (!spans.empty() && spans.back().second == text.size())
        spans.back().second += p.text.size();
      else
        spans.emplace_back(text.size(), text.size() + p.text.size());
    }
    text += p.text;
  }

  // The text between the delimiters is encoded as ordinary text: a message that spells
  // "<|im_end|>" or "<|im_start|>assistant" gets those characters' ordinary tokens, so that no
  // content can end its message early or forge a turn. For content without such text the ids
  // are tok.encode(text)'s, which splits the text at the same places.
  InstructExample ex;
  // Where each stretch of plain text starts among the ids, and whether the tokenizer put a
  // word-boundary space before it (SentencePiece-style prefixes): that space is in the first
  // token's bytes but not in the text.
  std::vector<std::pair<size_t, bool>> prefixed;
  auto encode_plain = [&](size_t begin, size_t end) {
    const auto part = text.substr(begin, end - begin);
    if (tok.adds_space_prefix(part, begin == 0))
      prefixed.emplace_back(ex.ids.size(), true);
    const auto ids = tok.encode_plain(part, begin == 0);
    ex.ids.insert(ex.ids.end(), ids.begin(), ids.end());
  };
  size_t plain = 0;
  for (const auto& [pos, delim] : delims) {
    const int64_t id = tok.special_id(std::string(delim));
    if (id < 0)
      throw std::runtime_error("the tokenizer has no special token " + std::string(delim) +
                               ", which the " + tmpl.family_name() + " chat template needs");
    encode_plain(plain, pos);
    ex.ids.push_back(id);
    plain = pos + delim.size();
  }
  encode_plain(plain, text.size());
  mark_targets(text, spans, prefixed, tok, ex);
  return ex;
}

std::vector<InstructExample> load_instruct_jsonl(const std::string& path, const BpeTokenizer& tok,
                                                 const ChatTemplate& tmpl, int64_t max_tokens) {
  if (max_tokens <= 0)
    throw std::invalid_argument("load_instruct_jsonl: max_tokens must be positive, not " +
                                std::to_string(max_tokens));
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw ConfigError(path + ": cannot read: it is a directory");
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw ConfigError(path + ": cannot read: " + std::strerror(errno));

  std::vector<InstructExample> examples;
  int64_t number = 1;  // of the line being read
  auto where = [&] { return path + ":" + std::to_string(number) + ": "; };
  auto too_long = [&] {
    fail(where(), "the line is longer than 1 MiB (" + std::to_string(kMaxLineBytes) +
                      " bytes); is this a JSONL file?");
  };
  auto finish = [&](std::string& line) {
    if (!line.empty() && line.back() == '\r')  // Windows line ending
      line.pop_back();
    if (line.size() > kMaxLineBytes)
      too_long();
    if (blank(line))
      return;
    const auto messages = parse_line(line, where());
    if (const auto problem = tmpl.problem(messages); !problem.empty())
      fail(where(), problem);
    InstructExample ex;
    try {
      ex = encode_conversation(messages, tok, tmpl);
    } catch (const UnencodableByte& e) {
      fail(where(), e.what());
    } catch (const std::runtime_error& e) {
      // The tokenizer's own limits (ICU's regex overflows its backtracking stack on a run of
      // some 300k spaces): still the user's line, so say which one.
      fail(where(), std::string("the tokenizer failed on it: ") + e.what());
    }
    if (static_cast<int64_t>(ex.ids.size()) > max_tokens)
      fail(where(), "the conversation is " + std::to_string(ex.ids.size()) +
                        " tokens, more than the limit of " + std::to_string(max_tokens) +
                        " (shorten or split it)");
    ex.line = number;
    examples.push_back(std::move(ex));
  };

  // Lines are cut from fixed-size blocks, not read by std::getline, which would buffer a line
  // of any length before its size could be checked.
  std::string line;
  std::vector<char> block(size_t{1} << 16);
  while (in.read(block.data(), static_cast<std::streamsize>(block.size())) || in.gcount() > 0) {
    const size_t got = static_cast<size_t>(in.gcount());
    for (size_t i = 0; i < got;) {
      const auto* nl = static_cast<const char*>(std::memchr(block.data() + i, '\n', got - i));
      const size_t end = nl ? static_cast<size_t>(nl - block.data()) : got;
      if (line.size() + (end - i) > kMaxLineBytes + 1)  // + 1: a '\r' before the '\n'
        too_long();
      line.append(block.data() + i, end - i);
      if (!nl)
        break;
      finish(line);
      line.clear();
      ++number;
      i = end + 1;
    }
  }
  if (in.bad())
    throw ConfigError(path + ": cannot read: " + std::strerror(errno));
  if (!line.empty())  // the last line has no newline
    finish(line);
  if (examples.empty())
    throw ConfigError(path + ": no examples: the file is empty or all its lines are blank");
  return examples;
}

}  // namespace fsdp_trainer
