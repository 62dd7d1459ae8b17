// See hf_format.h for the mapping.
#include "hf_format.h"

#include <nlohmann/json.hpp>

#include <cctype>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>

#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/core/durable_file.h>
#include <fsdp/core/file.h>
#include <fsdp/core/json_depth.h>
#include <fsdp/distributed/process_group.h>
#include <fsdp/state_dict.h>

#include "nf4_load.h"

namespace fsdp_models {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using fsdp::TensorLayout;
using fsdp::safetensors::FormatError;

constexpr const char* kWeightsFile = "model.safetensors";
constexpr const char* kConfigFile = "config.json";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Replaces the prefix `from` of `name` by `to`; false if `name` does not start with it.
bool replace_prefix(std::string& name, const std::string& from, const std::string& to) {
  if (name.rfind(from, 0) != 0)
    return false;
  name = to + name.substr(from.size());
  return true;
}

std::string gpt_hf_name(const std::string& name) {
  // Our blocks are "h<i>", transformers' "transformer.h.<i>".
  if (name.size() > 1 && name[0] == 'h' && std::isdigit(static_cast<unsigned char>(name[1])))
    return "transformer.h." + name.substr(1);
  if (name == "lm_head.weight")
    return name;
  return "transformer." + name;
}

// Our row 2i + p of each head of `head_dim` rows is the file's row p * head_dim / 2 + i.
std::vector<int64_t> rotate_half_rows(int64_t heads, int64_t head_dim) {
  std::vector<int64_t> file_row(static_cast<size_t>(heads * head_dim));
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < half; ++i)
      for (int64_t p = 0; p < 2; ++p)
        file_row[static_cast<size_t>(h * head_dim + 2 * i + p)] = h * head_dim + p * half + i;
  return file_row;
}

std::string llama_hf_name(const std::string& name) {
  std::string out = name;
  if (replace_prefix(out, "tok_embeddings.", "model.embed_tokens.") ||
      replace_prefix(out, "norm.", "model.norm.") || replace_prefix(out, "output.", "lm_head."))
    return out;
  if (!replace_prefix(out, "layers.", "model.layers."))
    throw std::invalid_argument("hf_format: no Hugging Face name for Llama parameter '" + name +
                                "'");
  static const std::pair<const char*, const char*> kParts[] = {
      {".attention.wq.", ".self_attn.q_proj."},    {".attention.wk.", ".self_attn.k_proj."},
      {".attention.wv.", ".self_attn.v_proj."},    {".attention.wo.", ".self_attn.o_proj."},
      {".feed_forward.w1.", ".mlp.gate_proj."},    {".feed_forward.w3.", ".mlp.up_proj."},
      {".feed_forward.w2.", ".mlp.down_proj."},    {".attention_norm.", ".input_layernorm."},
      {".ffn_norm.", ".post_attention_layernorm."}};
  for (const auto& [ours, theirs] : kParts) {
    const auto at = out.find(ours);
    if (at != std::string::npos)
      return out.replace(at, std::strlen(ours), theirs);
  }
  throw std::invalid_argument("hf_format: no Hugging Face name for Llama parameter '" + name + "'");
}

// config.json is a few KB: a link to /dev/zero, a FIFO or a huge file is refused unread.
constexpr uint64_t kMaxConfigBytes = uint64_t{16} << 20;

std::string read_text(const fs::path& p) {
  try {
    return fsdp::read_small_file(p.string(), kMaxConfigBytes);
  } catch (const std::runtime_error& e) {
    throw FormatError(e.what());
  }
}

// transformers picks the class from 'architectures' and the config from 'model_type': a file
// whose two disagree describes no one model, whichever of them we would believe.
void require_architecture(const Json& j, const std::string& model_type, const char* architecture,
                          const std::string& where) {
  auto it = j.find("architectures");
  if (it == j.end() || it->is_null())
    return;
  if (!it->is_array())
    throw FormatError(where + ": 'architectures' is not a list");
  for (const auto& a : *it) {
    if (!a.is_string())
      throw FormatError(where + ": 'architectures' holds a " + std::string(a.type_name()) +
                        ", not a class name");
    if (a.get<std::string>() != architecture)
      throw FormatError(where + ": 'architectures' names '" + a.get<std::string>() +
                        "' but 'model_type' is '" + model_type + "' (whose class is " +
                        architecture + ")");
  }
}

