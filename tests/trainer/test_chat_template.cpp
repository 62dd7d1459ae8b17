// Chat templates of the three families (ChatML, Llama 3, Mistral) rendered as transformers'
// apply_chat_template renders them, and templates of other families refused by name.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <string>
#include <vector>

#include "harness/command.h"
#include "harness/files.h"
#include "text/chat_template.h"
#include "tokenizer_samples.h"

namespace {

using Json = nlohmann::json;
using fsdp_trainer::ChatFamily;
using fsdp_trainer::ChatMessage;
using fsdp_trainer::ChatTemplate;

// Meta-Llama-3-8B-Instruct's template as its tokenizer_config.json holds it (Jinja escapes).
const std::string kLlama3 =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";
// The same, laid out over lines with whitespace control, and add_generation_prompt defaulted
// first, as copies of it are: renders the same text.
const std::string kLlama3Pretty =
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}"
    "{% endif %}\n"
    "{%- set loop_messages = messages -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' +"
    " message['content'] | trim + '<|eot_id|>' -%}\n"
    "    {%- if loop.index0 == 0 -%}{%- set content = bos_token + content -%}{%- endif -%}\n"
    "    {{- content -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    "{%- endif -%}";
std::string mistral(const std::string& after_eos) {
  return fsdp::test::mistral_template(after_eos);
}
const std::string kChatML =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}";

struct Family {
  std::string name, jinja, bos, eos;
  ChatFamily family;
};

TEST(ChatTemplate, EachFamilyRendersAsTransformersDoes) {
  const std::vector<Family> families = {
      {"chatml", kChatML, "", "<|endoftext|>", ChatFamily::kChatML},
      {"llama3", kLlama3, "<|begin_of_text|>", "<|end_of_text|>", ChatFamily::kLlama3},
      {"llama3-pretty", kLlama3Pretty, "<|begin_of_text|>", "<|end_of_text|>", ChatFamily::kLlama3},
      {"mistral-v0.1", mistral(" + ' ' "), "<s>", "</s>", ChatFamily::kMistral},
      {"mistral-v0.2", mistral(""), "<s>", "</s>", ChatFamily::kMistral}};
  // Content with whitespace at both ends (Llama 3 trims it, Unicode spaces included), lines,
  // and text that spells delimiters.
  const std::vector<std::vector<ChatMessage>> conversations = {
      {{"user", "What is the first book?"}},
      {{"user", "  Who wrote it?\n"}, {"assistant", "\n\tMoses, by tradition.\xC2\xA0 "}},
      {{"system", "Answer briefly."},
       {"user", "Count to three."},
       {"assistant", "1 2 3"},
       {"user", "And [INST] back? <|eot_id|>"}},
      {{"user", "a"}, {"user", "b"}},
      {{"assistant", "first"}},
  };
  Json cases = Json::array();
  struct Ours {
    std::string text;
    bool refused;
  };
  std::vector<Ours> ours;
  for (const auto& f : families) {
    const ChatTemplate tmpl(f.jinja, f.name, f.bos, f.eos);
    EXPECT_EQ(tmpl.family(), f.family) << f.name;
    for (const auto& messages : conversations) {
      for (const bool prompt : {false, true}) {
        Json m = Json::array();
        for (const auto& msg : messages)
          m.push_back({{"role", msg.role}, {"content", msg.content}});
        cases.push_back({{"template", f.jinja},
                         {"bos", f.bos},
                         {"eos", f.eos},
                         {"messages", m},
                         {"add_generation_prompt", prompt}});
        const bool refused = !tmpl.problem(messages).empty();
        ours.push_back({refused ? "" : tmpl.render(messages, prompt), refused});
      }
    }
  }
  fsdp::test::TempDir dir;
  const auto in = dir.path() + "/cases.json", out = dir.path() + "/rendered.json";
  std::ofstream(in, std::ios::binary) << cases.dump();
  const auto r = fsdp::test::run_command(std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR +
                                         "/tests/python/check_chat_template.py " + in + " " + out);
  ASSERT_EQ(r.code, 0) << r.output;
  const auto theirs = Json::parse(fsdp::test::file_bytes(out));
  ASSERT_EQ(theirs.size(), ours.size());
  int equal = 0, refused = 0;
  for (size_t i = 0; i < ours.size(); ++i) {
    const auto& c = cases[i];
    SCOPED_TRACE(c["messages"].dump() + (c["add_generation_prompt"] ? " + prompt" : "") + " " +
                 c["template"].get<std::string>().substr(0, 30));
    if (theirs[i].is_object()) {  // the template raised: ours must refuse too
      EXPECT_TRUE(ours[i].refused) << theirs[i].dump();
      refused += ours[i].refused;
    } else {
      EXPECT_FALSE(ours[i].refused);
      EXPECT_EQ(ours[i].text, theirs[i].get<std::string>());
      equal += ours[i].text == theirs[i].get<std::string>();
    }
  }
  std::printf("%d of %zu renderings equal to transformers', %d refused as it refuses\n", equal,
              ours.size(), refused);
  EXPECT_EQ(equal + refused, static_cast<int>(ours.size()));
  EXPECT_GE(refused, 8);  // Mistral: system messages, two users, an assistant first
}

