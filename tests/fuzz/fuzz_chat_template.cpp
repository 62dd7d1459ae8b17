// libFuzzer target for the chat template (trainer/text/chat_template.h) and the encoding of a
// conversation for fine-tuning (encode_conversation, trainer/data/instruct_data.h), with
// SmolLM2's template and tokenizer (smollm2.h). The first input byte picks the mode:
//   bit 0 clear: the rest is a conversation, messages of [role byte][length byte][content]
//     (role % 4: system, user, assistant, or "tool", which render must also pass through);
//     contents are any bytes, special-token text included (tests/fuzz/chat_template/dict).
//     Bit 1: render with the generation prompt.
//   bit 0 set: the rest is a Jinja template, which ChatTemplate accepts or refuses with
//     runtime_error; an accepted one renders a fixed conversation as its family does (ChatML,
//     Llama 3, Mistral: the corpus holds their published templates to mutate).
// Invariants (traps): render writes ChatML exactly (the default system message when the first
// message is not a system one, then each message); the encoded ids decode to the rendered text,
// their only special tokens are one <|im_start|> and one <|im_end|> per rendered message (content
// that spells them stays ordinary text); the targets are, per assistant message, one run of
// tokens that ends with its content and <|im_end|>. A conversation holding a byte the vocabulary
// has no token for is refused with UnencodableByte, naming it. Built and run by scripts/fuzz.sh.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "data/instruct_data.h"
#include "smollm2.h"

namespace {

using fsdp_trainer::ChatMessage;

std::string chatml(const std::vector<ChatMessage>& messages, const std::string& default_system,
                   bool generation_prompt) {
  std::string out;
  if (!default_system.empty() && !messages.empty() && messages[0].role != "system")
    out += "<|im_start|>system\n" + default_system + "<|im_end|>\n";
  for (const auto& m : messages)
    out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
  if (generation_prompt)
    out += "<|im_start|>assistant\n";
  return out;
}

void conversation(const uint8_t* data, size_t size, bool generation_prompt) {
  static const char* roles[] = {"system", "user", "assistant", "tool"};
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i + 2 <= size;) {
    const char* role = roles[data[i] % 4];
    const size_t n = std::min<size_t>(data[i + 1], size - i - 2);
    messages.push_back({role, std::string(reinterpret_cast<const char*>(data) + i + 2, n)});
    i += 2 + n;
  }
  const auto& s = fsdp_fuzz::smollm2();
  const std::string text = s.tmpl.render(messages, generation_prompt);
  if (text != chatml(messages, s.tmpl.default_system(), generation_prompt))
    __builtin_trap();
  fsdp_trainer::InstructExample ex;
  try {
    ex = fsdp_trainer::encode_conversation(messages, s.tok, s.tmpl);
  } catch (const fsdp_trainer::UnencodableByte& e) {
    // Refused only for a byte the vocabulary lacks that a message holds.
    if (s.tok.can_encode_byte(e.byte) || text.find(static_cast<char>(e.byte)) == std::string::npos)
      __builtin_trap();
    return;
  }
  const std::string plain = s.tmpl.render(messages, false);
  if (ex.ids.size() != ex.target.size() || s.tok.decode(ex.ids) != plain)
    __builtin_trap();
  if (messages.empty() ? !ex.ids.empty() : ex.target[0] != 0)
    __builtin_trap();
  const size_t turns = messages.size() + (!s.tmpl.default_system().empty() && !messages.empty() &&
                                          messages[0].role != "system");
  size_t starts = 0, ends = 0;
  for (auto id : ex.ids) {
    starts += id == s.im_start;
    ends += id == s.im_end;
    if (s.tok.is_special(id) && id != s.im_start && id != s.im_end)
      __builtin_trap();  // content became a control token
  }
  if (starts != turns || ends != turns)
    __builtin_trap();
  // The runs of targets, decoded: one per answer, its content and <|im_end|> at the end, at most
  // the header's newline before (merged with content that starts with whitespace).
  std::vector<std::string> runs;
  for (size_t i = 0; i < ex.ids.size(); ++i) {
    if (!ex.target[i])
      continue;
    if (i == 0 || !ex.target[i - 1])
      runs.emplace_back();
    runs.back() += s.tok.decode({ex.ids[i]});
  }
  size_t k = 0;
  for (const auto& m : messages) {
    if (m.role != "assistant")
      continue;
    if (k >= runs.size())
      __builtin_trap();
    const std::string answer = m.content + "<|im_end|>";
    const auto& r = runs[k++];
    if (r.size() < answer.size() || r.size() > answer.size() + 1 ||
        r.compare(r.size() - answer.size(), answer.size(), answer) != 0)
      __builtin_trap();
  }
  if (k != runs.size())
    __builtin_trap();
}

void jinja(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const fsdp_trainer::ChatTemplate t(text, "fuzz", "<s>", "</s>");
    const std::vector<ChatMessage> m = {{"user", "Hi"}, {"assistant", "Hello"}};
    const std::string r = t.render(m, true);
    switch (t.family()) {
      case fsdp_trainer::ChatFamily::kChatML:
        if (r != chatml(m, t.default_system(), true))
          __builtin_trap();
        break;
      case fsdp_trainer::ChatFamily::kLlama3:
        if (r !=
            "<s><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>"
            "assistant<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant"
            "<|end_header_id|>\n\n")
          __builtin_trap();
        break;
      case fsdp_trainer::ChatFamily::kMistral:
        if (r != "<s>[INST] Hi [/INST]Hello</s>" && r != "<s>[INST] Hi [/INST]Hello</s> ")
          __builtin_trap();
        break;
    }
  } catch (const std::runtime_error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0)
    return 0;
  if (data[0] & 1)
    jinja(data + 1, size - 1);
  else
    conversation(data + 1, size - 1, data[0] & 2);
  return 0;
}
