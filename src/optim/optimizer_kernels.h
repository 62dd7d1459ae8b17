// The element-wise update kernels of the fused optimizers (fsdp::FusedAdamW, fsdp::FusedSGD).
//
// src/optim/optimizer_kernels.cpp is compiled once per CPU capability (DEFAULT, AVX2, AVX512), each
// time with that capability's compiler flags and ATen's CPU_CAPABILITY macro, so at::vec picks
// its 512-, 256-bit or scalar implementation; kernels() returns the table of the best
// capability the CPU has (as ATen decides it: at::get_cpu_capability(), which honours the
// ATEN_CPU_CAPABILITY environment variable). Every capability gives bitwise the same result:
// the rounding of each operation is written out (explicit fused multiply-adds where the
// formula has them, -ffp-contract=off everywhere else), so thread count, chunking and ISA
// never change the numbers.
#pragma once

#include <cstdint>
#include <string>

namespace fsdp::detail {

/// One parameter's AdamW scalars for one step, computed in double and rounded to float as
/// torch::optim::AdamW rounds them (ATen converts a double Scalar to the tensor's dtype).
struct AdamWScalars {
  float decay = 1;  // 1 - lr * weight_decay
  bool apply_decay = false;
  float beta1 = 0, one_minus_beta1 = 0, beta2 = 0, one_minus_beta2 = 0;
  float bias_correction2_sqrt = 1, eps = 0, neg_step_size = 0;  // -lr / bias_correction1
  bool amsgrad = false;
  uint32_t rounding_key = 0;  // bf16 moments: stochastic rounding stream of this param and step
};

/// A run of `n` consecutive elements of one parameter. `first` is the index of element 0 within
/// the parameter: the stochastic rounding of bf16 moments is a function of (key, index), so it
/// does not depend on how the elements were cut into pieces.
struct AdamWSpan {
  float* param = nullptr;
  const float* grad = nullptr;
  void* exp_avg = nullptr;  // float or bf16 (uint16_t bits), per `bf16_moments`
  void* exp_avg_sq = nullptr;
  void* max_exp_avg_sq = nullptr;  // amsgrad only
  int64_t n = 0;
  int64_t first = 0;
};

/// torch::optim::SGD's scalars for one parameter and step.
struct SGDScalars {
  float weight_decay = 0;  // L2, added to the gradient (torch's SGD is not decoupled)
  bool apply_weight_decay = false;
  float momentum = 0, one_minus_dampening = 1, neg_lr = 0;
  bool use_momentum = false, nesterov = false;
  bool first = false;  // the momentum buffer starts as a copy of the gradient
  uint32_t rounding_key = 0;
};

struct SGDSpan {
  float* param = nullptr;
  const float* grad = nullptr;
  void* momentum_buffer = nullptr;  // float or bf16 bits
  int64_t n = 0;
  int64_t first = 0;
};

using AdamWKernel = void (*)(const AdamWScalars&, const AdamWSpan&, bool bf16_moments);
using SGDKernel = void (*)(const SGDScalars&, const SGDSpan&, bool bf16_moments);

struct KernelTable {
  const char* capability;  // "DEFAULT", "AVX2", "AVX512"
  AdamWKernel adamw;
  SGDKernel sgd;
};

/// The table for this CPU (chosen once).
const KernelTable& kernels();
/// The table of one capability, or nullptr if this CPU cannot run it (tests compare them).
const KernelTable* kernels_for(const std::string& capability);

// One per compiled capability (src/optim/optimizer_kernels.cpp).
const KernelTable& kernel_table_DEFAULT();
const KernelTable& kernel_table_AVX2();
const KernelTable& kernel_table_AVX512();

}  // namespace fsdp::detail
