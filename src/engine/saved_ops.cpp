// See saved_ops.h.
#include "saved_ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <memory>
#include <mutex>

namespace fsdp::detail {
namespace {

constexpr c10::DispatchKey kKey = c10::DispatchKey::CustomRNGKeyId;

// The region running on this thread (recomputations of nested regions restore the outer one).
thread_local SavedOps* t_active = nullptr;

// The ops whose outputs selective checkpointing keeps: the matrix products (every Linear and
// every batched product of attention reaches one of them) and fused attention on CPU.
constexpr const char* kSavedOps[] = {
    "mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
};

// What an op with a composite kernel runs at this key instead: the kernel below it.
void pass_below(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey), stack);
}

void saved_op_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                     torch::jit::Stack* stack) {
  const auto below = keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey);
  SavedOps* ops = t_active;
  if (ops == nullptr) {
    op.redispatchBoxed(below, stack);
    return;
  }
  const auto& schema = op.schema();
  const size_t num_returns = schema.returns().size();
  if (ops->recording) {
    op.redispatchBoxed(below, stack);
    SavedOps::Entry entry;
    entry.op = schema.name();
    for (size_t i = stack->size() - num_returns; i < stack->size(); ++i) {
      const auto& v = (*stack)[i];
      // A copy, not the output itself: the region may change the output in place afterwards
      // through an alias the version counter does not follow (at::matmul returns an
      // _unsafe_view of the product and linear adds the bias to it in place).
      entry.outputs.push_back(
          v.isTensor() && v.toTensor().defined() ? c10::IValue(v.toTensor().clone()) : v);
    }
    ops->entries.push_back(std::move(entry));
    return;
  }
  TORCH_CHECK(ops->next < ops->entries.size() && ops->entries[ops->next].op == schema.name(),
              "activation checkpointing: the recomputation of a region ran '", schema.name(),
              "' where its forward ran ",
              ops->next < ops->entries.size() ? "'" + ops->entries[ops->next].op + "'"
                                              : std::string("no more matrix products"),
              " (the region must compute the same thing when run again)");
  auto entry = std::move(ops->entries[ops->next++]);
  torch::jit::drop(*stack, schema.arguments().size());
  for (auto& v : entry.outputs) {
    // A new tensor object over the same storage: autograd attaches its own metadata to what a
    // kernel returns, and the kept one must not carry the recomputation's graph.
    if (v.isTensor())
      stack->emplace_back(v.toTensor().variable_data());
    else
      stack->push_back(std::move(v));
  }
}

bool is_saved_op(const c10::OperatorName& name) {
  if (name.name.rfind("aten::", 0) != 0)
    return false;
  const auto base = name.name.substr(6);
  for (const char* op : kSavedOps) {
    if (base == op)
      return true;
  }
  return false;
}

void register_kernels() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Never destroyed: the registrations must outlive every region.
    auto* fallback = new torch::Library(torch::Library::IMPL, "_", kKey, __FILE__, __LINE__);
    fallback->fallback(torch::CppFunction::makeFallthrough());
    auto* kernels = new torch::Library(torch::Library::IMPL, "aten", kKey, __FILE__, __LINE__);
    for (const char* name : kSavedOps)
      kernels->impl(name, torch::CppFunction::makeFromBoxedFunction<&saved_op_kernel>());
    // CustomRNGKeyId counts as a backend for composite kernels: an op with a
    // CompositeExplicitAutograd kernel (native_layer_norm, for one) would run that generic
    // kernel at this key instead of falling through to the CPU one, and compute differently.
    // A kernel registered for the op itself takes precedence over composites, and the
    // dispatcher refuses per-op fallthroughs, so each such op gets a boxed kernel that passes
    // the call below this key. Ops registered after this point (a library loaded later) still
    // compute correctly, possibly through their composite kernel.
    auto& dispatcher = c10::Dispatcher::singleton();
    auto* handles = new std::vector<c10::RegistrationHandleRAII>();
    for (const auto& name : dispatcher.getAllOpNames()) {
      if (is_saved_op(name))
        continue;
      auto op = dispatcher.findOp(name);
      if (!op || !op->hasComputedKernelForDispatchKey(kKey))
        continue;
      handles->push_back(dispatcher.registerImpl(
          name, kKey, c10::KernelFunction::makeFromBoxedFunction<&pass_below>(), std::nullopt,
          nullptr, "fsdp selective checkpointing: pass below"));
    }
  });
}

}  // namespace

SavedOps::Scope::Scope(SavedOps* ops, bool record) : previous_(t_active) {
  if (ops != nullptr) {
    register_kernels();
    include_.emplace(kKey);
    ops->recording = record;
    ops->next = 0;
  }
  t_active = ops;
}

SavedOps::Scope::~Scope() {
  t_active = previous_;
}

}  // namespace fsdp::detail
