// LoRA, QLoRA and PEFT's adapter files; see lora.h.
#include "lora.h"

#include <torch/torch.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <cmath>
#include <filesystem>
#include <map>
#include <regex>
#include <set>

#include <fsdp/consolidated.h>
#include <fsdp/durable_file.h>
#include <fsdp/process_group.h>
#include <fsdp/state_dict.h>

#include "hf_format.h"

namespace fsdp_models {
namespace {

namespace fs = std::filesystem;

std::string last_component(const std::string& name) {
  const auto dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(dot + 1);
}

// Every Linear under `model` that is not an adapter, by name.
std::vector<std::pair<std::string, std::shared_ptr<LinearImpl>>> linears(torch::nn::Module& model) {
  std::vector<std::pair<std::string, std::shared_ptr<LinearImpl>>> out;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    auto linear = std::dynamic_pointer_cast<LinearImpl>(item.value());
    if (linear && !is_lora_adapter(item.key()))
      out.emplace_back(item.key(), linear);
  }
  return out;
}

// The Hugging Face name of one of our Llama's Linear layers (its last component).
std::string hf_module(const std::string& ours) {
  static const std::map<std::string, std::string> kNames{
      {"wq", "q_proj"},    {"wk", "k_proj"},  {"wv", "v_proj"},    {"wo", "o_proj"},
      {"w1", "gate_proj"}, {"w3", "up_proj"}, {"w2", "down_proj"}, {"output", "lm_head"}};
  const auto it = kNames.find(ours);
  TORCH_CHECK(it != kNames.end(), "no Hugging Face name for Llama layer '", ours, "'");
  return it->second;
}

}  // namespace

std::vector<std::string> add_lora(torch::nn::Module& model, const std::string& targets,
                                  const LoraOptions& options, const ModelInit& init) {
  std::regex pattern;
  try {
    pattern = std::regex(targets, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    TORCH_CHECK(false, "LoRA targets '", targets,
                "' is not a valid regular expression: ", e.what());
  }
  std::vector<std::string> adapted;
  for (auto& [name, linear] : linears(model)) {
    if (!std::regex_match(name, pattern) && !std::regex_match(last_component(name), pattern))
      continue;
    linear->add_lora(options, init);
    adapted.push_back(name);
  }
  TORCH_CHECK(!adapted.empty(), "LoRA targets '", targets, "' match no Linear layer");
  for (auto& p : model.named_parameters())
    p.value().set_requires_grad(is_lora_adapter(p.key()));
  return adapted;
}

std::vector<std::string> use_nf4(torch::nn::Module& model, bool quantize) {
  std::vector<std::string> done;
  for (auto& [name, linear] : linears(model)) {
    if (name.rfind("layers.", 0) != 0)
      continue;
    linear->use_nf4(quantize, linear->weight.device());
    done.push_back(name);
  }
  return done;
}

std::vector<torch::Tensor> trainable_parameters(torch::nn::Module& model) {
  std::vector<torch::Tensor> out;
  for (auto& p : model.parameters())
    if (p.requires_grad())
      out.push_back(p);
  return out;
}

InitScheme lora_init_scheme(InitScheme base, torch::nn::Module& model) {
  // A rule sees only a name, so the bound of each lora_A (which depends on its input width) is
  // looked up in a table made from the model now.
  std::map<std::string, double> a_bound;
  for (auto& [name, linear] : linears(model))
    if (linear->has_lora())
      a_bound[name + ".lora_A.weight"] =
          1.0 / std::sqrt(static_cast<double>(linear->in_features()));
  return [base = std::move(base), a_bound](const std::string& fqn) -> InitRule {
    if (fqn.ends_with("lora_B.weight"))
      return InitRule::constant(0.0);
    if (const auto it = a_bound.find(fqn); it != a_bound.end())
      return InitRule::uniform(it->second);
    return base(fqn);
  };
}

void save_peft_adapter(const std::string& dir, Llama& model, fsdp::ProcessGroup& group,
                       const std::string& base_model) {
  // One rank, alpha and dropout for the whole model (PEFT's config holds one of each).
  std::set<std::string> targets;
  int64_t rank = 0;
  double alpha = 0;
  for (auto& [name, linear] : linears(*model)) {
    if (!linear->has_lora())
      continue;
    const int64_t r = linear->lora_A->out_features();
    const double a = linear->lora_scaling() * static_cast<double>(r);
    TORCH_CHECK(rank == 0 || (r == rank && a == alpha), "save_peft_adapter: layer '", name,
                "' has rank ", r, " and alpha ", a, ", others ", rank, " and ", alpha,
                " (PEFT's config holds one of each)");
    rank = r, alpha = a;
    targets.insert(hf_module(last_component(name)));
  }
  TORCH_CHECK(rank > 0, "save_peft_adapter: the model has no LoRA adapters");
  auto options = hf_options(model->config());
  auto layout = options.layout;
  options.layout = [layout](const std::string& name, c10::IntArrayRef shape) {
    auto l = layout(name, shape);
    l.name = "base_model.model." + l.name;
    return l;
  };
  options.include = [](const std::string& name) { return is_lora_adapter(name); };
  options.dtype = torch::kFloat32;
  nlohmann::json config = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"r", rank},
      {"lora_alpha", alpha},
      {"lora_dropout", 0.0},
      {"target_modules", std::vector<std::string>(targets.begin(), targets.end())},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"inference_mode", true},
      {"base_model_name_or_path", base_model.empty() ? nullptr : nlohmann::json(base_model)},
  };
  write_export_dir(dir, group, "save_peft_adapter", [&](const fs::path& tmp) {
    if (group.rank() == 0)
      fsdp::write_file_atomic((tmp / "adapter_config.json").string(), config.dump(2) + "\n");
    fsdp::save_consolidated((tmp / "adapter_model.safetensors").string(), *model, group, options);
  });
}

