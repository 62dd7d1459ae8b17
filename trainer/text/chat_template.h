// Chat templates: turn a conversation into the text an instruct model was trained on.
//
// A model's template is Jinja. Rather than embed a Jinja engine, this recognises the template
// families our models use and renders them in C++; any other template is refused by name (one
// line), never rendered wrongly:
//   ChatML    (SmolLM2, Qwen and others)  <|im_start|>{role}\n{content}<|im_end|>\n ...
//             [<|im_start|>assistant\n], with the default system message the template inserts
//             when the conversation has none (read out of the template). Recognised by the
//             expression every ChatML template renders a message with.
//   Llama 3   (Meta-Llama-3-*-Instruct)   {bos}<|start_header_id|>{role}<|end_header_id|>\n\n
//             {content, trimmed}<|eot_id|> ... [<|start_header_id|>assistant<|end_header_id|>\n\n]
//   Mistral   (Mistral-7B-Instruct v0.1, v0.2)  {bos}[INST] {user} [/INST]{assistant}{eos}...;
//             user and assistant alternate, no system role.
// Llama 3 and Mistral are recognised by the whole template (whitespace inside Jinja tags and
// whitespace control aside), so that a later template with more logic (Llama 3.1's dates and
// tools) is refused rather than rendered as its predecessor. The tests render every family with
// transformers' apply_chat_template and compare the text (tests/trainer/test_chat_template.cpp).
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace fsdp_trainer {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant"
  std::string content;
};

/// One piece of a rendered conversation (ChatTemplate::pieces).
struct ChatPiece {
  std::string text;
  /// A delimiter the template writes as one special token of the tokenizer (<|im_start|>, bos).
  bool special = false;
  /// What fine-tuning learns to emit: an assistant's content and the token that ends its turn.
  bool target = false;
};

enum class ChatFamily { kChatML, kLlama3, kMistral };

class ChatTemplate {
 public:
  /// `where` names the file in errors; `bos_token` and `eos_token` are the tokenizer's texts of
  /// them, which templates may write. Throws std::runtime_error "<where>: the chat template is
  /// none of ChatML, Llama 3, Mistral ...".
  ChatTemplate(const std::string& jinja, const std::string& where, std::string bos_token = "",
               std::string eos_token = "");

  ChatFamily family() const { return family_; }
  /// "ChatML", "Llama 3", "Mistral".
  const char* family_name() const;
  /// Why the template cannot render `messages` ("" if it can): Mistral's has no system role and
  /// needs user and assistant in turn, starting with the user.
  std::string problem(const std::vector<ChatMessage>& messages) const;
  /// The conversation in pieces; with `add_generation_prompt`, ends with the assistant's opener
  /// (Mistral's template has none: its prompt ends with the user's [/INST]). Throws
  /// std::runtime_error with problem() if there is one.
  std::vector<ChatPiece> pieces(const std::vector<ChatMessage>& messages,
                                bool add_generation_prompt) const;
  /// The pieces' text.
  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const;
  const std::string& default_system() const { return default_system_; }
  /// The special token that ends an assistant's turn: <|im_end|>, <|eot_id|>, or eos (Mistral).
  const std::string& end_of_turn() const { return end_of_turn_; }
  /// The content of the last user message in a rendered prompt (`rendered` if it has none).
  std::string last_user_message(const std::string& rendered) const;

 private:
  ChatFamily family_ = ChatFamily::kChatML;
  std::string default_system_;  // ChatML only; empty: the template adds none
  std::string bos_, eos_, end_of_turn_;
  std::string mistral_after_eos_;  // v0.1 writes a space after each answer's eos
};

}  // namespace fsdp_trainer
