// The machinery behind fsdp::forward (include <fsdp/fully_shard.h>, not this): one call of a
// unit from its pre-forward to its post-forward (ForwardCall), and how its arguments are
// wrapped, stored for an activation-checkpointing replay and put back (ArgSlot). Templates,
// hence in a header; nothing here is API.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <fsdp/activation_checkpoint.h>
#include <fsdp/detail/tensor_visit.h>

namespace fsdp {

namespace detail {
class ParamGroup;
/// The unit of `module`, or nullptr.
std::shared_ptr<ParamGroup> find_unit(const torch::nn::Module& module);

/// One fsdp::forward call of a unit, from its pre-forward to its post-forward. The constructor
/// gathers the unit (and prefetches); if the module's forward throws, the destructor returns the
/// unit and its model to a state where the next step works.
class ForwardCall {
 public:
  explicit ForwardCall(std::shared_ptr<ParamGroup> unit);
  ForwardCall(const ForwardCall&) = delete;
  ForwardCall& operator=(const ForwardCall&) = delete;
  ~ForwardCall();
  /// Whether wrap_inputs() replaces `t`: it requires grad (in grad mode), or mixed
  /// precision casts it.
  bool takes(const torch::Tensor& t) const;
  /// Casts the inputs to the unit's param_dtype (MixedPrecisionPolicy::cast_forward_inputs)
  /// and passes those that require grad through the unit's post-backward identity; returns
  /// them in the same order.
  std::vector<torch::Tensor> wrap_inputs(std::vector<torch::Tensor> inputs);
  /// `t` in the unit's output_dtype, if it has one and t is floating-point.
  torch::Tensor cast_output(const torch::Tensor& t) const;
  /// Frees the unit (unless something holds it) and hooks the outputs that require grad.
  void finish(const std::vector<torch::Tensor>& outputs);
  /// How this call checkpoints its forward: the unit's activation_checkpointing when grad
  /// mode is on and something in the call needs gradients, else kNone. `replayable`: the
  /// arguments can be copied for the recomputation (throws if they cannot and it would be
  /// needed).
  CheckpointMode checkpoint_mode(bool replayable) const;
  /// The unit's name ("h3").
  const std::string& unit_name() const;

 private:
  bool casts_input(const torch::Tensor& t) const;

  std::shared_ptr<ParamGroup> unit_;
  std::optional<torch::ScalarType> input_dtype_, output_dtype_;
  bool inputs_require_grad_ = false;
  bool finished_ = false;
};

/// A by-reference argument passed with std::ref: fsdp cannot wrap what it holds.
void check_no_grad_through_reference(const std::vector<torch::Tensor>& tensors);

template <typename M>
decltype(auto) module_impl(M& m) {
  if constexpr (requires { m.ptr(); }) {
    return *m.ptr();  // ModuleHolder
  } else if constexpr (requires { *m; }) {
    return *m;  // shared_ptr / pointer
  } else {
    return (m);
  }
}

// One argument of fsdp::forward. Arguments that hold tensors requiring grad are passed as a
// copy whose tensors went through the unit's post-backward identity, with the caller's value
// category (a const lvalue for an lvalue, an rvalue for an rvalue), so `const T&`, `T` and
// `T&&` parameters all bind; a `T&` parameter does not compile (a copy would silently drop the
// callee's writes): pass std::ref(x) for those. Arguments without tensors pass through as they
// are.
template <typename Arg>
class ArgSlot {
  using D = std::remove_cvref_t<Arg>;

 public:
  /// A copy of the argument can be passed to the module's forward again (recomputation).
  static constexpr bool kReplayable = !IsRefWrapper<D>::value && std::is_copy_constructible_v<D>;

 private:
  static_assert(IsRefWrapper<D>::value || kWalkable<D>,
                "fsdp::forward: an argument's type may hold tensors fsdp cannot see. Give it a "
                "member `template <typename F> void visit_tensors(F&& f)` that calls f on each "
                "tensor field (see fsdp/detail/tensor_visit.h), or pass it with std::ref");

 public:
  ArgSlot(Arg&& arg) : arg_(std::forward<Arg>(arg)) {}  // NOLINT: implicit, for std::tuple