void save_merged_hf(const std::string& dir, Llama& model, fsdp::ProcessGroup& group) {
  torch::NoGradGuard no_grad;
  std::map<std::string, fsdp::ParamShard> shards;
  for (auto& s : fsdp::param_shards(*model))
    shards.emplace(s.name, s);
  // Merge into the weights' shards, keeping the originals to put back bit for bit.
  std::vector<std::pair<torch::Tensor, torch::Tensor>> originals;  // (shard, copy)
  for (auto& [name, linear] : linears(*model)) {
    if (!linear->has_lora())
      continue;
    TORCH_CHECK(!linear->is_nf4(), "save_merged_hf: '", name,
                "' is stored in NF4; merging needs a dense weight");
    const auto& w = shards.at(name + ".weight");
    const auto& b = shards.at(name + ".lora_B.weight");
    const auto& a = shards.at(name + ".lora_A.weight");
    // B's rows are the weight's rows (both have out_features rows, sharded alike); A is small
    // (rank x in): every rank assembles it whole with one all-reduce of its rows.
    TORCH_CHECK(b.row_begin == w.row_begin && b.rows == w.rows, "save_merged_hf: '", name,
                "': lora_B is not sharded as the weight");
    auto full_a = torch::zeros(a.global_shape, torch::kFloat32);
    if (a.writer && a.rows > 0)
      full_a.narrow(0, a.row_begin, a.rows).copy_(a.shard);
    const auto device = c10::Device(group.device_type());
    std::vector<at::Tensor> buf{full_a.to(device)};
    group.backend().allreduce(buf)->wait();
    full_a = buf[0].cpu();
    if (w.rows == 0)
      continue;
    originals.emplace_back(w.shard, w.shard.clone());
    auto delta = torch::matmul(b.shard.to(torch::kFloat32), full_a) * linear->lora_scaling();
    w.shard.copy_(w.shard.to(torch::kFloat32) + delta);
  }
  auto restore = [&] {
    for (auto& [shard, copy] : originals)
      shard.copy_(copy);
  };
  try {
    save_hf(dir, model, group, /*skip_adapters=*/true);
  } catch (...) {
    restore();
    throw;
  }
  restore();
}

}  // namespace fsdp_models