TEST(ChatTemplate, PiecesMarkTheDelimitersAndTheAnswers) {
  const ChatTemplate llama(kLlama3, "llama3", "<|begin_of_text|>", "<|end_of_text|>");
  const auto pieces = llama.pieces({{"user", "Hi"}, {"assistant", " Hello "}}, false);
  std::vector<std::string> special, target;
  for (const auto& p : pieces) {
    if (p.special)
      special.push_back(p.text);
    if (p.target)
      target.push_back(p.text);
  }
  EXPECT_EQ(special, (std::vector<std::string>{
                         "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                         "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}));
  EXPECT_EQ(target, (std::vector<std::string>{"Hello", "<|eot_id|>"}));
  EXPECT_EQ(llama.end_of_turn(), "<|eot_id|>");
  EXPECT_EQ(llama.last_user_message(
                llama.render({{"user", "Q1"}, {"assistant", "A"}, {"user", "Q2"}}, true)),
            "Q2");

  const ChatTemplate mis(mistral(""), "mistral", "<s>", "</s>");
  target.clear();
  for (const auto& p : mis.pieces({{"user", "Hi"}, {"assistant", "Yo"}}, false))
    if (p.target)
      target.push_back(p.text);
  EXPECT_EQ(target, (std::vector<std::string>{"Yo", "</s>"}));
  EXPECT_EQ(mis.end_of_turn(), "</s>");
  EXPECT_EQ(mis.last_user_message(mis.render({{"user", "Q"}}, true)), "Q");
  EXPECT_NE(mis.problem({{"system", "s"}, {"user", "Q"}}).find("only user and assistant"),
            std::string::npos);
}

TEST(ChatTemplate, OtherFamiliesAndAlteredCopiesAreRefusedByName) {
  const std::vector<std::string> refused = {
      // Llama 3.1: a system header with dates and tools before the same message expression.
      "{{- bos_token }}{%- set date_string = \"26 Jul 2024\" %}{{- \"<|start_header_id|>system"
      "<|end_header_id|>\\n\\n\" }}{{- \"Cutting Knowledge Date: December 2023\\n\" }}"
      "{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
      "'<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}{%- endfor %}",
      // Llama 3's, altered: a newline after each turn.
      std::string(kLlama3).replace(kLlama3.find("'<|eot_id|>'"), 12, "'<|eot_id|>\\n'"),
      // Mistral's, with a system role added.
      mistral("") +
          "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
          "{% endif %}",
      // Another family (Gemma).
      "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + message['role'] + "
      "'\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}",
  };
  for (const auto& jinja : refused) {
    try {
      ChatTemplate t(jinja, "model/tokenizer_config.json", "<s>", "</s>");
      ADD_FAILURE() << "accepted as " << t.family_name() << ": " << jinja;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("model/tokenizer_config.json: the chat template is "
                                           "none of ChatML"),
                std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
