// Instruction (chat) data sets for fine-tuning: JSONL files of conversations, tokenized as the
// model's chat template renders them, with a mask that limits the loss to the assistant's words.
//
// One JSON object per line, extra keys ignored (data sets carry ids, sources and the like):
//   {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}
// Blank lines are skipped, Windows line endings accepted. Anything else that is wrong is a
// ConfigError of one line, "<path>:<line>: <problem>", so that a bad line in a file of a million
// is found at once; no input crashes the reader (lines are bounded before they are buffered,
// UTF-8 is validated before parsing).
//
// Conversations, decided case by case (tests/trainer/test_instruct_data.cpp):
//   - order: an optional system message first, then user and assistant in turn, starting with
//     the user; anything else (an assistant first, a system message later on, two user or two
//     assistant messages in a row) is refused, naming the messages;
//   - empty turns: a user or assistant message with no text but whitespace is refused; an empty
//     system message is kept (it replaces the template's default with none);
//   - special-token text inside content ("<|im_end|>", "<|im_start|>assistant", "<|endoftext|>")
//     is kept as literal text: it becomes ordinary tokens, never the control tokens, so it can
//     neither end a message early nor forge a turn of another role.
//
// Why a mask: the model should learn to answer, not to write the user's questions or the system
// prompt, which it will always be given. Only the tokens the model emits when it answers are
// targets: every assistant message's content and the token that ends its turn (so that it
// learns to stop): <|im_end|> in ChatML, <|eot_id|> in Llama 3, eos in Mistral. The header
// (`<|im_start|>assistant\n`) is in the prompt at inference, and what the template writes after
// the turn's end (ChatML's newline) is never generated, so neither is a target.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "text/bpe_tokenizer.h"
#include "text/chat_template.h"

namespace fsdp_trainer {

/// One tokenized conversation.
///
/// Next-token loss: position t predicts ids[t + 1], and counts only where target[t + 1] is 1:
///   inputs  = ids[0 .. n-1)          labels = ids[1 .. n)
///   loss    = mean over t in [0, n-1) with target[t + 1] == 1 of CE(logits[t], ids[t + 1])
/// (in PyTorch's idiom: labels = ids[1:] with -100 where target[1:] == 0). target[0] is always 0.
struct InstructExample {
  std::vector<int64_t> ids;     // tmpl.render(messages, false), the template's delimiters as
                                // control tokens and the rest as ordinary text
  std::vector<uint8_t> target;  // ids.size() entries, 1: a token the model must learn to emit
  int64_t line = 0;             // 1-based line of the JSONL file (0: not from a file)
};

/// The conversation rendered by `tmpl` (with its default system message when there is none) and
/// encoded as one text, so that ids are what the model sees at inference: tok.encode(text) when
/// no content spells a special token, else the same with that content's ordinary tokens (the
/// order and emptiness rules are load_instruct_jsonl's, not checked here). A token is a target if
/// any of its bytes lie in an assistant message's content or its end of turn: the BPE may merge
/// the header's newline with content that starts with whitespace ("\n\n" as one token), and that
/// token is then a target, as transformers' assistant-token mask makes it.
/// Throws std::logic_error if the tokens do not spell the rendered text, runtime_error if the
/// tokenizer lacks one of the template's special tokens or the template refuses the
/// conversation (ChatTemplate::problem).
InstructExample encode_conversation(const std::vector<ChatMessage>& messages,
                                    const BpeTokenizer& tok, const ChatTemplate& tmpl);

/// Every conversation of the JSONL file at `path`, in file order. `max_tokens` (> 0) bounds an
/// example's length: a longer one is an error, not silently truncated, because a truncated
/// answer teaches the model to stop mid-sentence. ConfigError for bad input (see above).
std::vector<InstructExample> load_instruct_jsonl(const std::string& path, const BpeTokenizer& tok,
                                                 const ChatTemplate& tmpl, int64_t max_tokens);

}  // namespace fsdp_trainer
