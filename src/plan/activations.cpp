// See include/fsdp/plan/activations.h.
#include <fsdp/plan/activations.h>

#include <fsdp/core/memory.h>
#include <fsdp/distributed/process_group.h>

#include <ATen/Context.h>

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <string>

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
// accumulates it, as the engine counts it (sharded_param.cpp, TagGradAsGradient), and each
// accumulation closes a segment of the backward (PieceBytes::backward).
struct Segments {
  int64_t start = 0;  // the activations when the backward began
  int64_t grads = 0;  // accumulated so far
  std::vector<PieceBytes::Segment> list;

  int64_t before_output = 0;
  void close() { list.push_back({activations_peak() - start, grads}); }
  // The gradient reached the unit's output: where the engine's pre-backward hook runs.
  void output_reached() {
    close();
    before_output = static_cast<int64_t>(list.size());
    mem::reset_peak();
  }
};
std::atomic<Segments*> g_segments{nullptr};

struct TagAsGradient : torch::autograd::PostAccumulateGradHook {
  void operator()(const torch::autograd::Variable& param) override {
    const auto& g = param.grad();
    if (!g.defined() || !g.has_storage())
      return;
    Segments* segments = g_segments.load();
    if (segments)
      segments->close();
    const int64_t before = mem::current_by_category()[mem::Category::kGrads];
    mem::retag(g.storage().data(), mem::Category::kGrads);
    if (segments) {
      segments->grads += mem::current_by_category()[mem::Category::kGrads] - before;
      mem::reset_peak();
    }
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
    g_segments.store(nullptr);
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
  s.output = one(&PieceBytes::output);
  s.backward_release = one(&PieceBytes::backward_release);
  TORCH_CHECK(m.backward.size() == m2b.backward.size() && m.backward.size() == m2t.backward.size(),
              "fsdp::plan: a calibration piece accumulated ", m.backward.size() - 1, ", ",
              m2b.backward.size() - 1, " and ", m2t.backward.size() - 1,
              " parameter gradients at three sizes (it must take the same path at every size)");
  s.segments_before_output = m.segments_before_output;
  s.forward_traffic =
      TrafficScaling::fit(b, t, m.traffic.forward, m2b.traffic.forward, m2t.traffic.forward);
  s.backward_traffic =
      TrafficScaling::fit(b, t, m.traffic.backward, m2b.traffic.backward, m2t.traffic.backward);
  for (size_t i = 0; i < m.backward.size(); ++i) {
    s.backward.emplace_back(Scaling::fit(b, t, static_cast<double>(m.backward[i].activations),
                                         static_cast<double>(m2b.backward[i].activations),
                                         static_cast<double>(m2t.backward[i].activations)),
                            m.backward[i].grads);
  }
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
  PieceBytes p;
  p.saved = saved.at(b, t);
  p.forward_peak = forward_peak.at(b, t);
  p.output = output.at(b, t);
  p.backward_release = backward_release.at(b, t);
  p.segments_before_output = segments_before_output;
  for (const auto& [activations, grads] : backward)
    p.backward.push_back({activations.at(b, t), grads});
  p.traffic = {forward_traffic.at(b, t), backward_traffic.at(b, t)};
  return p;
}

TensorParallelTraffic ActivationModel::tp_traffic(int64_t b, int64_t t) const {
  TensorParallelTraffic out;
  out.ways = tp_ways;
  auto at = [&](const PieceScaling& s) {
    return PieceTraffic{s.forward_traffic.at(b, t), s.backward_traffic.at(b, t)};
  };
  out.pre = at(pre);
  out.post = at(post);
  for (size_t i = 0; i < block.size(); ++i)
    out.block[i] = at(block[i]);
  return out;
}

PieceBytes::Segment PieceBytes::backward_peak() const {
  Segment best;
  bool any = false;
  for (const auto& s : backward) {
    if (!any || s.activations + s.grads > best.activations + best.grads)
      best = s;
    any = true;
  }
  return best;
}

PieceBytes measure_piece(const std::function<torch::Tensor()>& make_input,
                         const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                         const std::vector<std::pair<std::string, torch::Tensor>>& parameters,
                         std::vector<std::string>* with_grads, ProcessGroup* group) {
  TORCH_CHECK(mem::tracking_installed(),
              "fsdp::plan: measuring activations needs fsdp::memory::install_tracking_allocator()");
  GradientTagging tagging(parameters);
  mem::CategoryScope scope(mem::Category::kActivations);
  PieceBytes out;
  torch::Tensor x = make_input();
  // The group's counters before and after each half (nothing is counted without a group).
  auto traffic = [group] { return group ? group->comm_stats() : CommStats{}; };
  const CommStats before_forward = traffic();
  {
    const int64_t before = activations_now();
    mem::reset_peak();
    torch::Tensor y = forward(x);
    const CommStats after_forward = traffic();
    out.traffic.forward = after_forward - before_forward;
    out.saved = activations_now() - before;
    out.forward_peak = activations_peak() - before;
    out.output = static_cast<int64_t>(y.storage().nbytes());
    if (!y.requires_grad()) {
      // Nothing before it trains (frozen embeddings under LoRA): no backward runs through it;
      // what it keeps goes with the graph at the end of the step's backward.
      out.backward_release = out.saved;
      return out;
    }
    torch::Tensor grad = torch::ones_like(y);
    Segments segments;
    segments.start = activations_now();
    mem::reset_peak();
    g_segments.store(&segments);
    y.backward(grad);
    g_segments.store(nullptr);
    out.traffic.backward = traffic() - after_forward;
    segments.close();
    out.backward = std::move(segments.list);
    out.segments_before_output = segments.before_output;
    y = torch::Tensor();
    grad = torch::Tensor();
    out.backward_release = segments.start - activations_now();
  }
  if (with_grads) {
    for (const auto& [name, p] : parameters) {
      if (p.grad().defined())
        with_grads->push_back(name);
    }
  }
  return out;
}

torch::Tensor calibration_input(const CalibrationPieces& pieces, int64_t b, int64_t t) {
  torch::Tensor x;
  {
    torch::NoGradGuard no_grad;
    x = pieces.block(pieces.pre(b, t), t).detach().clone();
  }
  return x.requires_grad_(true);
}

ActivationSample measure_activations(const CalibrationPieces& pieces, int64_t b, int64_t t) {
  TORCH_CHECK(b >= 1 && t >= 2, "fsdp::plan: calibration at B=", b, ", T=", t);
  auto hidden = [&] { return calibration_input(pieces, b, t); };
  ActivationSample all;
  all.b = b, all.t = t;
  all.tp_ways = pieces.group ? pieces.group->size() : 1;
  ProcessGroup* group = pieces.group.get();
  all.pre = measure_piece([] { return torch::Tensor(); },
                          [&](const torch::Tensor&) { return pieces.pre(b, t); }, pieces.parameters,
                          &all.pre_parameters, group);
  for (auto mode : {CheckpointMode::kNone, CheckpointMode::kFull, CheckpointMode::kSelective}) {
    auto run = [&, mode](const torch::Tensor& x) {
      return fsdp::checkpoint(
          [&](const std::vector<torch::Tensor>& in) {
            return std::vector<torch::Tensor>{pieces.block(in[0], t)};
          },
          {x}, mode)[0];
    };
    auto& block = all.block[static_cast<size_t>(mode)];
    block = measure_piece(hidden, run, pieces.parameters, nullptr, group);
    // A block's output stays alive only if the next block keeps it for its backward; one that
    // casts it on entry (output_dtype) keeps the cast copy and the output goes. Two blocks in
    // a row tell: the second's increment is what each block adds to a chain.
    int64_t two = 0;
    {
      GradientTagging tagging(pieces.parameters);
      mem::CategoryScope scope(mem::Category::kActivations);
      torch::Tensor x = hidden();
      const int64_t before = activations_now();
      torch::Tensor y = run(run(x));
      two = activations_now() - before;
    }
    const int64_t dropped = 2 * block.saved - two;  // the first output, if the second let go
    block.saved -= dropped;
    block.backward_release -= dropped;
  }
  all.post = measure_piece(
      hidden,
      [&](const torch::Tensor& x) {
        auto out = pieces.head(x, t);
        out.register_hook([](const torch::Tensor&) {
          if (auto* segments = g_segments.load())
            segments->output_reached();
        });
        return pieces.loss(out, t);
      },
      pieces.parameters, &all.post_parameters, group);
  return all;
}

ActivationModel calibrate_activations(const CalibrationPieces& pieces, int64_t b, int64_t t) {
  const auto m = measure_activations(pieces, b, t), m2b = measure_activations(pieces, 2 * b, t),
             m2t = measure_activations(pieces, b, 2 * t);
  ActivationModel model;
  model.pre = fit(b, t, m.pre, m2b.pre, m2t.pre);
  model.post = fit(b, t, m.post, m2b.post, m2t.post);
  model.post_parameters = m.post_parameters;
  model.pre_parameters = m.pre_parameters;
  model.tp_ways = m.tp_ways;
  for (size_t i = 0; i < 3; ++i)
    model.block[i] = fit(b, t, m.block[i], m2b.block[i], m2t.block[i]);
  return model;
}

bool narrowing_is_exact(torch::ScalarType dtype) {
  if (dtype == torch::kFloat || !at::globalContext().userEnabledMkldnn())
    return true;
  // ATen hands bf16/fp16 matmuls to oneDNN where oneDNN may use AVX-512 (ideep's
  // has_bf16_type_support: AVX-512 F, BW, VL and DQ), which it reads off the CPU, lowered by
  // ONEDNN_MAX_CPU_ISA. oneDNN's headers are not in the wheel: the same test, by hand. (A CPU
  // whose oneDNN ISA is AVX2_VNNI_2 also qualifies; none of ours has it.)
  for (const char* name : {"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"}) {
    if (const char* isa = std::getenv(name); isa && *isa) {
      const std::string v = isa;
      if (v.rfind("SSE", 0) == 0 || v.rfind("AVX2", 0) == 0 || v == "AVX")
        return true;
    }
  }
  __builtin_cpu_init();
  return !(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"));
}

ActivationModel extrapolate_to_full_width(const ActivationSample& widest, int64_t widest_narrowing,
                                          const NarrowedCalibration& narrower,
                                          const NarrowedCalibration& narrowest) {
  const double u1 = 1.0 / static_cast<double>(widest_narrowing),
               u2 = 1.0 / static_cast<double>(narrower.narrowing),
               u3 = 1.0 / static_cast<double>(narrowest.narrowing);
  TORCH_CHECK(widest_narrowing >= 1 && narrower.narrowing >= 1 && narrowest.narrowing >= 1 &&
                  u1 != u2 && u1 != u3 && u2 != u3,
              "fsdp::plan: extrapolation from narrowings ", widest_narrowing, ", ",
              narrower.narrowing, " and ", narrowest.narrowing, " (three distinct, >= 1)");
  // The straight line through (u2, y2), (u3, y3) at u; the parabola through three points at 1.
  auto line = [&](double y2, double y3, double u) { return y2 + (y3 - y2) * (u - u2) / (u3 - u2); };
  auto parabola = [&](double y1, double y2, double y3) {
    return y1 * (1 - u2) * (1 - u3) / ((u1 - u2) * (u1 - u3)) +
           y2 * (1 - u1) * (1 - u3) / ((u2 - u1) * (u2 - u3)) +
           y3 * (1 - u1) * (1 - u2) / ((u3 - u1) * (u3 - u2));
  };
  const double bt = static_cast<double>(widest.b) * static_cast<double>(widest.t);
  const double btt = bt * static_cast<double>(widest.t);
  // One count: the per-token coefficients a and q on the line through the two narrowest; the
  // widest's constant is its sample less what those lines give there; c on the parabola.
  auto scaling = [&](const Scaling& s2, const Scaling& s3, int64_t sample) {
    const double a1 = line(s2.a, s3.a, u1), q1 = line(s2.q, s3.q, u1);
    const double c1 = static_cast<double>(sample) - a1 * bt - q1 * btt;
    Scaling out;
    out.a = line(s2.a, s3.a, 1);
    out.q = line(s2.q, s3.q, 1);
    out.c = parabola(c1, s2.c, s3.c);
    return out;
  };
  // The collectives' counts alike: the coefficients of T and B·T on the line (a tensor sent per
  // position is one width wide at most), the constant on the parabola.
  const double t1 = static_cast<double>(widest.t);
  auto traffic = [&](const TrafficScaling& s2, const TrafficScaling& s3, const CommStats& sample) {
    const auto values = TrafficScaling::values(sample);
    TrafficScaling out;
    for (size_t i = 0; i < values.size(); ++i) {
      const auto &l2 = s2.counts[i], &l3 = s3.counts[i];
      const double p1 = line(l2.p, l3.p, u1), a1 = line(l2.a, l3.a, u1);
      const double c1 = static_cast<double>(values[i]) - p1 * t1 - a1 * bt;
      out.counts[i] = {parabola(c1, l2.c, l3.c), line(l2.p, l3.p, 1), line(l2.a, l3.a, 1)};
    }
    return out;
  };
  auto piece = [&](const char* name, const PieceBytes& p1, const PieceScaling& p2,
                   const PieceScaling& p3) {
    TORCH_CHECK(p1.backward.size() == p2.backward.size() &&
                    p2.backward.size() == p3.backward.size() &&
                    p1.segments_before_output == p2.segments_before_output &&
                    p2.segments_before_output == p3.segments_before_output,
                "fsdp::plan: the ", name, " piece took different paths at narrowings ",
                widest_narrowing, ", ", narrower.narrowing, " and ", narrowest.narrowing, " (",
                p1.backward.size(), ", ", p2.backward.size(), " and ", p3.backward.size(),
                " backward segments): it cannot be extrapolated to full width");
    PieceScaling out;
    out.forward_traffic = traffic(p2.forward_traffic, p3.forward_traffic, p1.traffic.forward);
    out.backward_traffic = traffic(p2.backward_traffic, p3.backward_traffic, p1.traffic.backward);
    out.saved = scaling(p2.saved, p3.saved, p1.saved);
    out.forward_peak = scaling(p2.forward_peak, p3.forward_peak, p1.forward_peak);
    out.output = scaling(p2.output, p3.output, p1.output);
    out.backward_release = scaling(p2.backward_release, p3.backward_release, p1.backward_release);
    out.segments_before_output = p1.segments_before_output;
    for (size_t s = 0; s < p1.backward.size(); ++s) {
      const double grads = parabola(static_cast<double>(p1.backward[s].grads),
                                    static_cast<double>(p2.backward[s].second),
                                    static_cast<double>(p3.backward[s].second));
      out.backward.emplace_back(
          scaling(p2.backward[s].first, p3.backward[s].first, p1.backward[s].activations),
          std::llround(grads));
    }
    return out;
  };
  const auto &m2 = narrower.model, &m3 = narrowest.model;
  TORCH_CHECK(
      widest.pre_parameters == m2.pre_parameters && m2.pre_parameters == m3.pre_parameters &&
          widest.post_parameters == m2.post_parameters && m2.post_parameters == m3.post_parameters,
      "fsdp::plan: calibrations at narrowings ", widest_narrowing, ", ", narrower.narrowing,
      " and ", narrowest.narrowing, " give gradients to different parameters");
  ActivationModel out;
  out.tp_ways = widest.tp_ways;
  out.pre_parameters = m2.pre_parameters;
  out.post_parameters = m2.post_parameters;
  out.pre = piece("pre", widest.pre, m2.pre, m3.pre);
  out.post = piece("post", widest.post, m2.post, m3.post);
  for (size_t b = 0; b < out.block.size(); ++b)
    out.block[b] = piece("block", widest.block[b], m2.block[b], m3.block[b]);
  return out;
}

}  // namespace fsdp::plan
