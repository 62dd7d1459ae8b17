// LoRA, QLoRA and PEFT's adapter files; see lora.h.
#include "lora.h"

#include <torch/torch.h>

#include <cmath>
#include <map>
#include <regex>

#include <fsdp/state_dict.h>

namespace fsdp_models {
namespace {

std::string last_component(const std::string& name) {
  const auto dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(dot + 1);
}

}  // namespace

std::vector<std::pair<std::string, std::shared_ptr<LinearImpl>>> adapted_linears(
    torch::nn::Module& model) {
  std::vector<std::pair<std::string, std::shared_ptr<LinearImpl>>> out;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    auto linear = std::dynamic_pointer_cast<LinearImpl>(item.value());
    if (linear && !is_lora_adapter(item.key()))
      out.emplace_back(item.key(), linear);
  }
  return out;
}

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
  for (auto& [name, linear] : adapted_linears(model)) {
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
  for (auto& [name, linear] : adapted_linears(model)) {
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
  for (auto& [name, linear] : adapted_linears(model))
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

}  // namespace fsdp_models
