#include "lean_ops.h"

#include <torch/autograd.h>
#include <torch/torch.h>

namespace fsdp_models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, double eps) {
    const auto xf = x.to(torch::kFloat);
    const auto rstd = torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
    ctx->save_for_backward({x, weight, rstd});
    return (xf * rstd).to(x.scalar_type()) * weight;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &weight = saved[1], &rstd = saved[2];
    const auto& gy = grad_out[0];
    const auto n = x.to(torch::kFloat) * rstd;  // the normalised rows, fp32
    torch::Tensor gx, gw;
    if (ctx->needs_input_grad(0)) {
      // y = cast(n) * w: d n = gy * w (in y's dtype, as autograd's mul), then through the cast.
      const auto gn = (gy * weight).to(torch::kFloat);
      // n = x * r, r = (mean(x^2) + eps)^-1/2: d x = r * (gn - n * mean(gn * n)).
      gx = (rstd * (gn - n * (gn * n).mean(-1, /*keepdim=*/true))).to(x.scalar_type());
    }
    if (ctx->needs_input_grad(1)) {
      const auto normed = n.to(x.scalar_type());
      gw = (gy * normed).reshape({-1, weight.numel()}).sum(0).to(weight.scalar_type());
    }
    return {gx, gw, torch::Tensor()};
  }
};

class SwigluFunction : public torch::autograd::Function<SwigluFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& a,
                               const torch::Tensor& b) {
    ctx->save_for_backward({a, b});
    return torch::silu(a) * b;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const auto &a = saved[0], &b = saved[1];
    const auto& g = grad_out[0];
    torch::Tensor ga, gb;
    if (ctx->needs_input_grad(0))  // silu'(a) = sigmoid(a) (1 + a (1 - sigmoid(a)))
      ga = at::silu_backward(g * b, a);
    if (ctx->needs_input_grad(1))
      gb = g * torch::silu(a);
    return {ga, gb};
  }
};

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  return RmsNormFunction::apply(x, weight, eps);
}

torch::Tensor swiglu(const torch::Tensor& a, const torch::Tensor& b) {
  return SwigluFunction::apply(a, b);
}

}  // namespace fsdp_models
