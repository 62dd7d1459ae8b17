// The collectives of fsdp-cpp, each on the best primitive its backend has: the one door to the
// c10d backend of a ProcessGroup.
//
// All traffic fsdp-cpp generates goes through this file (the library, the models, the trainer
// and the examples alike; ProcessGroup does not hand its backend out), which is why the
// communication counters (CommStats) are exact and the collective-sequence check
// (ProcessGroupOptions::check_collectives) sees every collective. Each function checks and
// counts, issues the collective as one or more c10d calls on the group's lanes (it advances
// the group's lane counter: see ProcessGroupOptions::gloo_lanes), and returns a
// CollectiveWork to wait on.
//
// Choices per backend (see docs/design.md, "Collectives"):
//  - all_gather, Gloo: allgather_coalesced straight into per-parameter output views: one
//    collective per unit, and the only copy is Gloo's own unflatten (no copy-out of ours).
//    NCCL: all_gather_single into one flat buffer, then a copy-out on the same stream.
//  - reduce_scatter, Gloo: all_to_all_single plus a local sum. Gloo's reduce-scatter is an
//    all-reduce in disguise (2(N-1)/N of the data per rank); the all-to-all moves (N-1)/N.
//    NCCL: reduce_scatter_single with ReduceOp::AVG. reduce_scatter_exchange is the same
//    all-to-all for payloads the caller encodes (int8 gradients) and sums after decoding.
//
// Gloo carrying CUDA tensors (ProcessGroupOptions::gloo_device = kCUDA, several ranks on one
// GPU): c10d's Gloo has no CUDA path for allgather_coalesced, and its CUDA paths of the others
// stage through host memory anyway, so each function copies its CUDA tensors to the host
// (ordered after the current stream's work), runs the collective there and copies the result
// back on the waiting thread's current stream.
//
// Benchmark mode (ProcessGroupOptions::bench_local_collectives, FSDP_BENCH_LOCAL_COLLECTIVES=1):
// all_gather, reduce_scatter, all_reduce and broadcast are carried out at issue as local copies
// of the same bytes (see the option) and never reach the backend; they are counted and
// recorded as usual (sent_bytes 0, "(local copy)" in their description). barrier stays real,
// send and recv throw. What remains of a training step is its arithmetic alone.
#pragma once

#include <torch/types.h>

#include <c10/util/intrusive_ptr.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <fsdp/distributed/flight_recorder.h>
#include <fsdp/distributed/process_group.h>

namespace c10d {
class Work;
}

namespace fsdp {

/// kMax and kMin: all_reduce only.
enum class ReduceOp { kSum, kAvg, kMax, kMin };

/// A collective in flight. wait() blocks until the result is in place, including any local
/// step the algorithm needs after the transfer (the sum of an all-to-all reduce-scatter, the
/// copy-out of a flat all-gather), adds the blocked time to the group's CommStats, and turns
/// a backend failure (timeout, dead peer) into an error naming the rank and the collective,
/// the peers that did not reach it (from their progress reports; see flight_recorder.h) and the
/// flight recorder's dump.
/// Destroying an unwaited CollectiveWork waits for it first: buffers must outlive transfers.
/// A collective carried out as several backend calls is waited for as a whole: when one call
/// fails, wait() still waits for every other one (each finishes or fails within the group's
/// timeout) before it throws, so no transfer can still be writing into a buffer its caller
/// frees after the error.
class CollectiveWork {
 public:
  /// `ticket`: the collective's flight-recorder entry (flight_recorder.h), moved to waiting,
  /// completed or failed by wait().
  CollectiveWork(ProcessGroup& group, CollectiveCounter& counter, std::string what,
                 c10::intrusive_ptr<c10d::Work> work, std::function<void()> finish,
                 RecordTicket ticket = {});
  /// One logical collective carried out as several backend calls (a bucketed all-gather).
  CollectiveWork(ProcessGroup& group, CollectiveCounter& counter, std::string what,
                 std::vector<c10::intrusive_ptr<c10d::Work>> works, std::function<void()> finish,
                 RecordTicket ticket = {});
  ~CollectiveWork();
  CollectiveWork(const CollectiveWork&) = delete;
  CollectiveWork& operator=(const CollectiveWork&) = delete;

  void wait();

  /// Adds a step that runs inside wait() after the result is in place (and before wait()
  /// returns): the copy back of a collective staged through host memory.
  void then(std::function<void()> after);