Json parse_config(const std::string& text, const std::string& where) {
  if (const auto deep = fsdp::json_too_deep(text); !deep.empty())
    throw FormatError(where + ": " + deep);
  try {
    auto j = Json::parse(text);
    if (!j.is_object())
      throw FormatError(where + ": not a JSON object");
    return j;
  } catch (const Json::exception& e) {
    throw FormatError(where + ": not valid JSON (" + e.what() + ")");
  }
}

// A field of config.json, type-checked: FormatError "<where>: 'key' ..." otherwise.
template <typename T>
T field(const Json& j, const std::string& key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end())
    throw FormatError(where + ": '" + key + "' is missing");
  try {
    if constexpr (std::is_same_v<T, int64_t>) {
      if (!it->is_number_integer() || it->get<int64_t>() <= 0)
        throw FormatError(where + ": '" + key + "' is not a positive integer");
    } else if constexpr (std::is_same_v<T, double>) {
      if (!it->is_number())
        throw FormatError(where + ": '" + key + "' is not a number");
    }
    return it->get<T>();
  } catch (const Json::exception&) {
    throw FormatError(where + ": '" + key + "' has the wrong type");
  }
}

template <typename T>
T field_or(const Json& j, const std::string& key, T fallback, const std::string& where) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? fallback : field<T>(j, key, where);
}

// The fields a loaded file must agree on with the model it is loaded into.
void require_equal(const std::string& where, const std::string& key, double file, double model) {
  auto text = [](double v) {
    std::ostringstream out;
    out << v;  // 22, 1e-05, 500000
    return out.str();
  };
  if (file != model)
    throw FormatError(where + ": '" + key + "' is " + text(file) + ", the model's is " +
                      text(model));
}

constexpr const char* kIndexFile = "model.safetensors.index.json";

// A file name from model.safetensors.index.json: a plain name inside the directory, never a
// path that leaves it (the index comes from outside).
void require_plain_name(const std::string& name, const std::string& where) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
      name.find('\\') != std::string::npos || name.find('\0') != std::string::npos)
    throw FormatError(where + ": 'weight_map' names the file '" + name +
                      "', which is not a file name inside the directory");
  if (!ends_with(name, ".safetensors"))
    throw FormatError(where + ": 'weight_map' names the file '" + name +
                      "', which is not a .safetensors file");
}

// The dtype's name in config.json's torch_dtype; only the three an export may be written in.
const char* hf_dtype_name(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kFloat32:
      return "float32";
    case torch::kBFloat16:
      return "bfloat16";
    case torch::kFloat16:
      return "float16";
    default:
      break;
  }
  TORCH_CHECK(false, "save_hf: exports are float32, bfloat16 or float16, not ", dtype);
  return "";
}

