// See include/fsdp/plan/activations.h.
#include <fsdp/plan/activations.h>

#include <fsdp/core/memory.h>

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <cmath>

namespace fsdp::plan {
namespace {

namespace mem = fsdp::memory;

int64_t activations_now() {
  return mem::current_by_category()[mem::Category::kActivations];
}

int64_t activations_peak() {
  return mem::peak_by_category()[mem::Category::kActivations];
}

// While measuring, a parameter's gradient is counted as a gradient from the moment autograd
// accumulates it, as the engine counts it (sharded_param.cpp, TagGradAsGradient): the
// activations category then holds activations only.
struct TagAsGradient : torch::autograd::PostAccumulateGradHook {
  void operator()(const torch::autograd::Variable& param) override {
    const auto& g = param.grad();
    if (g.defined() && g.has_storage())
      mem::retag(g.storage().data(), mem::Category::kGrads);
  }
};

// Installs the hook on the parameters that have none, removes it (and their gradients) on exit.
class GradientTagging {
 public:
  explicit GradientTagging(const std::vector<std::pair<std::string, torch::Tensor>>& params) {
    for (const auto& [name, p] : params) {
      params_.push_back(p);
      p.mutable_grad() = torch::Tensor();
      if (p.requires_grad() && !torch::autograd::impl::post_acc_grad_hooks(p)) {
        torch::autograd::impl::set_post_acc_grad_hooks(p, std::make_unique<TagAsGradient>());
        tagged_.push_back(p);
      }
    }
  }
  ~GradientTagging() {
    for (auto& p : tagged_)
      torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
    for (auto& p : params_)
      p.mutable_grad() = torch::Tensor();
  }
  GradientTagging(const GradientTagging&) = delete;
  GradientTagging& operator=(const GradientTagging&) = delete;

