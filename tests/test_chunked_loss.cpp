// The fused, chunked LM head + cross-entropy against the unfused one: the same loss and
// gradients (fp32 to rounding; bf16 to bf16's), every chunk size including ones that do not
// divide the positions, masks and ignored targets, and a peak that no longer holds the logits.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <limits>
#include <stdexcept>

#include <fsdp/core/memory.h>

#include "chunked_loss.h"

namespace {

namespace F = torch::nn::functional;

struct Result {
  torch::Tensor loss, grad_h, grad_w;
};

// The unfused reference: the whole logits, cross_entropy per position, weighted, summed.
Result unfused(const torch::Tensor& h0, const torch::Tensor& w0, const torch::Tensor& targets,
               const torch::Tensor& weights, double denom) {
  auto h = h0.detach().clone().requires_grad_(true);
  auto w = w0.detach().clone().requires_grad_(true);
  const auto logits = at::matmul(h, w.t()).to(torch::kFloat);
  auto ce = F::cross_entropy(logits, targets, F::CrossEntropyFuncOptions().reduction(torch::kNone));
  auto weight = weights.defined() ? weights : torch::ones_like(ce);
  auto loss = (ce * weight).sum() / denom;
  loss.backward();
  return {loss.detach(), h.grad(), w.grad()};
}

Result fused(const torch::Tensor& h0, const torch::Tensor& w0, const torch::Tensor& targets,
             const torch::Tensor& weights, double denom, int64_t chunk) {
  auto h = h0.detach().clone().requires_grad_(true);
  auto w = w0.detach().clone().requires_grad_(true);
  auto loss = fsdp_models::chunked_linear_cross_entropy(h, w, targets, weights, denom, chunk);
  loss.backward();
  return {loss.detach(), h.grad(), w.grad()};
}

TEST(ChunkedLoss, EqualsTheUnfusedLossAndGradientsInFp32) {
  torch::manual_seed(0);
  const int64_t n = 37, c = 16, v = 50;  // 37 positions: no chunk size below divides them
  const auto h = torch::randn({n, c});
  const auto w = torch::randn({v, c}) * 0.5;
  auto targets = torch::randint(0, v, {n}, torch::kLong);
  const auto mask = torch::randint(0, 2, {n}).to(torch::kFloat);
  // Ignored targets (-100) count as weight 0 in the fused loss; the reference masks them.
  auto ignored = targets.clone();
  ignored.index_put_({torch::arange(0, n, 5)}, -100);
  const auto ref_mask = mask.masked_fill(ignored.eq(-100), 0.0);
  const double denom = ref_mask.sum().item<double>();
  const auto ref = unfused(h, w, targets, ref_mask, denom);
  const auto mean_ref = unfused(h, w, targets, torch::Tensor(), static_cast<double>(n));
  EXPECT_TRUE(torch::allclose(mean_ref.loss, F::cross_entropy(at::matmul(h, w.t()), targets)));
  for (int64_t chunk : {1, 5, 8, 36, 37, 100}) {
    const auto got = fused(h, w, ignored, mask, denom, chunk);
    EXPECT_TRUE(torch::allclose(got.loss, ref.loss, 1e-5, 1e-6))
        << "chunk " << chunk << ": " << got.loss.item<double>() << " vs "
        << ref.loss.item<double>();
    EXPECT_TRUE(torch::allclose(got.grad_h, ref.grad_h, 1e-5, 1e-6)) << "chunk " << chunk;
    EXPECT_TRUE(torch::allclose(got.grad_w, ref.grad_w, 1e-5, 1e-6)) << "chunk " << chunk;
    // No weights and denominator N: cross_entropy's mean.
    const auto mean = fused(h, w, targets, torch::Tensor(), static_cast<double>(n), chunk);
    EXPECT_TRUE(torch::allclose(mean.loss, mean_ref.loss, 1e-5, 1e-6)) << "chunk " << chunk;
    EXPECT_TRUE(torch::allclose(mean.grad_h, mean_ref.grad_h, 1e-5, 1e-6)) << "chunk " << chunk;
    EXPECT_TRUE(torch::allclose(mean.grad_w, mean_ref.grad_w, 1e-5, 1e-6)) << "chunk " << chunk;
  }
}

// Positions of weight 0 (a mask's zeros, ignored targets) are left out before the head: their
// logits are never computed. A NaN in such a position's hidden state, which would make its
// logits and, through NaN * 0, the weighted sum NaN, leaves the loss and the other positions'
// gradients as without it, and that position's gradient zero.
TEST(ChunkedLoss, PositionsOfWeightZeroAreNeverComputed) {
  torch::manual_seed(5);
  const int64_t n = 23, c = 8, v = 40;
  const auto h = torch::randn({n, c});
  const auto w = torch::randn({v, c}) * 0.5;
  auto targets = torch::randint(0, v, {n}, torch::kLong);
  auto mask = torch::ones({n});
  mask.index_put_({torch::arange(0, n, 3)}, 0.0);  // positions 0, 3, ..., 21
  targets[4] = -100;                               // and an ignored target
  const auto ref_mask = mask.masked_fill(targets.eq(-100), 0.0);
  const double denom = ref_mask.sum().item<double>();
  const auto ref = unfused(h, w, targets.masked_fill(targets.eq(-100), 0), ref_mask, denom);
  auto poisoned = h.clone();
  poisoned[3].fill_(std::numeric_limits<float>::quiet_NaN());
  poisoned[4].fill_(std::numeric_limits<float>::infinity());
  for (int64_t chunk : {1, 4, 64}) {
    const auto got = fused(poisoned, w, targets, mask, denom, chunk);
    EXPECT_TRUE(torch::allclose(got.loss, ref.loss, 1e-5, 1e-6))
        << "chunk " << chunk << ": " << got.loss.item<double>() << " vs "
        << ref.loss.item<double>();
    EXPECT_TRUE(torch::allclose(got.grad_h, ref.grad_h, 1e-5, 1e-6)) << "chunk " << chunk;
    EXPECT_TRUE(got.grad_h[3].eq(0).all().item<bool>()) << "chunk " << chunk;
    EXPECT_TRUE(got.grad_h[4].eq(0).all().item<bool>()) << "chunk " << chunk;
    EXPECT_TRUE(torch::allclose(got.grad_w, ref.grad_w, 1e-5, 1e-6)) << "chunk " << chunk;
  }
  // Every weight zero: a zero loss and zero gradients.
  const auto none = fused(h, w, targets, torch::zeros({n}), 1.0, 8);
  EXPECT_EQ(none.loss.item<double>(), 0.0);
  EXPECT_TRUE(none.grad_h.eq(0).all().item<bool>());
  EXPECT_TRUE(none.grad_w.eq(0).all().item<bool>());
}

// bf16 hidden states and head: the logits of a chunk are the same bf16 matmul the Linear does,
// taken to fp32 for the softmax. Loss to 1e-3 and gradients to 2e-2 relative (bf16 has an 8-bit
// significand: its rounding, 2^-8 = 3.9e-3 per value, is what the unfused path has too; the
// fused gradient of the weight is accumulated in fp32 over chunks, the unfused one in one bf16
// matmul).
TEST(ChunkedLoss, Bf16WithinBf16Rounding) {
  torch::manual_seed(1);
  const int64_t n = 64, c = 32, v = 300;
  const auto h = torch::randn({n, c}).to(torch::kBFloat16);
  const auto w = (torch::randn({v, c}) * 0.2).to(torch::kBFloat16);
  const auto targets = torch::randint(0, v, {n}, torch::kLong);
  const auto ref = unfused(h, w, targets, torch::Tensor(), static_cast<double>(n));
  const auto got = fused(h, w, targets, torch::Tensor(), static_cast<double>(n), 16);
  EXPECT_EQ(got.grad_h.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(got.grad_w.scalar_type(), torch::kBFloat16);
  EXPECT_NEAR(got.loss.item<double>(), ref.loss.item<double>(), 1e-3 * ref.loss.item<double>());
  const auto rel = [](const torch::Tensor& a, const torch::Tensor& b) {
    return ((a.to(torch::kFloat) - b.to(torch::kFloat)).norm() / b.to(torch::kFloat).norm())
        .item<double>();
  };
  EXPECT_LT(rel(got.grad_h, ref.grad_h), 2e-2);
  EXPECT_LT(rel(got.grad_w, ref.grad_w), 2e-2);
}

// What the fusion is for: the peak of forward + backward no longer holds the [N x V] logits and
// their gradient. N = 2048 positions of a 8,192-word vocabulary: 64 MiB of fp32 logits unfused;
// chunks of 128 positions hold 4 MiB of them at a time. Frozen head (LoRA): no weight gradient.
TEST(ChunkedLoss, ThePeakNoLongerHoldsTheLogits) {
  fsdp::memory::install_tracking_allocator();
  torch::manual_seed(2);
  const int64_t n = 2048, c = 64, v = 8192;
  const auto h0 = torch::randn({n, c});
  const auto w = torch::randn({v, c}) * 0.1;  // frozen
  const auto targets = torch::randint(0, v, {n}, torch::kLong);
  auto peak_of = [&](bool chunked) {
    auto h = h0.clone().requires_grad_(true);
    fsdp::memory::PeakScope scope;
    torch::Tensor loss;
    if (chunked) {
      loss = fsdp_models::chunked_linear_cross_entropy(h, w, targets, torch::Tensor(),
                                                       static_cast<double>(n), 128);
    } else {
      loss = F::cross_entropy(at::matmul(h, w.t()), targets);
    }
    loss.backward();
    return std::pair<int64_t, torch::Tensor>(scope.peak_above_baseline(), h.grad());
  };
  const auto [unfused_peak, unfused_grad] = peak_of(false);
  const auto [chunked_peak, chunked_grad] = peak_of(true);
  const int64_t logits_bytes = n * v * 4;
  std::printf("peak above baseline: unfused %.1f MiB, chunked %.1f MiB (logits %.1f MiB)\n",
              unfused_peak / 1048576.0, chunked_peak / 1048576.0, logits_bytes / 1048576.0);
  EXPECT_GE(unfused_peak, logits_bytes);
  EXPECT_LT(chunked_peak, logits_bytes / 4);
  EXPECT_TRUE(torch::allclose(chunked_grad, unfused_grad, 1e-5, 1e-7));
}

// The gradients are computed in forward (a unit upstream gradient) and scaled in backward:
// an upstream gradient other than 1 (a loss scale, a micro-batch average, a sum of two
// losses) must give the unfused gradients of that loss. And without grad mode, or with neither
// input requiring a gradient, forward computes no gradient: nothing beyond a chunk stays alive.
TEST(ChunkedLoss, UpstreamGradientsScaleAndNoGradComputesNone) {
  torch::manual_seed(3);
  const int64_t n = 29, c = 12, v = 40;
  const auto h0 = torch::randn({n, c});
  const auto w0 = torch::randn({v, c}) * 0.3;
  const auto targets = torch::randint(0, v, {n}, torch::kLong);
  auto h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
  auto fused = fsdp_models::chunked_linear_cross_entropy(h, w, targets, {}, n, 7);
  (fused * 3.0 + fused.pow(2)).backward();
  auto hr = h0.clone().requires_grad_(true), wr = w0.clone().requires_grad_(true);
  auto ref = F::cross_entropy(at::matmul(hr, wr.t()), targets);
  (ref * 3.0 + ref.pow(2)).backward();
  EXPECT_TRUE(torch::allclose(h.grad(), hr.grad(), 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(w.grad(), wr.grad(), 1e-5, 1e-6));

  fsdp::memory::install_tracking_allocator();
  const int64_t big_n = 1024, big_v = 4096, big_c = 256;
  const auto hb = torch::randn({big_n, big_c}).requires_grad_(true);
  const auto wb = (torch::randn({big_v, big_c}) * 0.1).requires_grad_(true);
  const auto tb = torch::randint(0, big_v, {big_n}, torch::kLong);
  auto peak_of = [&](bool grad_mode) {
    fsdp::memory::PeakScope scope;
    torch::AutoGradMode mode(grad_mode);
    auto loss = fsdp_models::chunked_linear_cross_entropy(hb, wb, tb, {}, big_n, 16);
    return scope.peak_above_baseline();
  };
  const int64_t with_grad = peak_of(true), without = peak_of(false);
  const int64_t grads_bytes = (big_n + big_v) * big_c * 4;  // grad_h and the fp32 grad_w
  std::printf("forward peak: with grad %.2f MiB, without %.2f MiB (gradients %.2f MiB)\n",
              with_grad / 1048576.0, without / 1048576.0, grads_bytes / 1048576.0);
  EXPECT_GE(with_grad, grads_bytes);
  EXPECT_LT(without, grads_bytes / 2);
}

TEST(ChunkedLoss, BadInputIsRefused) {
  const auto h = torch::randn({4, 3});
  const auto w = torch::randn({5, 3});
  EXPECT_THROW(fsdp_models::chunked_linear_cross_entropy(
                   h, w, torch::tensor({0, 1, 5, 2}, torch::kLong), {}, 4, 2),
               std::invalid_argument);
  EXPECT_THROW(fsdp_models::chunked_linear_cross_entropy(
                   h, w, torch::tensor({0, 1, 2, 2}, torch::kLong), {}, 4, 0),
               std::invalid_argument);
  EXPECT_THROW(fsdp_models::chunked_linear_cross_entropy(
                   h, torch::randn({5, 2}), torch::tensor({0, 1, 2, 2}, torch::kLong), {}, 4, 2),
               std::invalid_argument);
}

}  // namespace
