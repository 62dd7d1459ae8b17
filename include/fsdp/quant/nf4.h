// 4-bit NormalFloat (NF4) storage of frozen weights, as QLoRA defines it and bitsandbytes
// implements it, with the quantization constants quantized again ("double quantization").
//
// A weight w of n elements (flattened row-major) is cut into blocks of 64. Each block keeps its
// absmax a_b = max |w_i| and, per element, the index of the NF4 value nearest to w_i / a_b: 16
// values, quantiles of N(0, 1) scaled to [-1, 1] with an exact zero, two indices per byte (the
// even element in the high nibble). The absmaxes are then stored in 8 bits: their mean m is
// subtracted, and the centred values are quantized in blocks of 256 with bitsandbytes' signed
// dynamic 8-bit code, each block keeping one fp32 absmax. Storage per element:
// 4 + 8/64 + 32/(64*256) = 4.127 bits.
//
// Under FSDP the four tensors are frozen parameters of the layer, so they are what each rank
// holds a shard of and what the all-gather moves: 4.13 bits per weight instead of 16 or 32.
// The weight is dequantized after the gather, in forward and again in backward
// (nf4::linear), so no full-precision copy outlives the operation that needs it.
//
// Equal to bitsandbytes' quantize_4bit(quant_type="nf4", blocksize=64, compress_statistics=True)
// on CPU: same codes, same dequantized values (tests/python/check_nf4.py).
#pragma once

#include <torch/types.h>

#include <array>
#include <cstdint>

namespace fsdp::nf4 {

/// Elements per absmax block, and absmaxes per block of the second quantization.
constexpr int64_t kBlock = 64;
constexpr int64_t kScaleBlock = 256;

/// The 16 NF4 values, ascending, from -1 to 1 with 0 at index 7.
const std::array<float, 16>& values();
/// The signed dynamic 8-bit code of the second quantization (256 values, ascending), built as
/// bitsandbytes' create_dynamic_map(signed=True) builds it.
const std::array<float, 256>& scale_code();

/// A quantized weight: the four tensors a layer keeps.
struct Quantized {
  torch::Tensor codes;         // uint8, ceil(n / 2): two NF4 indices per byte
  torch::Tensor absmax_codes;  // uint8, ceil(n / 64): each block's absmax, 8-bit coded
  torch::Tensor scales;        // float32, ceil(n / (64 * 256)): absmax of each block of those
  torch::Tensor offset;        // float32, 1: the mean absmax, subtracted before coding
};

/// Each block's absmax of `w` (any floating dtype, read as float32, flattened): float32,
/// ceil(numel / 64). The last block may be short.
torch::Tensor block_absmax(const torch::Tensor& w);

/// The second quantization of a whole weight's block absmaxes (block_absmax()): fills
/// absmax_codes, scales and offset of the result; codes stays undefined.
Quantized quantize_absmax(const torch::Tensor& absmax);

/// The NF4 indices of `w` (numel a multiple of 64, i.e. whole blocks) given its blocks'
/// absmaxes (float32, numel / 64): uint8, numel / 2. A row range of a larger weight whose rows
/// hold whole blocks is encoded with its slice of the weight's absmaxes, so each rank can
/// encode only its own rows.
torch::Tensor encode(const torch::Tensor& w, const torch::Tensor& absmax);

/// block_absmax + quantize_absmax + encode, for a whole weight (numel even).
Quantized quantize(const torch::Tensor& w);

/// The block absmaxes the 8-bit codes stand for (float32, absmax_codes.numel()).
torch::Tensor dequantize_absmax(const torch::Tensor& absmax_codes, const torch::Tensor& scales,
                                const torch::Tensor& offset);

/// The weight of `shape` (numel() elements of `codes`) in `dtype`: NF4 value times the block's
/// dequantized absmax, in float32, then cast.
torch::Tensor dequantize(const torch::Tensor& codes, const torch::Tensor& absmax_codes,
                         const torch::Tensor& scales, const torch::Tensor& offset,
                         torch::IntArrayRef shape, torch::ScalarType dtype);

/// dequantize_absmax and dequantize in ATen ops, which run on any device: what the two run on a
/// GPU. The same float32 operations in the same order, so they equal the CPU kernels bitwise
/// (tests/test_lora.cpp checks that on the CPU, where both run).
torch::Tensor dequantize_absmax_ops(const torch::Tensor& absmax_codes, const torch::Tensor& scales,
                                    const torch::Tensor& offset);
torch::Tensor dequantize_ops(const torch::Tensor& codes, const torch::Tensor& absmax_codes,
                             const torch::Tensor& scales, const torch::Tensor& offset,
                             torch::IntArrayRef shape, torch::ScalarType dtype);

/// y = x W^T with W (out, in) the NF4 weight, dequantized to x's dtype. Differentiable in x
/// only: backward dequantizes W again instead of keeping it (what autograd keeps are the four
/// quantized tensors, which FSDP frees and re-gathers as it does any parameter).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& codes,
                     const torch::Tensor& absmax_codes, const torch::Tensor& scales,
                     const torch::Tensor& offset, int64_t out_features, int64_t in_features);

}  // namespace fsdp::nf4
