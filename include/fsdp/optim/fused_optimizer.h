// Fused optimizers for sharded parameters: fsdp::FusedAdamW and fsdp::FusedSGD.
//
// Drop-in for torch::optim::AdamW / SGD (same param groups, same options types, same update
// formula), but one pass over memory per step instead of about ten: each element's parameter,
// gradient and moments are loaded once, updated in registers and stored, by vectorised kernels
// (AVX-512, AVX2 or scalar, chosen at run time as ATen chooses its own) on at::parallel_for's
// threads. The state can be kept in bf16 (stochastically rounded) and can live in a file
// instead of memory (ZeRO-Infinity's NVMe offload), streamed in chunks with the next chunk read
// while the current one is updated.
//
//   fsdp::fully_shard(model, ...);
//   fsdp::FusedAdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-4).weight_decay(0.1),
//                        fsdp::OptimizerStateOptions().moments_dtype(torch::kBFloat16)
//                                                     .offload_dir("/nvme/scratch"));
//   ... loss.backward(); opt.step(); opt.zero_grad();
//
// fsdp::save_sharded / load_sharded save and load its state under the same names and kind as
// torch's ("adamw": exp_avg, exp_avg_sq, max_exp_avg_sq; "sgd": momentum_buffer), so a
// checkpoint moves between the fused and the torch optimizer in either direction.
#pragma once

#include <torch/arg.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace fsdp {

namespace detail {
class StateStore;
struct AdamWScalars;
struct SGDScalars;
}  // namespace detail

/// Where and how a fused optimizer keeps its state.
struct OptimizerStateOptions {
  /// kFloat32, or kBFloat16: half the bytes; each store rounds stochastically (unbiased), the
  /// arithmetic is fp32. Parameters (the master weights) stay fp32.
  TORCH_ARG(torch::Dtype, moments_dtype) = torch::kFloat32;
  /// Empty: the state lives in memory. Otherwise a directory where each optimizer creates one
  /// file (unlinked at once, so a crash leaves nothing behind), reserved in full up front
  /// (a full disk is an error at construction, not in the middle of a run).
  TORCH_ARG(std::string, offload_dir) = "";
  /// Offload: state bytes per chunk read and written at a time. Two chunks are resident.
  TORCH_ARG(int64_t, chunk_bytes) = 64ll << 20;
  /// Offload: bypass the page cache (O_DIRECT) where the file system allows it, so the state
  /// really leaves memory; otherwise (e.g. tmpfs) buffered I/O, reported by offload_info().
  TORCH_ARG(bool, direct_io) = true;
  /// Seed of the stochastic rounding of bf16 state.
  TORCH_ARG(uint64_t, rounding_seed) = 0;
};

/// What the last step() did. (A step that throws, e.g. a write to the offload file refused
/// mid-step, may have updated some parameters and not others: restart from a checkpoint.)
struct OptimizerStepStats {
  double seconds = 0;          // the whole step
  double io_wait_seconds = 0;  // offload: time the update waited for the file
  int64_t bytes_read = 0;      // offload: state bytes read from / written to the file
  int64_t bytes_written = 0;
  int64_t params_updated = 0;    // parameters that had a gradient
  int64_t elements_updated = 0;  // their elements
};

/// The common part of the fused optimizers: the state layout (each parameter's state is a
/// slice of one flat buffer per state tensor, 64-element aligned), where it lives, and the
/// step driver that cuts the work into pieces for the kernels.
class FusedOptimizer : public torch::optim::Optimizer {
 public:
  ~FusedOptimizer() override;

  torch::Tensor step(LossClosure closure = nullptr) override;
  /// step() on these parameters only (each must be one this optimizer steps; those without a
  /// gradient are skipped, as in step()): the optimizer inside backward steps each unit as soon
  /// as its gradients are reduced (fsdp::set_post_reduce_hook). Every update is per element, so
  /// stepping the parameters in several calls gives step()'s values bitwise. last_step()
  /// describes this call.
  void step_params(const std::vector<torch::Tensor>& params);

  /// The checkpoint kind ("adamw", "sgd"): the same as torch's optimizer of that name.
  virtual std::string state_kind() const = 0;
  /// Names of the state tensors of a parameter (in the flat buffers' order).
  const std::vector<std::string>& state_names() const { return state_names_; }

  /// `param`'s state as tensors shaped like it (views of the buffers when in memory, copies
  /// read from the file when offloaded), in the moments dtype; empty if it has none yet.
  /// `*step` is its step count.
  std::map<std::string, torch::Tensor> get_state(const torch::Tensor& param, int64_t* step) const;
  /// One state tensor of `param` (as get_state), read alone: saving an offloaded state holds
  /// one tensor of it at a time.
  torch::Tensor state_tensor(const torch::Tensor& param, const std::string& name) const;
  /// `param`'s step count (0: no state yet).
  void get_state_step(const torch::Tensor& param, int64_t* step) const;
  /// True when the state lives in memory (get_state returns views), false when offloaded.
  bool state_in_memory() const;
  /// Replaces one state tensor of `param` (any float dtype, converted; undefined: zeros), and
  /// its step count: loading an offloaded state holds one tensor of it at a time.
  void set_state_tensor(const torch::Tensor& param, const std::string& name,
                        const torch::Tensor& value);
  void set_step(const torch::Tensor& param, int64_t step);
  /// Replaces `param`'s state (any float dtype, converted; missing names are zeros); step 0
  /// clears it.
  void set_state(const torch::Tensor& param, const std::map<std::string, torch::Tensor>& state,
                 int64_t step);