  /// What the trace span of wait() is called ("all_gather_wait", "all-gather wait", "h3"; see
  /// fsdp/core/trace.h). Set by the functions below; `kind` and `label` are static strings.
  void set_trace_label(const char* kind, const char* label, std::string subject) {
    trace_kind_ = kind;
    trace_label_ = label;
    trace_subject_ = std::move(subject);
  }

 private:
  ProcessGroup& group_;
  CollectiveCounter& counter_;
  std::string what_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::function<void()> finish_;
  RecordTicket ticket_;
  bool waited_ = false;
  const char* trace_kind_ = "wait";
  const char* trace_label_ = "wait";
  std::string trace_subject_;
};

// `context` says who issues a collective ("unit 'h3'"): it appears in errors and in the
// collective-sequence check (ProcessGroupOptions::check_collectives), where every rank must
// issue the same sequence.

/// inputs[i]: this rank's piece i (contiguous, any dtype). outputs[i]: contiguous, N times
/// inputs[i]'s bytes, filled rank-major: bytes [r * b_i, (r + 1) * b_i) come from rank r.
/// bucket_bytes > 0 (Gloo): the gather is carried out as several backend calls of at most
/// that many output bytes each, cutting pieces where needed, spread over the group's lanes.
/// Gloo stages every call in flat buffers of its own (the call's input and output), so
/// buckets bound that transient memory to about one bucket per lane instead of (1 + 1/N) x
/// the whole unit. It counts as one collective in CommStats. NCCL ignores it: its flat buffer
/// is the gather itself.
std::unique_ptr<CollectiveWork> all_gather(ProcessGroup& group,
                                           const std::vector<torch::Tensor>& inputs,
                                           const std::vector<torch::Tensor>& outputs,
                                           int64_t bucket_bytes = 0,
                                           const std::string& context = "");

/// input: contiguous, N * S elements, rank-major (the r-th block of S is destined for rank r).
/// output: contiguous, S elements, receives the sum (or mean) over ranks of this rank's block.
std::unique_ptr<CollectiveWork> reduce_scatter(ProcessGroup& group, const torch::Tensor& input,
                                               const torch::Tensor& output, ReduceOp op,
                                               const std::string& context = "");

/// The exchange of a reduce-scatter whose payloads the caller encodes and sums itself (the
/// quantized gradient reduction, ReduceFormat::kInt8): `input` (contiguous, N equal pieces,
/// piece r destined for rank r) is sent, and `output` (same size) receives rank r's piece for
/// this rank as its piece r. all_to_all_single on both backends; counted and recorded as a
/// reduce-scatter of `input`'s bytes. Local mode: `output` is a copy of `input`.
std::unique_ptr<CollectiveWork> reduce_scatter_exchange(ProcessGroup& group,
                                                        const torch::Tensor& input,
                                                        const torch::Tensor& output,
                                                        const std::string& context = "");

/// In place, every rank ends with the same sum (or mean).
std::unique_ptr<CollectiveWork> all_reduce(ProcessGroup& group, const torch::Tensor& tensor,
                                           ReduceOp op, const std::string& context = "");

/// In place, from group rank `root` to all.
std::unique_ptr<CollectiveWork> broadcast(ProcessGroup& group, const torch::Tensor& tensor,
                                          int root, const std::string& context = "");

/// Flat byte view of a contiguous tensor (what moves over the wire).
torch::Tensor as_bytes(const torch::Tensor& t);

/// Point to point (save_consolidated streams rows to rank 0 with them). Counted in
/// CommStats::point_to_point; not part of the collective-sequence check, whose ranks must issue
/// the same sequence: a sender's and a receiver's differ by design. Callers bracket them with
/// collectives that are checked (save_consolidated: an all-gather before, a barrier after).
/// Both use the group's first lane, so that a send and its recv meet on one backend.
std::unique_ptr<CollectiveWork> send(ProcessGroup& group, const torch::Tensor& tensor, int dst,
                                     int tag, const std::string& context = "");
std::unique_ptr<CollectiveWork> recv(ProcessGroup& group, const torch::Tensor& tensor, int src,
                                     int tag, const std::string& context = "");

/// Every rank of the group arrives before any leaves (ProcessGroup::barrier() waits on it).
std::unique_ptr<CollectiveWork> barrier(ProcessGroup& group, const std::string& context = "");

/// Every rank's bytes, in group-rank order (two all-gathers: the lengths, then the padded
/// bytes). For small metadata such as a checkpoint's per-rank index.
std::vector<std::string> all_gather_bytes(ProcessGroup& group, const std::string& mine,
                                          const std::string& context = "");

}  // namespace fsdp