 private:
  std::vector<torch::Tensor> tagged_, params_;
};

PieceScaling fit(int64_t b, int64_t t, const PieceBytes& m, const PieceBytes& m2b,
                 const PieceBytes& m2t) {
  auto one = [&](int64_t PieceBytes::*f) {
    return Scaling::fit(b, t, static_cast<double>(m.*f), static_cast<double>(m2b.*f),
                        static_cast<double>(m2t.*f));
  };
  PieceScaling s;
  s.saved = one(&PieceBytes::saved);
  s.forward_peak = one(&PieceBytes::forward_peak);
  s.backward_peak = one(&PieceBytes::backward_peak);
  s.backward_peak_grads = one(&PieceBytes::backward_peak_grads);
  s.backward_release = one(&PieceBytes::backward_release);
  return s;
}

}  // namespace

int64_t Scaling::at(int64_t b, int64_t t) const {
  const double bt = static_cast<double>(b) * static_cast<double>(t);
  return std::llround(c + a * bt + q * bt * static_cast<double>(t));
}

Scaling Scaling::fit(int64_t b, int64_t t, double at_bt, double at_2b, double at_2t) {
  // m(B,T) = c + a·B·T + q·B·T²:  m(2b,t) - m(b,t) = a·bt + q·bt·t,
  // m(b,2t) - m(2b,t) = 2q·bt·t (the two have the same a·B·T term).
  const double bt = static_cast<double>(b) * static_cast<double>(t);
  Scaling s;
  s.q = (at_2t - at_2b) / (2 * bt * static_cast<double>(t));
  s.a = (at_2b - at_bt) / bt - s.q * static_cast<double>(t);
  s.c = at_bt - s.a * bt - s.q * bt * static_cast<double>(t);
  return s;
}

PieceBytes PieceScaling::at(int64_t b, int64_t t) const {
  return {saved.at(b, t), forward_peak.at(b, t), backward_peak.at(b, t),
          backward_peak_grads.at(b, t), backward_release.at(b, t)};
}

PieceBytes measure_piece(const std::function<torch::Tensor()>& make_input,
                         const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                         const std::vector<std::pair<std::string, torch::Tensor>>& parameters,
                         std::vector<std::string>* with_grads) {
  TORCH_CHECK(mem::tracking_installed(),
              "fsdp::plan: measuring activations needs fsdp::memory::install_tracking_allocator()");
  GradientTagging tagging(parameters);
  mem::CategoryScope scope(mem::Category::kActivations);
  PieceBytes out;
  torch::Tensor x = make_input();
  {
    // Totals, not the activations category alone: in backward the parameters' gradients grow
    // while the activations shrink, and the planner needs the moment their sum is highest.
    int64_t before = mem::current_bytes();
    mem::reset_peak();
    torch::Tensor y = forward(x);
    out.saved = mem::current_bytes() - before;
    out.forward_peak = mem::peak_bytes() - before;
    TORCH_CHECK(y.requires_grad(), "fsdp::plan: a calibration piece's output needs no gradient");
    torch::Tensor grad = torch::ones_like(y);
    const int64_t start = mem::current_bytes();
    const int64_t grads_at_start = mem::current_by_category()[mem::Category::kGrads];
    mem::reset_peak();
    y.backward(grad);
    out.backward_peak = mem::peak_bytes() - start;
    out.backward_peak_grads = mem::at_peak_by_category()[mem::Category::kGrads] - grads_at_start;
    const int64_t grads_made = mem::current_by_category()[mem::Category::kGrads] - grads_at_start;
    y = torch::Tensor();
    grad = torch::Tensor();
    out.backward_release = start - (mem::current_bytes() - grads_made);
  }
  if (with_grads) {
    for (const auto& [name, p] : parameters) {
      if (p.grad().defined())
        with_grads->push_back(name);
    }
  }
  return out;
}

ActivationModel calibrate_activations(const CalibrationPieces& pieces, int64_t b, int64_t t) {
  TORCH_CHECK(b >= 1 && t >= 2, "fsdp::plan: calibration at B=", b, ", T=", t);
  ActivationModel model;
  // The input of a block or of the head: a block's output (in the blocks' dtype), detached into
  // a leaf that requires grad (its gradient is the "gradient of the input" the piece leaves).
  auto hidden = [&](int64_t bb, int64_t tt) {
    torch::Tensor x;
    {
      torch::NoGradGuard no_grad;
      x = pieces.block(pieces.pre(bb, tt), tt).detach().clone();
    }
    return x.requires_grad_(true);
  };
  auto measure_all = [&](int64_t bb, int64_t tt) {
    struct All {
      PieceBytes pre, post;
      std::array<PieceBytes, 3> block;
      std::vector<std::string> post_parameters;
    } all;
    all.pre = measure_piece([] { return torch::Tensor(); },
                            [&](const torch::Tensor&) { return pieces.pre(bb, tt); },
                            pieces.parameters);
    for (auto mode : {CheckpointMode::kNone, CheckpointMode::kFull, CheckpointMode::kSelective}) {
      all.block[static_cast<size_t>(mode)] = measure_piece(
          [&] { return hidden(bb, tt); },
          [&](const torch::Tensor& x) {
            return fsdp::checkpoint(
                [&](const std::vector<torch::Tensor>& in) {
                  return std::vector<torch::Tensor>{pieces.block(in[0], tt)};
                },
                {x}, mode)[0];
          },
          pieces.parameters);
    }
    all.post = measure_piece([&] { return hidden(bb, tt); },
                             [&](const torch::Tensor& x) { return pieces.post(x, tt); },
                             pieces.parameters, &all.post_parameters);
    return all;
  };
  const auto m = measure_all(b, t), m2b = measure_all(2 * b, t), m2t = measure_all(b, 2 * t);
  model.pre = fit(b, t, m.pre, m2b.pre, m2t.pre);
  model.post = fit(b, t, m.post, m2b.post, m2t.post);
  model.post_parameters = m.post_parameters;
  for (size_t i = 0; i < 3; ++i)
    model.block[i] = fit(b, t, m.block[i], m2b.block[i], m2t.block[i]);
  return model;
}

}  // namespace fsdp::plan