template <typename Model>
void save_hf_dir(const std::string& dir, Model& model, fsdp::ProcessGroup& group,
                 fsdp::ConsolidatedOptions options, const std::string& config_json,
                 const ExportOptions& how) {
  hf_dtype_name(how.dtype);  // refuses another dtype before anything is written
  TORCH_CHECK(how.shard_bytes >= 0, "save_hf: shard_bytes is negative");
  options.dtype = how.dtype;
  // The files and the parameters each holds, in the model's order: a new file when the next
  // tensor would take the current one past shard_bytes (save_pretrained's rule).
  std::vector<std::vector<std::string>> files(1);
  std::map<std::string, size_t> file_of;  // tensor name -> file
  int64_t in_file = 0, total = 0;
  const int64_t elem = torch::elementSize(how.dtype);
  for (const auto& s : fsdp::param_shards(*model)) {
    if (options.include && !options.include(s.name))
      continue;
    int64_t numel = 1;
    for (auto d : s.global_shape)
      numel *= d;
    const int64_t bytes = numel * elem;
    if (how.shard_bytes > 0 && in_file > 0 && in_file + bytes > how.shard_bytes) {
      files.emplace_back();
      in_file = 0;
    }
    files.back().push_back(s.name);
    file_of[options.layout ? options.layout(s.name, s.global_shape).name : s.name] =
        files.size() - 1;
    in_file += bytes;
    total += bytes;
  }
  for (auto& [name, t] : options.extra_tensors) {  // a format's constants: the first file
    if (at::isFloatingType(t.scalar_type()))
      t = t.to(how.dtype);  // stored as the weights are
    file_of[name] = 0;
    total += t.numel() * static_cast<int64_t>(t.element_size());
  }
  const size_t n = files.size();
  auto file_name = [n](size_t k) {
    if (n == 1)
      return std::string(kWeightsFile);
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k + 1, n);
    return std::string(name);
  };
  write_export_dir(
      dir, group, "save_hf",
      [&](const fs::path& tmp) {
        if (group.rank() == 0)
          fsdp::write_file_atomic((tmp / kConfigFile).string(), config_json);
        for (size_t k = 0; k < n; ++k) {
          auto part = options;
          const std::set<std::string> mine(files[k].begin(), files[k].end());
          part.include = [&mine](const std::string& name) { return mine.count(name) != 0; };
          if (k > 0)
            part.extra_tensors.clear();
          fsdp::save_consolidated((tmp / file_name(k)).string(), *model, group, part);
        }
        if (n > 1 && group.rank() == 0) {
          Json map = Json::object();
          for (const auto& [name, k] : file_of)
            map[name] = file_name(k);
          const Json index = {{"metadata", {{"total_size", total}}}, {"weight_map", map}};
          fsdp::write_file_atomic((tmp / kIndexFile).string(), index.dump(2) + "\n");
        }
      },
      how.files);
}

}  // namespace

void write_export_dir(const std::string& dir, fsdp::ProcessGroup& group, const char* what,
                      const std::function<void(const std::filesystem::path& tmp)>& fill,
                      const ExportFiles& files) {
  TORCH_CHECK(!fs::exists(dir), what, ": ", dir, " exists (exports are never overwritten)");
  for (const auto& [name, content] : files)
    TORCH_CHECK(!name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos,
                what, ": '", name, "' is not a plain file name");
  const fs::path tmp = dir + ".tmp";
  if (group.rank() == 0) {
    fs::remove_all(tmp);  // an export that died half-way
    fs::create_directories(tmp);
  }
  group.barrier();
  fill(tmp);
  if (group.rank() == 0) {
    for (const auto& [name, content] : files)
      fsdp::write_file_atomic((tmp / name).string(), content);
    fsdp::rename_durably(tmp.string(), dir);
  }
  group.barrier();
}

fsdp::ConsolidatedOptions hf_options(const GPTConfig& cfg) {
  fsdp::ConsolidatedOptions o;
  o.layout = [](const std::string& name, c10::IntArrayRef) {
    TensorLayout l{gpt_hf_name(name)};
    // GPT-2's Conv1D layers store [in, out]; the embeddings and the head are [vocab, n_embd].
    if (ends_with(name, ".c_attn.weight") || ends_with(name, ".c_proj.weight") ||
        ends_with(name, ".c_fc.weight"))
      l.kind = TensorLayout::Kind::kTransposed;
    return l;
  };
  if (!cfg.attn_bias) {
    for (int64_t i = 0; i < cfg.n_layer; ++i)
      o.extra_tensors["transformer.h." + std::to_string(i) + ".attn.c_attn.bias"] =
          torch::zeros({3 * cfg.n_embd});
  }
  o.metadata["format"] = "pt";  // what transformers writes and expects
  return o;
}

