// See step_profiler.h. The scopes take CommStats snapshots of the model's groups: the wait
// accumulated inside a scope is exactly what this thread blocked on in it.
#include <fsdp/observe/step_profiler.h>

#include <fsdp/fully_shard.h>

#include <algorithm>
#include <cstdio>

namespace fsdp {
namespace {

enum Kind { kForward, kBackward, kOptimizer };

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

StepProfiler::StepProfiler(std::shared_ptr<torch::nn::Module> model) : model_(std::move(model)) {
  TORCH_CHECK(model_, "StepProfiler: model is null");
}

CommStats StepProfiler::snapshot() const {
  return comm_stats(*model_);
}

StepProfiler::Scope::Scope(StepProfiler* prof, int kind)
    : prof_(prof), kind_(kind), start_(std::chrono::steady_clock::now()), comm_(prof->snapshot()) {}

StepProfiler::Scope::~Scope() {
  if (!prof_)
    return;
  const double wall = seconds_since(start_);
  const CommStats d = prof_->snapshot() - comm_;
  auto& b = prof_->current_;
  const double gather = d.all_gather.wait_seconds;
  const double reduce = d.reduce_scatter.wait_seconds + d.all_reduce.wait_seconds;
  switch (kind_) {
    case kForward:
      b.forward_s += std::max(0.0, wall - gather - reduce);
      b.all_gather_wait_s += gather;
      b.all_gather_wait_forward_s += gather;
      b.reduce_wait_s += reduce;
      break;
    case kBackward:
      b.backward_s += std::max(0.0, wall - gather - reduce);
      b.all_gather_wait_s += gather;
      b.reduce_wait_s += reduce;
      break;
    default:
      b.optimizer_s += wall;
      break;
  }
}

void StepProfiler::begin_step() {
  current_ = StepBreakdown{};
  at_start_ = snapshot();
  banked_ = CommStats{};
  start_ = std::chrono::steady_clock::now();
}

void StepProfiler::groups_changing() {
  banked_ += snapshot() - at_start_;
}

void StepProfiler::groups_changed() {
  at_start_ = snapshot();
}

StepProfiler::Scope StepProfiler::forward() {
  return Scope(this, kForward);
}
StepProfiler::Scope StepProfiler::backward() {
  return Scope(this, kBackward);
}
StepProfiler::Scope StepProfiler::optimizer() {
  return Scope(this, kOptimizer);
}

StepBreakdown StepProfiler::end_step() {
  StepBreakdown b = current_;
  b.step_s = seconds_since(start_);
  b.comm = snapshot() - at_start_;
  b.comm += banked_;
  b.other_s = std::max(0.0, b.step_s - b.forward_s - b.backward_s - b.all_gather_wait_s -
                                b.reduce_wait_s - b.optimizer_s);
  return b;
}

std::string StepBreakdown::to_string() const {
  std::string out;
  char buf[160];
  auto row = [&](const char* name, double s) {
    std::snprintf(buf, sizeof buf, "%-30s %9.4f s %6.1f%%\n", name, s,
                  step_s > 0 ? 100.0 * s / step_s : 0.0);
    out += buf;
  };
  row("forward compute", forward_s);
  row("backward compute", backward_s);
  row("all-gather wait (not hidden)", all_gather_wait_s);
  row("gradient reduce wait", reduce_wait_s);
  row("optimizer step", optimizer_s);
  row("other", other_s);
  row("step", step_s);
  out += comm.to_string();
  return out;
}

}  // namespace fsdp
