// See include/fsdp/plan/units.h.
#include <fsdp/plan/units.h>

#include <c10/util/Exception.h>

#include <map>

namespace fsdp::plan {

std::vector<UnitInfo> describe_units(torch::nn::Module& model,
                                     const std::vector<std::string>& unit_paths) {
  const auto modules = model.named_modules("", /*include_self=*/true);
  std::map<std::string, size_t> index;  // path -> position in unit_paths
  for (size_t i = 0; i < unit_paths.size(); ++i) {
    TORCH_CHECK(modules.contains(unit_paths[i]), "fsdp::plan: '", unit_paths[i],
                "' is not a module of the model");
    TORCH_CHECK(index.emplace(unit_paths[i], i).second, "fsdp::plan: unit '", unit_paths[i],
                "' listed twice");
  }
  std::vector<UnitInfo> units(unit_paths.size());
  for (size_t i = 0; i < unit_paths.size(); ++i)
    units[i].path = unit_paths[i];
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    // The innermost listed module: the longest listed prefix of the name ending at a dot.
    std::string owner;
    bool found = false;
    for (size_t dot = name.rfind('.'); !found; dot = name.rfind('.', dot - 1)) {
      const std::string prefix = dot == std::string::npos ? "" : name.substr(0, dot);
      if (index.count(prefix)) {
        owner = prefix;
        found = true;
      }
      if (dot == std::string::npos || dot == 0)
        break;
    }
    TORCH_CHECK(found, "fsdp::plan: parameter '", name,
                "' is in no unit (list \"\" to make the model itself the root unit)");
    const auto& p = item.value();
    units[index.at(owner)].params.push_back(
        {name, p.sizes().vec(), p.scalar_type(), p.requires_grad()});
  }
  return units;
}

}  // namespace fsdp::plan
