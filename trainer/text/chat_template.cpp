#include "chat_template.h"

#include <stdexcept>

namespace fsdp_trainer {

ChatTemplate::ChatTemplate(const std::string& jinja_text, const std::string& where) {
  // Templates write the newline inside their string literals either as itself or as the
  // escape \n: one form for matching.
  std::string jinja;
  for (size_t i = 0; i < jinja_text.size(); ++i) {
    if (jinja_text[i] == '\\' && i + 1 < jinja_text.size() && jinja_text[i + 1] == 'n') {
      jinja += '\n';
      ++i;
    } else {
      jinja += jinja_text[i];
    }
  }
  // The expression every ChatML template renders each message with.
  const std::string message =
      "'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'";
  if (jinja.find(message) == std::string::npos)
    throw std::runtime_error(where +
                             ": the chat template is not ChatML (<|im_start|>role ... "
                             "<|im_end|>); only ChatML templates are applied");
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

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages,
                                 bool add_generation_prompt) const {
  std::string out;
  if (!default_system_.empty() && !messages.empty() && messages.front().role != "system")
    out += "<|im_start|>system\n" + default_system_ + "<|im_end|>\n";
  for (const auto& m : messages)
    out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
  if (add_generation_prompt)
    out += "<|im_start|>assistant\n";
  return out;
}

}  // namespace fsdp_trainer