fsdp::ConsolidatedOptions hf_options(const LlamaConfig& cfg) {
  fsdp::ConsolidatedOptions o;
  const auto q_rows = rotate_half_rows(cfg.n_heads, cfg.head_dim());
  const auto k_rows = rotate_half_rows(cfg.n_kv_heads, cfg.head_dim());
  o.layout = [q_rows, k_rows](const std::string& name, c10::IntArrayRef) {
    TensorLayout l{llama_hf_name(name)};
    // A LoRA adapter's B has the weight's output rows, so it is permuted as the weight is.
    if (ends_with(name, ".attention.wq.weight") || ends_with(name, ".attention.wq.lora_B.weight")) {
      l.kind = TensorLayout::Kind::kRowPermuted;
      l.file_row = q_rows;
    } else if (ends_with(name, ".attention.wk.weight") ||
               ends_with(name, ".attention.wk.lora_B.weight")) {
      l.kind = TensorLayout::Kind::kRowPermuted;
      l.file_row = k_rows;
    }
    return l;
  };
  o.metadata["format"] = "pt";
  return o;
}

std::string hf_config_json(const GPTConfig& cfg, torch::ScalarType dtype) {
  Json j = {{"architectures", {"GPT2LMHeadModel"}},
            {"model_type", "gpt2"},
            {"vocab_size", cfg.vocab_size},
            {"n_positions", cfg.block_size},
            {"n_embd", cfg.n_embd},
            {"n_layer", cfg.n_layer},
            {"n_head", cfg.n_head},
            {"n_inner", nullptr},  // 4 * n_embd
            // torch.nn.functional.gelu(approximate="tanh"), what our MLP computes.
            {"activation_function", "gelu_pytorch_tanh"},
            {"layer_norm_epsilon", 1e-5},
            {"resid_pdrop", 0.0},
            {"embd_pdrop", 0.0},
            {"attn_pdrop", 0.0},
            {"scale_attn_weights", true},
            {"initializer_range", cfg.init_std},
            {"tie_word_embeddings", cfg.tie_embeddings},
            {"torch_dtype", hf_dtype_name(dtype)}};
  return j.dump(2) + "\n";
}

