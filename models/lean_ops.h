// Element-wise operations of the Llama block written as autograd functions that keep only what
// their backward cannot recompute cheaply: their inputs.
//
// Why: composed from ATen ops, autograd keeps every intermediate a backward formula names. For
// RMSNorm in bf16 that is the input converted to fp32 (twice the bytes of the input); for
// SwiGLU's silu(a) * b it is a, silu(a) and b. Per token per block of SmolLM2 (width 576,
// SwiGLU 1536, bf16) that is 4.6 KiB of the 22.5 KiB a block keeps for backward (measured with
// saved-tensor hooks on the same ops); these functions keep the input of each norm in its own
// dtype plus one fp32 scale per row, and a and b, and recompute the rest in backward (element-wise
// work, no matmul). Gradients equal the composed ops' to float rounding (tests/test_lean_ops.cpp).
#pragma once

#include <torch/types.h>

namespace fsdp_models {

/// (x * rsqrt(mean(x^2, -1) + eps)) in fp32, converted to x's dtype, times weight: Meta's
/// RMSNorm (normalise in fp32, scale in x's dtype). Keeps x and one fp32 scale per row.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

/// silu(a) * b, SwiGLU's gate. Keeps a and b.
torch::Tensor swiglu(const torch::Tensor& a, const torch::Tensor& b);

}  // namespace fsdp_models
