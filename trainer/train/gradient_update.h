// How a step's gradients reach the optimizer, apart from the plain backward-then-step:
// clipping by the previous step's norm (training.grad_clip_mode = previous_step) and the
// optimizer stepping each unit inside backward (fsdp.optimizer_in_backward).
//
// Inside backward, unit k steps as soon as its gradients are reduced, while units < k have not
// computed theirs: the global norm of this step's gradients does not exist yet, so clipping can
// only use a norm known before backward started. The previous step's is the one offered
// (gradient norms change slowly between steps; the first step of a run is not clipped).
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <limits>

#include <fsdp/clip_grad.h>
#include <fsdp/optim/fused_optimizer.h>

namespace fsdp_trainer {

/// The previous step's global gradient norm and the factor it gives this step's gradients.
struct PreviousNormClip {
  double max_norm = 0;                                         // training.grad_clip (0: off)
  double previous = std::numeric_limits<double>::quiet_NaN();  // none yet
  /// grad_clip / (previous + 1e-6) when that is below 1 (clip_grad_norm_'s rule), else 1: no
  /// clipping without a previous norm or with a non-finite one.
  double factor() const {
    if (max_norm <= 0 || !std::isfinite(previous))
      return 1.0;
    return std::min(1.0, max_norm / (previous + 1e-6));
  }
};

/// Multiplies the defined grads of `params` by `factor` (one _foreach_mul_).
void scale_grads(const std::vector<torch::Tensor>& params, double factor);

/// fsdp.optimizer_in_backward for one step. Each backward after arm(true) runs `optimizer` on
/// each unit's parameters (FusedOptimizer::step_params) as soon as the unit's gradients are
/// reduced, having scaled them by `clip_factor` (if not 1) and added their squared norm to this
/// step's (if `measure_norm`), then drops them. The destructor removes the hooks, also when the
/// step throws.
class UpdateInBackward {
 public:
  /// `tp`: the parameters split over tensor-parallel groups, for the norm over both axes.
  UpdateInBackward(torch::nn::Module& root, fsdp::FusedOptimizer& optimizer,
                   fsdp::ProcessGroup& group, double clip_factor, bool measure_norm,
                   fsdp::TensorParallelParams tp = {});
  ~UpdateInBackward();
  UpdateInBackward(const UpdateInBackward&) = delete;
  UpdateInBackward& operator=(const UpdateInBackward&) = delete;

  /// Whether the next backward steps (the last micro-batch's: earlier ones only accumulate).
  void arm(bool on);
  /// The global norm of the gradients the hooks saw, before scaling (every rank calls it).
  double norm() { return norm_.reduce(); }

 private:
  void step_unit(const std::vector<torch::Tensor>& params);

  torch::nn::Module& root_;
  fsdp::FusedOptimizer& optimizer_;
  fsdp::GradNormSum norm_;
  double clip_factor_;
  bool measure_norm_;
};

}  // namespace fsdp_trainer
