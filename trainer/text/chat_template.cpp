#include "chat_template.h"

#include <stdexcept>
#include <string_view>

namespace fsdp_trainer {
namespace {

// Templates write the newline inside their string literals either as itself or as the escape
// \n: one form for matching.
std::string unescape_newlines(const std::string& jinja) {
  std::string out;
  for (size_t i = 0; i < jinja.size(); ++i) {
    if (jinja[i] == '\\' && i + 1 < jinja.size() && jinja[i + 1] == 'n') {
      out += '\n';
      ++i;
    } else {
      out += jinja[i];
    }
  }
  return out;
}

// The template as its rendering depends on it: whitespace inside tags dropped (outside string
// literals), whitespace control ({%- -%}) applied to the text around tags, comments dropped.
// Text between tags is kept, so a template that writes newlines between its tags differs.
std::string normalized(const std::string& jinja_text) {
  const std::string jinja = unescape_newlines(jinja_text);
  std::string out;
  size_t i = 0;
  auto is_space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (i < jinja.size()) {
    if (jinja[i] != '{' || i + 1 >= jinja.size() ||
        (jinja[i + 1] != '{' && jinja[i + 1] != '%' && jinja[i + 1] != '#')) {
      out += jinja[i++];
      continue;
    }
    const char kind = jinja[i + 1];
    const char close = kind == '{' ? '}' : kind;
    size_t j = i + 2;
    std::string inner;
    char quote = 0;
    for (; j + 1 < jinja.size(); ++j) {
      const char c = jinja[j];
      if (quote) {
        inner += c;
        if (c == '\\' && j + 2 < jinja.size())
          inner += jinja[++j];
        else if (c == quote)
          quote = 0;
      } else if (c == close && jinja[j + 1] == '}') {
        break;
      } else if (c == '\'' || c == '"') {
        quote = c;
        inner += c;
      } else if (!is_space(c)) {
        inner += c;
      }
    }
    if (j + 1 >= jinja.size())  // unclosed: keep the rest as text, which matches nothing
      return out + jinja.substr(i);
    const bool trim_before = !inner.empty() && inner.front() == '-';
    const bool trim_after = !inner.empty() && inner.back() == '-';
    if (trim_before) {
      inner.erase(0, 1);
      while (!out.empty() && is_space(out.back()))
        out.pop_back();
    }
    if (trim_after)
      inner.pop_back();
    if (kind != '#')
      out += std::string("{") + kind + inner + close + "}";
    i = j + 2;
    if (trim_after)
      while (i < jinja.size() && is_space(jinja[i]))
        ++i;
  }
  // Some copies first default add_generation_prompt, which changes nothing rendered.
  const std::string preamble =
      "{%ifnotadd_generation_promptisdefined%}"
      "{%setadd_generation_prompt=false%}{%endif%}";
  if (out.rfind(preamble, 0) == 0)
    out.erase(0, preamble.size());
  return out;
}

// The published templates these families are recognised by (as they appear in the models'
// tokenizer_config.json, Jinja escapes included).
constexpr const char* kLlama3 =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";
// Mistral-7B-Instruct: v0.1 writes a space after each answer's eos, v0.2 does not.
std::string mistral(const std::string& after_answer) {
  return "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
         "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
         "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
         "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == "
         "'assistant' %}{{ message['content'] + eos_token" +
         after_answer +
         "}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
         "{% endif %}{% endfor %}";
}

// Python's str.strip() (Jinja's trim): whitespace at both ends, Unicode's included.
std::string trimmed(const std::string& s) {
  // Length of the whitespace character starting at s[i] (0 if none).
  auto space_at = [&](size_t i) -> size_t {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == ' ' || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F))
      return 1;
    for (std::string_view w : {"\xC2\x85", "\xC2\xA0", "\xE1\x9A\x80", "\xE2\x80\xA8",
                               "\xE2\x80\xA9", "\xE2\x80\xAF", "\xE2\x81\x9F", "\xE3\x80\x80"})
      if (s.compare(i, w.size(), w) == 0)
        return w.size();
    if (s.compare(i, 2, "\xE2\x80") == 0 && i + 2 < s.size() &&
        static_cast<unsigned char>(s[i + 2]) <= 0x8A)  // U+2000..U+200A
      return 3;
    return 0;
  };
  size_t begin = 0;
  while (begin < s.size()) {
    const size_t n = space_at(begin);
    if (n == 0)
      break;
    begin += n;
  }
  // From the end: step back over whole characters (continuation bytes are 10xxxxxx).
  size_t end = s.size();
  while (end > begin) {
    size_t start = end - 1;
    while (start > begin && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80)
      --start;
    if (space_at(start) != end - start)
      break;
    end = start;
  }
  return s.substr(begin, end - begin);
}

}  // namespace

