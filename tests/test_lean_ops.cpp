// The lean element-wise functions of the Llama block (models/lean_ops.h) against the ATen ops
// they replace: the same outputs and gradients (fp32 to 1e-6, bf16 within bf16's rounding), and
// less kept for backward.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <vector>

#include <fsdp/core/memory.h>

#include "lean_ops.h"

namespace {

// Meta's RMSNorm composed from ATen ops (what models/layers.cpp computed before).
torch::Tensor composed_rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  auto xf = x.to(torch::kFloat);
  auto normed = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return normed.to(x.scalar_type()) * w;
}

torch::Tensor composed_swiglu(const torch::Tensor& a, const torch::Tensor& b) {
  return torch::silu(a) * b;
}

using Op = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;

// Output and input gradients of `op` on copies of `inputs` (each requiring grad), for an
// upstream gradient `g`.
std::vector<torch::Tensor> run(const Op& op, const std::vector<torch::Tensor>& inputs,
                               const torch::Tensor& g) {
  std::vector<torch::Tensor> leaves;
  for (const auto& t : inputs)
    leaves.push_back(t.detach().clone().requires_grad_(true));
  auto y = op(leaves);
  y.backward(g);
  std::vector<torch::Tensor> out{y.detach()};
  for (const auto& l : leaves)
    out.push_back(l.grad());
  return out;
}

void expect_close(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want,
                  double rtol, double atol, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].scalar_type(), want[i].scalar_type()) << what << " #" << i;
    EXPECT_TRUE(torch::allclose(got[i].to(torch::kFloat), want[i].to(torch::kFloat), rtol, atol))
        << what << " #" << i << ": max |diff| "
        << (got[i].to(torch::kFloat) - want[i].to(torch::kFloat)).abs().max().item<double>();
  }
}

// Bytes autograd keeps alive for backward beyond the inputs: live bytes after forward (output
// dropped, graph kept through a sum) minus before; the inputs are the leaves themselves.
int64_t kept_bytes(const Op& op, const std::vector<torch::Tensor>& inputs) {
  std::vector<torch::Tensor> leaves;
  for (const auto& t : inputs)
    leaves.push_back(t.detach().clone().requires_grad_(true));
  const int64_t before = fsdp::memory::current_bytes();
  auto loss = op(leaves).sum();
  return fsdp::memory::current_bytes() - before;
}

TEST(LeanOps, RmsNormEqualsTheComposedOpsAndKeepsLess) {
  torch::manual_seed(0);
  const double eps = 1e-5;
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    const auto x = torch::randn({3, 7, 40}).to(dtype);
    const auto w = (torch::rand({40}) + 0.5).to(dtype);
    const auto g = torch::randn({3, 7, 40}).to(dtype);
    const Op lean = [&](const auto& in) { return fsdp_models::rms_norm(in[0], in[1], eps); };
    const Op composed = [&](const auto& in) { return composed_rms_norm(in[0], in[1], eps); };
    const bool fp32 = dtype == torch::kFloat;
    // bf16: the same roundings in a different order; 2^-7 relative, and the weight's gradient
    // sums 21 rows of bf16 products.
    expect_close(run(lean, {x, w}, g), run(composed, {x, w}, g), fp32 ? 1e-5 : 2e-2,
                 fp32 ? 1e-6 : 5e-2, fp32 ? "rms_norm fp32" : "rms_norm bf16");
  }
  fsdp::memory::install_tracking_allocator();
  const auto x = torch::randn({8, 64, 256}).to(torch::kBFloat16);
  const auto w = torch::ones({256}).to(torch::kBFloat16);
  const int64_t lean =
      kept_bytes([](const auto& in) { return fsdp_models::rms_norm(in[0], in[1], 1e-5); }, {x, w});
  const int64_t composed =
      kept_bytes([](const auto& in) { return composed_rms_norm(in[0], in[1], 1e-5); }, {x, w});
  std::printf("rms_norm bf16 keeps %lld B, composed %lld B (input %lld B)\n", (long long)lean,
              (long long)composed, (long long)x.nbytes());
  // The composed ops keep the fp32 copy of x (2x its bytes); the lean one x itself (the leaf:
  // no new bytes) and an fp32 scale per row.
  EXPECT_LE(lean, 8 * 64 * 4 + 1024);
  EXPECT_GE(composed, 2 * static_cast<int64_t>(x.nbytes()));
}

TEST(LeanOps, SwigluEqualsTheComposedOpsAndKeepsLess) {
  torch::manual_seed(1);
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    const auto a = (torch::randn({5, 33}) * 3).to(dtype);
    const auto b = torch::randn({5, 33}).to(dtype);
    const auto g = torch::randn({5, 33}).to(dtype);
    const Op lean = [](const auto& in) { return fsdp_models::swiglu(in[0], in[1]); };
    const Op composed = [](const auto& in) { return composed_swiglu(in[0], in[1]); };
    const bool fp32 = dtype == torch::kFloat;
    expect_close(run(lean, {a, b}, g), run(composed, {a, b}, g), fp32 ? 1e-6 : 2e-2,
                 fp32 ? 1e-7 : 2e-2, fp32 ? "swiglu fp32" : "swiglu bf16");
  }
  fsdp::memory::install_tracking_allocator();
  const auto a = torch::randn({64, 1536}), b = torch::randn({64, 1536});
  const int64_t lean =
      kept_bytes([](const auto& in) { return fsdp_models::swiglu(in[0], in[1]); }, {a, b});
  const int64_t composed =
      kept_bytes([](const auto& in) { return composed_swiglu(in[0], in[1]); }, {a, b});
  std::printf("swiglu keeps %lld B, composed %lld B (one input %lld B)\n", (long long)lean,
              (long long)composed, (long long)a.nbytes());
  // Both keep a and b (the clones); the composed ops also silu(a).
  EXPECT_EQ(composed - lean, static_cast<int64_t>(a.nbytes()));
}

}  // namespace
