// The gradient reduction pipeline of one unit, as states (like UnitState for the parameters):
// each reduction a unit issues in a backward pass (PendingReduce) and what the pass as a whole
// has done with the unit's gradients (PassReduction), each with its transitions in one place and
// asserted.
//
// ReduceStage, per reduction, in this order only:
//   kScattering   the reduce-scatter (or ReduceFormat::kInt8's exchange) is in flight
//   kScattered    this rank's reduced shards are in `output`; the all-reduce across replicas
//                 (kHybridShard, kNoShard) is not issued yet (a unit of one shard starts here)
//   kReplicating  the all-reduce is issued, in RootState::reduce_round() `all_reduce_round`
//                 (no collective at all where there is one replica)
//   kReduced      every collective is done: `output` holds the final reduced shards and flags
//
// PassReduction, per unit and backward pass:
//   kNone      no reduction yet: the grads kept by earlier no-sync passes still wait to travel
//   kReduced   a reduction carried them (with this pass's): later ones of the pass do not
//   kHookRan   the post-reduce hook (the optimizer in backward) took the reduced grads: they are
//              the hook's, not stashed any more, and no reduction may follow in this pass
// Both kReduced and kHookRan return to kNone when the pass ends or fails.
#pragma once

#include <c10/core/Event.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fsdp/detail/buffer_lifetimes.h>
#include <fsdp/distributed/collectives.h>

namespace fsdp::detail {

class ShardedParam;

enum class ReduceStage { kScattering, kScattered, kReplicating, kReduced };
enum class PassReduction { kNone, kReduced, kHookRan };

const char* to_string(ReduceStage s);
const char* to_string(PassReduction s);

// Gradient communication of one post-backward, in flight until ParamGroup::wait_reduces(). Each
// rank's block of the reduce-scatter input is [param 0 chunk | ... | param P-1 chunk | P flags]:
// flag i is 1 where this rank produced a gradient for param i, so after the (averaging)
// reduction a param gets a grad exactly when some rank produced one, as in one process.
// Its buffers live as fsdp/detail/buffer_lifetimes.h says for its kind: free_at() drops them.
struct PendingReduce {
  explicit PendingReduce(ReduceKind kind) : kind(kind) {}

  ReduceKind kind;
  std::vector<ShardedParam*> params;
  torch::Tensor input;       // the rows (UnitBuffer::kReduceRows); kLocal: the output itself
  torch::Tensor output;      // this rank's reduced shards, then the P flags
  int64_t flags_offset = 0;  // where the flags start in output
  // ReduceFormat::kInt8: the exchange's buffers ([N x piece] bytes); decoded into output when
  // the exchange is done.
  torch::Tensor wire, received;
  std::unique_ptr<CollectiveWork> reduce_scatter;
  std::vector<std::unique_ptr<CollectiveWork>> all_reduces;
  uint64_t all_reduce_round = 0;  // set on kScattered -> kReplicating

  ReduceStage stage() const { return stage_; }
  /// The one transition: to the next stage, in ReduceStage's order; kScattered first for a
  /// reduction without a reduce-scatter. `unit` names the unit in the assertion's message.
  void advance(ReduceStage to, const std::string& unit);
  /// Frees the buffers whose lifetime ends at `event` (reduce_lifetimes(kind)).
  void free_at(UnitEvent event);

  // CPU offload with the compute on an accelerator: once `output` is final (kReplicating with
  // nothing in flight, or kReduced), it is copied to host memory on a stream of its own, so
  // the device-to-host copy overlaps the rest of backward instead of stalling its end; the
  // grads are then installed from `host_output` (flags included: no device sync to read them).
  // `output` itself lives as long as before (buffer_lifetimes.h), so device memory and the
  // planner's model are unchanged.
  torch::Tensor host_output;
  /// Starts the copy of `output` into `host_output` (pinned when `pin`, which makes it
  /// asynchronous) on a pool stream that first waits for the current one. No-op on the CPU.
  void start_host_copy(bool pin);
  /// Blocks the host until that copy is done; false when none was started.
  bool wait_host_copy();

 private:
  ReduceStage stage_ = ReduceStage::kScattering;
  bool started_ = false;
  std::optional<c10::Event> host_copied_;
};

// What one unit's backward pass has done with its gradients (see above).
class PassReductionState {
 public:
  PassReduction get() const { return state_; }
  /// A reduction of this pass was issued: kNone | kReduced -> kReduced.
  void reduced(const std::string& unit);
  /// The post-reduce hook ran: kReduced -> kHookRan.
  void hook_ran(const std::string& unit);
  /// The pass ended or failed: -> kNone.
  void pass_closed() { state_ = PassReduction::kNone; }

 private:
  PassReduction state_ = PassReduction::kNone;
};

}  // namespace fsdp::detail
