// How fast this machine's matmuls run in a given dtype, measured in the forms a training step
// runs them: the basis of MFU's peak and of precision.param_dtype = "auto".
//
// Why measured and not looked up: the same dtype runs at very different speeds on machines we
// meet (bf16 ~2-5x faster than fp32 with AVX-512 BF16, ~36x slower on AVX2-only CPUs), and
// within one machine the forms differ too: on an AVX2 CPU a bf16 at::linear (x W^T) runs ~10x
// faster than a bf16 at::mm of the same size, because they reach different kernels. A peak
// measured on one form only can sit below what the model's own matmuls reach (MFU above 100%).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp_trainer {

/// A Linear layer's training matmuls: input x (m, k), weight W (n, k).
struct MatmulShape {
  int64_t m = 0, k = 0, n = 0;
  double flops() const { return 2.0 * static_cast<double>(m) * k * n; }
};

/// FLOP/s of each form one Linear runs per training step, on `device` with the current
/// intra-op threads: forward y = x W^T (at::linear), input gradient dx = dy W and weight
/// gradient dW = dy^T x (at::mm).
struct MatmulSpeed {
  double forward = 0, input_grad = 0, weight_grad = 0;
  /// The fastest of the three forms.
  double best() const;
  /// The three in a row, as a step runs them: their FLOPs over the sum of their times.
  double step() const;
};

/// Times each form at `shape` in `dtype`: one warm-up call, then the best of at least 3 calls
/// (up to 20, stopping after `min_seconds` of calls, or after the first call past 0.5 s, so
/// that a dtype that crawls costs about a second, not a minute, and a fast one well under a
/// tenth of a second per form). Constant inputs: the global RNG does not move, so measuring
/// never changes a training run. On CUDA each call is synchronised.
MatmulSpeed measure_matmul_speed(c10::ScalarType dtype, const MatmulShape& shape,
                                 c10::Device device = c10::kCPU, double min_seconds = 0.02);

/// Peak matmul FLOP/s of this process (its intra-op threads, or its GPU) in `dtype`: the highest
/// of every form at each of `shapes` (the model's Linear shapes) and a square 512 at::mm, the
/// best of their calls (at least 3 each, over 0.005 s: every rank of every fsdp-train start
/// measures it). So MFU divides by something this machine did with the run's own dtype and
/// shapes. Measured once per (dtype, shapes, device, threads) and cached.
double peak_matmul_flops(c10::ScalarType dtype, const std::vector<MatmulShape>& shapes,
                         c10::Device device = c10::kCPU);

}  // namespace fsdp_trainer
