// See compute_dtype.h.
#include "compute_dtype.h"

#include <fmt/core.h>

namespace fsdp_trainer {

torch::ScalarType dtype_named(const std::string& name) {
  if (name == "fp32")
    return torch::kFloat;
  if (name == "bf16")
    return torch::kBFloat16;
  if (name == "fp16")
    return torch::kHalf;
  TORCH_CHECK(false, "unknown dtype '", name, "' (allowed: fp32, bf16, fp16)");
}
namespace {

// "36.0x slower than fp32 (1.7 vs 60.8 GFLOP/s, ...)" or "2.2x faster than fp32 (...)".
std::string comparison(const std::string& low, const DtypeSpeeds& s) {
  const bool slower = s.low < s.fp32;
  const double ratio = slower ? s.fp32 / s.low : s.low / s.fp32;
  return fmt::format(
      "this machine's {} matmuls are {:.1f}x {} than fp32 ({:.1f} vs {:.1f} GFLOP/s per rank, "
      "a training step's matmuls at {})",
      low, ratio, slower ? "slower" : "faster", s.low / 1e9, s.fp32 / 1e9, s.shape);
}

}  // namespace

bool needs_dtype_speeds(const std::string& requested, bool cuda) {
  return !cuda && requested != "fp32";
}

std::string candidate_dtype(const std::string& requested) {
  return requested == "auto" ? "bf16" : requested;
}

ComputeDtype choose_compute_dtype(const std::string& requested, bool cuda,
                                  const DtypeSpeeds& speeds) {
  ComputeDtype out;
  if (requested != "auto") {
    out.dtype = requested;
    out.reason = fmt::format("compute dtype {} (precision.param_dtype)", requested);
    if (!cuda && requested != "fp32" && speeds.low > 0 && speeds.fp32 > 0 &&
        speeds.low < speeds.fp32) {
      out.warning =
          fmt::format("warning: precision.param_dtype = {}: {}; fp32 or auto would train faster",
                      requested, comparison(requested, speeds));
    }
    return out;
  }
  if (cuda) {
    out.dtype = "bf16";
    out.reason = "compute dtype bf16 (precision.param_dtype = auto): a GPU";
    return out;
  }
  // Equal speed goes to bf16: it also halves what the all-gathers move and what gathered
  // parameters and activations occupy.
  out.dtype = speeds.low >= speeds.fp32 && speeds.low > 0 ? "bf16" : "fp32";
  out.reason = fmt::format("compute dtype {} (precision.param_dtype = auto): {}", out.dtype,
                           comparison("bf16", speeds));
  return out;
}

}  // namespace fsdp_trainer
