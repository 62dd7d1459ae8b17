// Picks the fused optimizer kernels for this CPU, as ATen picks its own (so ATEN_CPU_CAPABILITY
// forces both, which is how the AVX2 path is benchmarked on an AVX-512 machine).
#include <ATen/Version.h>

#include "optimizer_kernels.h"

namespace fsdp::detail {

const KernelTable* kernels_for(const std::string& capability) {
  // at::get_cpu_capability() names the best capability this CPU (and the environment) allows;
  // anything at or below it can run.
  const std::string best = at::get_cpu_capability();
  auto rank = [](const std::string& c) {
    return c == "AVX512" ? 2 : c == "AVX2" ? 1 : c == "DEFAULT" ? 0 : -1;
  };
  if (rank(capability) < 0 || rank(capability) > rank(best))
    return nullptr;
  if (capability == "AVX512")
    return &kernel_table_AVX512();
  if (capability == "AVX2")
    return &kernel_table_AVX2();
  return &kernel_table_DEFAULT();
}

const KernelTable& kernels() {
  static const KernelTable& table = [] {
    const KernelTable* t = kernels_for(at::get_cpu_capability());
    return t ? *t : kernel_table_DEFAULT();
  }();
  return table;
}

}  // namespace fsdp::detail
