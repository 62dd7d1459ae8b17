// See pending_reduce.h.
#include "pending_reduce.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

namespace fsdp::detail {

const char* to_string(ReduceStage s) {
  switch (s) {
    case ReduceStage::kScattering:
      return "scattering";
    case ReduceStage::kScattered:
      return "scattered";
    case ReduceStage::kReplicating:
      return "replicating";
    case ReduceStage::kReduced:
      return "reduced";
  }
  return "?";
}

const char* to_string(PassReduction s) {
  switch (s) {
    case PassReduction::kNone:
      return "none";
    case PassReduction::kReduced:
      return "reduced";
    case PassReduction::kHookRan:
      return "hook ran";
  }
  return "?";
}

void PendingReduce::advance(ReduceStage to, const std::string& unit) {
  // The first transition enters the pipeline: at kScattering (a reduce-scatter issued) or, for a
  // unit of one shard, straight at kScattered. Every later one goes to the next stage.
  const bool ok = started_ ? static_cast<int>(to) == static_cast<int>(stage_) + 1
                           : to == ReduceStage::kScattering || to == ReduceStage::kScattered;
  TORCH_INTERNAL_ASSERT(ok, "fsdp: unit '", unit, "': a reduction went from ",
                        started_ ? to_string(stage_) : "unissued", " to ", to_string(to));
  stage_ = to;
  started_ = true;
}

void PendingReduce::free_at(UnitEvent event) {
  for (const auto& l : reduce_lifetimes(kind)) {
    if (l.freed != event)
      continue;
    switch (l.buffer) {
      case UnitBuffer::kReduceRows:
        input = torch::Tensor();
        if (kind == ReduceKind::kLocal)
          output = torch::Tensor();  // one shard: the rows are the output
        break;
      case UnitBuffer::kReduceWire:
        wire = torch::Tensor();
        break;
      case UnitBuffer::kReduceReceived:
        received = torch::Tensor();
        break;
      case UnitBuffer::kReduceOutput:
        output = torch::Tensor();
        break;
      default:
        TORCH_INTERNAL_ASSERT(false, "fsdp: a gather's buffer in a reduction's lifetimes");
    }
  }
}

void PendingReduce::start_host_copy(bool pin) {
  TORCH_INTERNAL_ASSERT(output.defined() && !host_output.defined() && !host_copied_,
                        "fsdp: a reduction's host copy started twice or without an output");
  const auto device = output.device();
  if (device.is_cpu())
    return;
  // Device-generic (c10's guard interface): the engine links no CUDA library; the backend of
  // the tensor's device provides the streams and events.
  const c10::impl::VirtualGuardImpl impl(device.type());
  const c10::Stream compute = impl.getStream(device);
  const c10::Stream side = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/false);
  c10::Event ready(device.type());
  ready.record(compute);  // output is complete once the compute stream reaches this point
  ready.block(side);
  host_output =
      torch::empty(output.sizes(), output.options().device(torch::kCPU).pinned_memory(pin));
  {
    const c10::StreamGuard on_side(side);
    host_output.copy_(output, /*non_blocking=*/pin);
  }
  // The caching allocator hands output's block to the compute stream again only once the
  // copy's stream is past this point, even if the reduction is dropped before the wait.
  output.record_stream(side);
  host_copied_.emplace(device.type());
  host_copied_->record(side);
}

bool PendingReduce::wait_host_copy() {
  if (!host_copied_)
    return false;
  host_copied_->synchronize();
  host_copied_.reset();
  return true;
}

void PassReductionState::reduced(const std::string& unit) {
  TORCH_INTERNAL_ASSERT(state_ != PassReduction::kHookRan, "fsdp: unit '", unit,
                        "' reduced again after its post-reduce hook ran in the same pass");
  state_ = PassReduction::kReduced;
}

void PassReductionState::hook_ran(const std::string& unit) {
  TORCH_INTERNAL_ASSERT(state_ == PassReduction::kReduced, "fsdp: unit '", unit,
                        "': post-reduce hook in state '", to_string(state_), "'");
  state_ = PassReduction::kHookRan;
}

}  // namespace fsdp::detail