  /// Appends this argument's tensors that `call` takes (ForwardCall::takes).
  void collect(const ForwardCall& call, std::vector<torch::Tensor>& out) {
    if constexpr (IsRefWrapper<D>::value) {
      using T = std::remove_cv_t<typename D::type>;
      static_assert(kWalkable<T>,
                    "fsdp::forward: std::ref of a type fsdp cannot look into; give it a "
                    "visit_tensors member (see fsdp/detail/tensor_visit.h)");
      std::vector<torch::Tensor> inside;
      auto f = [&](torch::Tensor& t) { inside.push_back(t); };
      walk_tensors(const_cast<T&>(arg_.get()), f);
      check_no_grad_through_reference(inside);
    } else if constexpr (kMayHoldTensors<D>) {
      // Read-only walk: walk_tensors takes a mutable object for user visit_tensors members.
      auto f = [&](torch::Tensor& t) {
        if (call.takes(t))
          out.push_back(t);
      };
      walk_tensors(const_cast<D&>(static_cast<const D&>(arg_)), f);
    }
  }

  /// Replaces, in a copy, the tensors collect() returned by `wrapped[next...]`.
  void replace(const ForwardCall& call, const std::vector<torch::Tensor>& wrapped, size_t& next) {
    if constexpr (!IsRefWrapper<D>::value && kMayHoldTensors<D>) {
      bool any = false;
      auto probe = [&](torch::Tensor& t) { any = any || call.takes(t); };
      walk_tensors(const_cast<D&>(static_cast<const D&>(arg_)), probe);
      if (!any)
        return;
      copy_.emplace(static_cast<const D&>(arg_));
      auto f = [&](torch::Tensor& t) {
        if (call.takes(t))
          t = wrapped.at(next++);
      };
      walk_tensors(*copy_, f);
    }
  }

  decltype(auto) get() {
    if constexpr (IsRefWrapper<D>::value) {
      return arg_.get();
    } else if constexpr (!kMayHoldTensors<D>) {
      return std::forward<Arg>(arg_);
    } else if constexpr (std::is_lvalue_reference_v<Arg>) {
      return static_cast<const D&>(copy_ ? *copy_ : arg_);
    } else {
      return static_cast<D&&>(copy_ ? *copy_ : arg_);
    }
  }

 private:
  Arg&& arg_;
  std::optional<D> copy_;
};

// The tensors of a value, in walk order (undefined ones skipped).
template <typename T>
std::vector<torch::Tensor> tensors_in(T& value) {
  std::vector<torch::Tensor> out;
  auto f = [&](torch::Tensor& t) {
    if (t.defined())
      out.push_back(t);
  };
  walk_tensors(value, f);
  return out;
}

// Replaces the defined tensors of `value`, in walk order, by tensors[0...].
template <typename T>
void replace_tensors(T& value, const std::vector<torch::Tensor>& tensors) {
  size_t next = 0;
  auto f = [&](torch::Tensor& t) {
    if (t.defined())
      t = tensors.at(next++);
  };
  walk_tensors(value, f);
}

// An argument of the recomputation, in the caller's value category.
template <typename Arg, typename D>
decltype(auto) replay_arg(D& stored) {
  if constexpr (std::is_lvalue_reference_v<Arg>)
    return static_cast<const D&>(stored);
  else
    return static_cast<D&&>(stored);
}

// A unit's forward under activation checkpointing: copies of the arguments (their tensors
// detached) are kept for the recomputation, which calls the module's forward again on them.
template <typename Result, typename... Args, typename Impl>
Result checkpointed_forward(Impl& impl, CheckpointMode mode, std::tuple<ArgSlot<Args>...>& slots,
                            const std::string& unit_name) {
  using Stored = std::tuple<std::remove_cvref_t<Args>...>;
  auto saved =
      std::apply([](auto&... slot) { return std::make_shared<Stored>(slot.get()...); }, slots);
  std::vector<torch::Tensor> inputs;
  auto take = [&](torch::Tensor& t) {
    if (t.defined()) {
      inputs.push_back(t);
      t = t.detach();
    }
  };
  walk_tensors(*saved, take);
  // The graph may outlive the caller's handle on the module: the recomputation co-owns it.
  std::shared_ptr<Impl> module(impl.shared_from_this(), &impl);
  auto run = [module, saved](const std::vector<torch::Tensor>& tensors) -> Result {
    Stored args = *saved;
    replace_tensors(args, tensors);
    return std::apply(
        [&](auto&... a) -> Result { return Result(module->forward(replay_arg<Args>(a)...)); },
        args);
  };
  std::optional<Result> kept;
  auto outputs = checkpoint_apply(
      [&](const std::vector<torch::Tensor>& t) {
        kept.emplace(run(t));
        return tensors_in(*kept);
      },
      [run](const std::vector<torch::Tensor>& t) {
        Result again = run(t);
        return tensors_in(again);
      },
      std::move(inputs), mode, unit_name);
  replace_tensors(*kept, outputs);
  return std::move(*kept);
}

}  // namespace detail

}  // namespace fsdp
