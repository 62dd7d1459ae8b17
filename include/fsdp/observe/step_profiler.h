// Where a training step's time goes: the "throughput breakdown" of one step on this rank.
//
// Wrap the phases of a step in the profiler's scopes; end_step() returns the wall time split
// into forward compute, backward compute, exposed (not hidden) all-gather wait, exposed
// gradient-reduction wait, optimizer, and the rest, plus the collectives the step issued on
// every process group of the model's units. Waits are measured where this thread blocks on a
// collective (CommStats::wait_seconds), so communication that overlapped compute (prefetch,
// asynchronous reduce-scatter) is not counted as wait: what remains is the communication that
// slowed the step.
//
//   fsdp::StepProfiler prof(model.ptr());
//   prof.begin_step();
//   { auto s = prof.forward();   loss = ...; }
//   { auto s = prof.backward();  loss.backward(); }
//   { auto s = prof.optimizer(); opt.step(); }
//   fsdp::StepBreakdown b = prof.end_step();
#pragma once

#include <torch/nn/module.h>

#include <chrono>
#include <memory>
#include <string>

#include <fsdp/distributed/comm_stats.h>

namespace fsdp {

struct StepBreakdown {
  /// begin_step() to end_step().
  double step_s = 0;
  /// Forward and backward wall time minus the collective waits inside them.
  double forward_s = 0;
  double backward_s = 0;
  /// Exposed all-gather wait, all of it and the part inside forward.
  double all_gather_wait_s = 0;
  double all_gather_wait_forward_s = 0;
  /// Exposed wait for gradient reduction (reduce-scatter, and the all-reduce of kNoShard and
  /// kHybridShard) inside forward and backward.
  double reduce_wait_s = 0;
  /// The optimizer scope, collectives in it (gradient clipping's all-reduce) included.
  double optimizer_s = 0;
  /// step_s minus all of the above (data loading, zero_grad, logging...); never negative.
  double other_s = 0;
  /// Every collective of the step on the groups of the model's units.
  CommStats comm;

  /// One line per row with seconds and percent of the step, then the collectives.
  std::string to_string() const;
};

class StepProfiler {
 public:
  /// `model`: the module whose units (it and everything under it) are measured.
  explicit StepProfiler(std::shared_ptr<torch::nn::Module> model);

  /// Ends the scope it was created for (RAII).
  class Scope {
   public:
    Scope(Scope&& o) noexcept : prof_(o.prof_), kind_(o.kind_), start_(o.start_), comm_(o.comm_) {
      o.prof_ = nullptr;
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    ~Scope();

   private:
    friend class StepProfiler;
    Scope(StepProfiler* prof, int kind);
    StepProfiler* prof_;
    int kind_;
    std::chrono::steady_clock::time_point start_;
    CommStats comm_;
  };

  void begin_step();
  /// Fault tolerance replaces the units' groups between attempts at a step: called around the
  /// change (no scope open), the step's collectives are those of the old groups until it and
  /// of the new ones after (a new group counts from zero).
  void groups_changing();
  void groups_changed();
  [[nodiscard]] Scope forward();
  [[nodiscard]] Scope backward();
  [[nodiscard]] Scope optimizer();
  StepBreakdown end_step();

 private:
  CommStats snapshot() const;

  std::shared_ptr<torch::nn::Module> model_;
  std::chrono::steady_clock::time_point start_;
  CommStats at_start_;  // the groups' counts when the step began, or when they last changed
  CommStats banked_;    // the step's collectives on groups replaced since it began
  StepBreakdown current_;
};

}  // namespace fsdp
