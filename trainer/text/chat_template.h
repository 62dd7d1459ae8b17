// Chat templates of ChatML models (SmolLM2, Qwen and others): turns a conversation into the
// text the model was trained on,
//   <|im_start|>{role}\n{content}<|im_end|>\n ... [<|im_start|>assistant\n]
// with the default system message the template inserts when the conversation has none. The
// template in the model file is Jinja; rather than embed a Jinja engine, this recognises the
// ChatML family by its defining expression and reads the default system message out of it;
// any other template is refused by name (one line), never rendered wrongly.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace fsdp_trainer {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant"
  std::string content;
};

class ChatTemplate {
 public:
  /// `where` names the file in errors.
  ChatTemplate(const std::string& jinja, const std::string& where);
  /// The conversation as text; with `add_generation_prompt`, ends with the assistant's opener.
  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const;
  const std::string& default_system() const { return default_system_; }

 private:
  std::string default_system_;  // empty: the template adds none
};

}  // namespace fsdp_trainer