std::string hf_config_json(const LlamaConfig& cfg, torch::ScalarType dtype) {
  Json j = {{"architectures", {"LlamaForCausalLM"}},
            {"model_type", "llama"},
            {"vocab_size", cfg.vocab_size},
            {"hidden_size", cfg.dim},
            {"intermediate_size", cfg.ffn_hidden_dim},
            {"num_hidden_layers", cfg.n_layers},
            {"num_attention_heads", cfg.n_heads},
            {"num_key_value_heads", cfg.n_kv_heads},
            {"head_dim", cfg.head_dim()},
            {"hidden_act", "silu"},
            {"max_position_embeddings", cfg.max_seq_len},
            {"rms_norm_eps", cfg.norm_eps},
            {"rope_theta", cfg.rope_theta},  // transformers < 5
            {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", cfg.rope_theta}}},
            {"attention_bias", false},
            {"mlp_bias", false},
            {"initializer_range", cfg.init_std},
            {"tie_word_embeddings", cfg.tie_embeddings},
            {"torch_dtype", hf_dtype_name(dtype)}};
  return j.dump(2) + "\n";
}

GPTConfig gpt_config_from_hf(const std::string& config_json, const std::string& where) {
  const auto j = parse_config(config_json, where);
  if (field<std::string>(j, "model_type", where) != "gpt2")
    throw FormatError(where + ": 'model_type' is not 'gpt2'");
  require_architecture(j, "gpt2", "GPT2LMHeadModel", where);
  GPTConfig c;
  c.vocab_size = field<int64_t>(j, "vocab_size", where);
  c.block_size = field<int64_t>(j, "n_positions", where);
  c.n_embd = field<int64_t>(j, "n_embd", where);
  c.n_layer = field<int64_t>(j, "n_layer", where);
  c.n_head = field<int64_t>(j, "n_head", where);
  c.tie_embeddings = field_or<bool>(j, "tie_word_embeddings", true, where);
  if (c.n_embd % c.n_head != 0)
    throw FormatError(where + ": 'n_embd' is not a multiple of 'n_head'");
  if (field_or<int64_t>(j, "n_inner", 4 * c.n_embd, where) != 4 * c.n_embd)
    throw FormatError(where + ": 'n_inner' must be 4 * n_embd (our MLP's width)");
  const auto act = field_or<std::string>(j, "activation_function", "gelu_new", where);
  // gelu_new is GELU's tanh approximation written out; it equals ours up to rounding.
  if (act != "gelu_new" && act != "gelu_pytorch_tanh")
    throw FormatError(where + ": 'activation_function' is '" + act +
                      "' (supported: gelu_new, gelu_pytorch_tanh)");
  if (field_or<double>(j, "layer_norm_epsilon", 1e-5, where) != 1e-5)
    throw FormatError(where + ": 'layer_norm_epsilon' must be 1e-5");
  if (!field_or<bool>(j, "scale_attn_weights", true, where) ||
      field_or<bool>(j, "scale_attn_by_inverse_layer_idx", false, where) ||
      field_or<bool>(j, "add_cross_attention", false, where))
    throw FormatError(where + ": attention variants other than GPT-2's are not supported");
  return c;
}

LlamaConfig llama_config_from_hf(const std::string& config_json, const std::string& where) {
  const auto j = parse_config(config_json, where);
  if (field<std::string>(j, "model_type", where) != "llama")
    throw FormatError(where + ": 'model_type' is not 'llama'");
  require_architecture(j, "llama", "LlamaForCausalLM", where);
  LlamaConfig c;
  c.vocab_size = field<int64_t>(j, "vocab_size", where);
  c.dim = field<int64_t>(j, "hidden_size", where);
  c.ffn_hidden_dim = field<int64_t>(j, "intermediate_size", where);
  c.n_layers = field<int64_t>(j, "num_hidden_layers", where);
  c.n_heads = field<int64_t>(j, "num_attention_heads", where);
  c.n_kv_heads = field_or<int64_t>(j, "num_key_value_heads", c.n_heads, where);
  c.max_seq_len = field_or<int64_t>(j, "max_position_embeddings", 2048, where);
  c.norm_eps = field_or<double>(j, "rms_norm_eps", 1e-6, where);
  c.tie_embeddings = field_or<bool>(j, "tie_word_embeddings", false, where);
  if (c.dim % c.n_heads != 0 ||
      field_or<int64_t>(j, "head_dim", c.dim / c.n_heads, where) != c.dim / c.n_heads)
    throw FormatError(where + ": 'head_dim' must be hidden_size / num_attention_heads");
  if (field_or<std::string>(j, "hidden_act", "silu", where) != "silu")
    throw FormatError(where + ": 'hidden_act' must be 'silu'");
  if (field_or<bool>(j, "attention_bias", false, where) ||
      field_or<bool>(j, "mlp_bias", false, where))
    throw FormatError(where +
                      ": biases on the projections ('attention_bias', 'mlp_bias') are not "
                      "supported");
  c.rope_theta = field_or<double>(j, "rope_theta", 10000.0, where);
  if (auto rp = j.find("rope_parameters"); rp != j.end() && !rp->is_null()) {
    if (!rp->is_object())
      throw FormatError(where + ": 'rope_parameters' is not an object");
    const auto type = field_or<std::string>(*rp, "rope_type", "default", where);
    if (type != "default")
      throw FormatError(where + ": RoPE type '" + type + "' is not supported (only 'default')");
    c.rope_theta = field_or<double>(*rp, "rope_theta", c.rope_theta, where);
  }
  if (auto rs = j.find("rope_scaling"); rs != j.end() && !rs->is_null())
    throw FormatError(where + ": 'rope_scaling' is not supported");
  // FP8 and other quantized checkpoints store scales beside the weights: read as plain floats
  // they would load silently wrong.
  if (auto q = j.find("quantization_config"); q != j.end() && !q->is_null())
    throw FormatError(where + ": 'quantization_config' (a quantized checkpoint) is not supported");
  try {
    c.validate();
  } catch (const std::exception& e) {
    throw FormatError(where + ": " + e.what());
  }
  return c;
}

std::vector<std::string> hf_weight_files(const std::string& dir) {
  const fs::path index = fs::path(dir) / kIndexFile;
  const fs::path single = fs::path(dir) / kWeightsFile;
  std::error_code ec;
  // model.safetensors first, as transformers looks: a directory holding both loads the same
  // weights in either program.
  if (fs::is_regular_file(single, ec))
    return {single.string()};
  if (!fs::exists(index, ec))
    throw FormatError(dir + ": neither " + kWeightsFile + " nor " + kIndexFile +
                      " (a Hugging Face model directory holds one of them)");
  const auto where = index.string();
  const auto j = parse_config(read_text(index), where);
  const auto map = j.find("weight_map");
  if (map == j.end() || !map->is_object() || map->empty())
    throw FormatError(where + ": no 'weight_map' object naming the tensors' files");
  std::map<std::string, std::vector<std::string>> tensors_of;  // file -> the tensors it holds
  for (const auto& [tensor, file] : map->items()) {
    if (!file.is_string())
      throw FormatError(where + ": 'weight_map' entry '" + tensor + "' is not a file name");
    const auto name = file.get<std::string>();
    require_plain_name(name, where);
    tensors_of[name].push_back(tensor);
  }
  std::vector<std::string> out;
  for (const auto& [name, tensors] : tensors_of) {
    const auto path = (fs::path(dir) / name).string();
    if (!fs::is_regular_file(path, ec))  // (error_code: a name too long is "not there" too)
      throw FormatError(where + ": 'weight_map' names " + name + ", which is not in " + dir);
    // The index and the file must agree: a tensor the index places in a file that lacks it
    // means a directory assembled from different saves.
    fsdp::safetensors::Reader reader(path);
    for (const auto& t : tensors)
      if (!reader.header().find(t))
        throw FormatError(where + ": 'weight_map' places tensor '" + t + "' in " + name +
                          ", which does not hold it");
    out.push_back(path);
  }
  return out;
}

LlamaConfig read_llama_config(const std::string& dir) {
  const auto where = (fs::path(dir) / kConfigFile).string();
  return llama_config_from_hf(read_text(where), where);
}

void save_hf(const std::string& dir, GPT& model, fsdp::ProcessGroup& group,
             const ExportOptions& how) {
  const auto& cfg = model->config();
  save_hf_dir(dir, model, group, hf_options(cfg), hf_config_json(cfg, how.dtype), how);
}

void save_hf(const std::string& dir, Llama& model, fsdp::ProcessGroup& group, bool skip_adapters,
             const ExportOptions& how) {
  const auto& cfg = model->config();
  auto options = hf_options(cfg);
  for (const auto& p : model->named_parameters()) {
    const bool adapter = is_lora_adapter(p.key());
    TORCH_CHECK(skip_adapters || !adapter, "save_hf: '", p.key(),
                "' is a LoRA adapter: merge it (save_merged_hf) or save it apart "
                "(save_peft_adapter)");
    TORCH_CHECK(p.key().find("weight_nf4") == std::string::npos, "save_hf: '", p.key(),
                "' is stored in NF4; a Hugging Face file needs dense weights");
  }
  options.include = [](const std::string& name) { return !is_lora_adapter(name); };
  save_hf_dir(dir, model, group, options, hf_config_json(cfg, how.dtype), how);
}

void load_hf(const std::string& dir, GPT& model) {
  const auto where = (fs::path(dir) / kConfigFile).string();
  const auto file = gpt_config_from_hf(read_text(where), where);
  const auto& m = model->config();
  require_equal(where, "vocab_size", file.vocab_size, m.vocab_size);
  require_equal(where, "n_positions", file.block_size, m.block_size);
  require_equal(where, "n_embd", file.n_embd, m.n_embd);
  require_equal(where, "n_layer", file.n_layer, m.n_layer);
  require_equal(where, "n_head", file.n_head, m.n_head);
  require_equal(where, "tie_word_embeddings", file.tie_embeddings, m.tie_embeddings);
  const auto weights = hf_weight_files(dir);
  if (!m.attn_bias) {
    // GPT-2 always has the q/k/v bias; a model without one computes the same only if it is zero.
    for (const auto& path : weights) {
      fsdp::safetensors::Reader reader(path);
      for (int64_t i = 0; i < m.n_layer; ++i) {
        const auto name = "transformer.h." + std::to_string(i) + ".attn.c_attn.bias";
        if (reader.header().find(name) && reader.read(name).count_nonzero().item<int64_t>() != 0)
          throw FormatError(path + ": tensor '" + name +
                            "' is not zero, and the model has no q/k/v bias "
                            "(GPTConfig::attn_bias)");
      }
    }
  }
  fsdp::load_consolidated(weights, *model, hf_options(m));
}

void load_hf(const std::string& dir, Llama& model) {
  const auto where = (fs::path(dir) / kConfigFile).string();
  const auto file = llama_config_from_hf(read_text(where), where);
  const auto& m = model->config();
  require_equal(where, "vocab_size", file.vocab_size, m.vocab_size);
  require_equal(where, "hidden_size", file.dim, m.dim);
  require_equal(where, "intermediate_size", file.ffn_hidden_dim, m.ffn_hidden_dim);
  require_equal(where, "num_hidden_layers", file.n_layers, m.n_layers);
  require_equal(where, "num_attention_heads", file.n_heads, m.n_heads);
  require_equal(where, "num_key_value_heads", file.n_kv_heads, m.n_kv_heads);
  require_equal(where, "rms_norm_eps", file.norm_eps, m.norm_eps);
  require_equal(where, "rope_theta", file.rope_theta, m.rope_theta);
  require_equal(where, "tie_word_embeddings", file.tie_embeddings, m.tie_embeddings);
  auto options = hf_options(m);
  // The base: adapters keep their values. NF4 layers are quantized from the float weights below.
  options.include = [](const std::string& name) {
    return !is_lora_adapter(name) && nf4_layer(name).empty();
  };
  const auto files = hf_weight_files(dir);
  fsdp::load_consolidated(files, *model, options);
  const auto shards = fsdp::param_shards(*model);
  const auto layers = nf4_layers(shards);
  if (layers.empty())
    return;
  std::vector<std::unique_ptr<fsdp::safetensors::Reader>> readers;
  for (const auto& f : files)
    readers.push_back(std::make_unique<fsdp::safetensors::Reader>(f));
  torch::NoGradGuard no_grad;
  for (const auto& [layer, parts] : layers) {
    const auto& codes = parts[0]->global_shape;
    const std::vector<int64_t> shape{codes[0], codes[1] * 2};
    const auto l = options.layout(layer + ".weight", shape);
    const fsdp::safetensors::Reader* reader = nullptr;
    for (const auto& r : readers)
      if (r->header().find(l.name))
        reader = r.get();
    if (!reader)
      throw FormatError(dir + ": no tensor '" + l.name + "' for the NF4 layer '" + layer + "'");
    const auto& entry = *reader->header().find(l.name);
    if (!at::isFloatingType(entry.dtype) || entry.shape != shape)
      throw FormatError(reader->path() + ": tensor '" + l.name + "' is not a floating-point " +
                        c10::str(c10::IntArrayRef(shape)) + " weight for '" + layer + "'");
    // Rows in the model's order: a permuted layout (q and k) reads its rows one by one.
    load_nf4_layer(
        shape[0], shape[1],
        [&](int64_t row, int64_t rows) {
          if (l.kind != TensorLayout::Kind::kRowPermuted)
            return reader->read_rows(l.name, row, rows).to(torch::kFloat32);
          std::vector<torch::Tensor> out;
          for (int64_t r = row; r < row + rows; ++r)
            out.push_back(reader->read_rows(l.name, l.file_row[static_cast<size_t>(r)], 1));
          return torch::cat(out).to(torch::kFloat32);
        },
        parts);
  }
}

}  // namespace fsdp_models