ChatTemplate::ChatTemplate(const std::string& jinja_text, const std::string& where,
                           std::string bos_token, std::string eos_token)
    : bos_(std::move(bos_token)), eos_(std::move(eos_token)) {
  const std::string form = normalized(jinja_text);
  if (form == normalized(kLlama3)) {
    family_ = ChatFamily::kLlama3;
    end_of_turn_ = "<|eot_id|>";
    return;
  }
  for (const char* after : {" + ' ' ", ""}) {
    if (form == normalized(mistral(after))) {
      family_ = ChatFamily::kMistral;
      mistral_after_eos_ = std::string(*after ? " " : "");
      if (eos_.empty())
        throw std::runtime_error(where + std::string(": the Mistral chat template needs an eos "
                                                     "token"));
      end_of_turn_ = eos_;
      return;
    }
  }
  const std::string jinja = unescape_newlines(jinja_text);
  // The expression every ChatML template renders each message with.
  const std::string message =
      "'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'";
  if (jinja.find(message) == std::string::npos)
    throw std::runtime_error(where +
                             ": the chat template is none of ChatML (<|im_start|>role ... "
                             "<|im_end|>), Llama 3 or Mistral (v0.1, v0.2) instruct; only those "
                             "are applied");
  family_ = ChatFamily::kChatML;
  end_of_turn_ = "<|im_end|>";
  // "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n...
  // <|im_end|>\n' }}{% endif %}": the default system message.
  const std::string opener = "messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n";
  if (auto at = jinja.find(opener); at != std::string::npos) {
    const auto begin = at + opener.size();
    const auto end = jinja.find("<|im_end|>", begin);
    if (end == std::string::npos)
      throw std::runtime_error(where + ": the chat template's default system message is unclosed");
    default_system_ = jinja.substr(begin, end - begin);
  }
  if (jinja.find("add_generation_prompt") == std::string::npos ||
      jinja.find("'<|im_start|>assistant\n'") == std::string::npos)
    throw std::runtime_error(where + ": the chat template has no ChatML generation prompt");
}

const char* ChatTemplate::family_name() const {
  switch (family_) {
    case ChatFamily::kChatML:
      return "ChatML";
    case ChatFamily::kLlama3:
      return "Llama 3";
    case ChatFamily::kMistral:
      return "Mistral";
  }
  return "?";
}

std::string ChatTemplate::problem(const std::vector<ChatMessage>& messages) const {
  if (family_ != ChatFamily::kMistral)
    return "";
  for (size_t i = 0; i < messages.size(); ++i) {
    const auto& role = messages[i].role;
    if (role != "user" && role != "assistant")
      return "message " + std::to_string(i + 1) + " is a " + role +
             " message; the Mistral template has only user and assistant roles";
    if ((role == "user") != (i % 2 == 0))
      return "message " + std::to_string(i + 1) +
             ": the Mistral template needs user and assistant in turn, starting with the user";
  }
  return "";
}

std::vector<ChatPiece> ChatTemplate::pieces(const std::vector<ChatMessage>& messages,
                                            bool add_generation_prompt) const {
  if (const auto p = problem(messages); !p.empty())
    throw std::runtime_error(p);
  std::vector<ChatPiece> out;
  auto text = [&](std::string s, bool target = false) {
    if (!s.empty())
      out.push_back({std::move(s), false, target});
  };
  auto special = [&](const std::string& s, bool target = false) {
    if (!s.empty())
      out.push_back({s, true, target});
  };
  switch (family_) {
    case ChatFamily::kChatML:
      if (!default_system_.empty() && !messages.empty() && messages.front().role != "system") {
        special("<|im_start|>");
        text("system\n" + default_system_);
        special("<|im_end|>");
        text("\n");
      }
      for (const auto& m : messages) {
        const bool answer = m.role == "assistant";
        special("<|im_start|>");
        text(m.role + "\n");
        text(m.content, answer);
        special("<|im_end|>", answer);
        text("\n");
      }
      if (add_generation_prompt) {
        special("<|im_start|>");
        text("assistant\n");
      }
      break;
    case ChatFamily::kLlama3:
      if (!messages.empty())
        special(bos_);
      for (const auto& m : messages) {
        const bool answer = m.role == "assistant";
        special("<|start_header_id|>");
        text(m.role);
        special("<|end_header_id|>");
        text("\n\n");
        text(trimmed(m.content), answer);
        special("<|eot_id|>", answer);
      }
      if (add_generation_prompt) {
        special("<|start_header_id|>");
        text("assistant");
        special("<|end_header_id|>");
        text("\n\n");
      }
      break;
    case ChatFamily::kMistral:
      special(bos_);
      for (const auto& m : messages) {
        if (m.role == "user") {
          text("[INST] " + m.content + " [/INST]");
        } else {
          text(m.content, true);
          special(eos_, true);
          text(mistral_after_eos_);
        }
      }
      break;
  }
  // Adjacent text pieces of the same kind are one piece (the tokenizer sees them as one run).
  std::vector<ChatPiece> merged;
  for (auto& p : out) {
    if (!merged.empty() && !p.special && !merged.back().special && merged.back().target == p.target)
      merged.back().text += p.text;
    else
      merged.push_back(std::move(p));
  }
  return merged;
}

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages,
                                 bool add_generation_prompt) const {
  std::string out;
  for (const auto& p : pieces(messages, add_generation_prompt))
    out += p.text;
  return out;
}

std::string ChatTemplate::last_user_message(const std::string& rendered) const {
  std::string open, close;
  switch (family_) {
    case ChatFamily::kChatML:
      open = "<|im_start|>user\n", close = "<|im_end|>";
      break;
    case ChatFamily::kLlama3:
      open = "<|start_header_id|>user<|end_header_id|>\n\n", close = "<|eot_id|>";
      break;
    case ChatFamily::kMistral:
      open = "[INST] ", close = " [/INST]";
      break;
  }
  const auto at = rendered.rfind(open);
  if (at == std::string::npos)
    return rendered;
  const auto begin = at + open.size();
  return rendered.substr(begin, rendered.find(close, begin) - begin);
}

}  // namespace fsdp_trainer
