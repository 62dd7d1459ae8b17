// PEFT's adapter files and merged exports; see peft.h.
#include "peft.h"

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <map>
#include <set>

#include <fsdp/checkpoint/consolidated.h>
#include <fsdp/core/durable_file.h>
#include <fsdp/distributed/collectives.h>
#include <fsdp/distributed/process_group.h>
#include <fsdp/state_dict.h>

#include "hf_format.h"
#include "lora.h"

namespace fsdp_models {
namespace {

namespace fs = std::filesystem;

// The Hugging Face name of one of our Llama's Linear layers ("layers.0.attention.wq" ->
// "q_proj").
std::string hf_module(const std::string& name) {
  const std::string ours = name.substr(name.rfind('.') + 1);  // npos + 1 == 0: the whole name
  static const std::map<std::string, std::string> kNames{
      {"wq", "q_proj"},    {"wk", "k_proj"},  {"wv", "v_proj"},    {"wo", "o_proj"},
      {"w1", "gate_proj"}, {"w3", "up_proj"}, {"w2", "down_proj"}, {"output", "lm_head"}};
  const auto it = kNames.find(ours);
  TORCH_CHECK(it != kNames.end(), "no Hugging Face name for Llama layer '", ours, "'");
  return it->second;
}

}  // namespace

void save_peft_adapter(const std::string& dir, Llama& model, fsdp::ProcessGroup& group,
                       const std::string& base_model, const ExportFiles& files) {
  // One rank, alpha and dropout for the whole model (PEFT's config holds one of each).
  std::set<std::string> targets;
  int64_t rank = 0;
  double alpha = 0;
  for (auto& [name, linear] : adapted_linears(*model)) {
    if (!linear->has_lora())
      continue;
    const int64_t r = linear->lora_A->out_features();
    const double a = linear->lora_scaling() * static_cast<double>(r);
    TORCH_CHECK(rank == 0 || (r == rank && a == alpha), "save_peft_adapter: layer '", name,
                "' has rank ", r, " and alpha ", a, ", others ", rank, " and ", alpha,
                " (PEFT's config holds one of each)");
    rank = r, alpha = a;
    targets.insert(hf_module(name));
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
  write_export_dir(
      dir, group, "save_peft_adapter",
      [&](const fs::path& tmp) {
        if (group.rank() == 0)
          fsdp::write_file_atomic((tmp / "adapter_config.json").string(), config.dump(2) + "\n");
        fsdp::save_consolidated((tmp / "adapter_model.safetensors").string(), *model, group,
                                options);
      },
      files);
}

void save_merged_hf(const std::string& dir, Llama& model, fsdp::ProcessGroup& group,
                    const ExportOptions& options) {
  torch::NoGradGuard no_grad;
  std::map<std::string, fsdp::ParamShard> shards;
  for (auto& s : fsdp::param_shards(*model))
    shards.emplace(s.name, s);
  // Merge into the weights' shards, keeping the originals to put back bit for bit.
  std::vector<std::pair<torch::Tensor, torch::Tensor>> originals;  // (shard, copy)
  for (auto& [name, linear] : adapted_linears(*model)) {
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
    auto buf = full_a.to(c10::Device(group.device_type()));
    fsdp::all_reduce(group, buf, fsdp::ReduceOp::kSum, "save_merged_hf " + name)->wait();
    full_a = buf.cpu();
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
    save_hf(dir, model, group, /*skip_adapters=*/true, options);
  } catch (...) {
    restore();
    throw;
  }
  restore();
}

}  // namespace fsdp_models