  const OptimizerStateOptions& state_options() const { return state_options_; }
  const OptimizerStepStats& last_step() const { return last_; }
  /// Whether `param` is one of the parameters this optimizer steps (frozen ones are not).
  bool owns(const torch::Tensor& param) const {
    return slot_index_.count(param.unsafeGetTensorImpl()) > 0;
  }
  /// Bytes of state the optimizer holds (all of it, in memory or in the file).
  int64_t state_bytes() const;
  /// Bytes of state resident in memory now (offload: its two chunk buffers).
  int64_t resident_state_bytes() const;
  /// Offload: the file and the I/O mode ("buffered" when O_DIRECT was refused); "" otherwise.
  std::string offload_info() const;
  /// The kernel capability in use ("AVX512", "AVX2" or "DEFAULT").
  static std::string kernel_capability();

  /// torch's archive format cannot hold this state (it may be in a file, in bf16): use
  /// fsdp::save_sharded / load_sharded, which can.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 protected:
  FusedOptimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                 std::unique_ptr<torch::optim::OptimizerOptions> defaults,
                 OptimizerStateOptions state_options);

  /// The parameters as one group with the defaults (the constructors taking a list).
  static std::vector<torch::optim::OptimizerParamGroup> one_group(
      std::vector<torch::Tensor> params);

  /// One parameter as the step driver sees it.
  struct Slot {
    torch::Tensor param;
    size_t group = 0;
    int64_t numel = 0;
    int64_t offset = 0;  // into each flat state buffer, in elements
    int64_t step = 0;    // steps taken; 0 = no state yet
    uint32_t id = 0;     // stable index, part of the rounding key
  };
  /// Throws if a group's options need state this optimizer was not built with (checked before
  /// any parameter is touched).
  virtual void check_options(const torch::optim::OptimizerOptions& options) const = 0;
  /// Per-step scalars of slot `index` (its step already counts this one), computed before any
  /// element is touched.
  virtual void prepare(const Slot& slot, size_t index,
                       const torch::optim::OptimizerOptions& options) = 0;
  /// Updates elements [begin, end) of `slot`'s parameter; state[k] points at element `begin`
  /// of the k-th state tensor. Called from several threads at once, on disjoint ranges.
  virtual void update(const Slot& slot, size_t index, int64_t begin, int64_t end, const float* grad,
                      void* const* state) const = 0;
  /// Builds the layout and the store once the groups are known (the derived constructor calls
  /// it: which state tensors exist can depend on the options, e.g. amsgrad).
  void init_state(std::vector<std::string> state_names);
  /// Stochastic rounding key of a slot for its current step.
  uint32_t rounding_key(const Slot& slot) const;
  size_t num_slots() const { return slots_.size(); }
  bool bf16_state() const { return state_options_.moments_dtype() == torch::kBFloat16; }

 private:
  void build_layout();
  // Builds the layout if param groups were added since (refused once some state exists).
  void ensure_layout();
  // step() and step_params(), after ensure_layout(): the slots marked in `selected` (nullptr:
  // all) that have a grad.
  void step_selected(const std::vector<char>* selected);
  size_t slot_of(const torch::Tensor& param) const;

  OptimizerStateOptions state_options_;
  std::vector<std::string> state_names_;
  std::vector<Slot> slots_;
  std::unordered_map<const void*, size_t> slot_index_;  // TensorImpl -> slot (checkpoints)
  std::unique_ptr<detail::StateStore> store_;
  OptimizerStepStats last_;
};

/// AdamW with decoupled weight decay, torch::optim::AdamW's update formula and options
/// (per-group lr, betas, eps, weight_decay, amsgrad). Weight-decay exemptions (biases, norms)
/// are param groups with weight_decay 0, as with torch's.
class FusedAdamW : public FusedOptimizer {
 public:
  explicit FusedAdamW(std::vector<torch::optim::OptimizerParamGroup> groups,
                      torch::optim::AdamWOptions defaults = {},
                      OptimizerStateOptions state_options = {});
  explicit FusedAdamW(std::vector<torch::Tensor> params, torch::optim::AdamWOptions defaults = {},
                      OptimizerStateOptions state_options = {});
  ~FusedAdamW() override;
  std::string state_kind() const override { return "adamw"; }

 protected:
  void check_options(const torch::optim::OptimizerOptions& options) const override;
  void prepare(const Slot& slot, size_t index,
               const torch::optim::OptimizerOptions& options) override;
  void update(const Slot& slot, size_t index, int64_t begin, int64_t end, const float* grad,
              void* const* state) const override;

 private:
  std::vector<detail::AdamWScalars> scalars_;  // per slot, this step's (see prepare)
};

/// SGD with momentum (dampening, Nesterov, L2 weight decay), torch::optim::SGD's formula.
class FusedSGD : public FusedOptimizer {
 public:
  explicit FusedSGD(std::vector<torch::optim::OptimizerParamGroup> groups,
                    torch::optim::SGDOptions defaults, OptimizerStateOptions state_options = {});
  explicit FusedSGD(std::vector<torch::Tensor> params, torch::optim::SGDOptions defaults,
                    OptimizerStateOptions state_options = {});
  ~FusedSGD() override;
  std::string state_kind() const override { return "sgd"; }

 protected:
  void check_options(const torch::optim::OptimizerOptions& options) const override;
  void prepare(const Slot& slot, size_t index,
               const torch::optim::OptimizerOptions& options) override;
  void update(const Slot& slot, size_t index, int64_t begin, int64_t end, const float* grad,
              void* const* state) const override;

 private:
  std::vector<detail::SGDScalars> scalars_;
};

}  // namespace fsdp
