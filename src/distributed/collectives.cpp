// Implementation notes for collectives.h: the per-backend algorithm choices and the
// accounting of bytes. "sent_bytes" is what the algorithm puts on the wire from this rank.
#include <fsdp/distributed/collectives.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <fsdp/core/trace.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <string_view>
#include <thread>

#include "backend_calls.h"
#include "collective_check.h"
#include "env_switch.h"
#include "group_access.h"
#include "peer_progress.h"

namespace fsdp {

namespace {

// FSDP_TRACE_WAITS=<ms>: print every wait for a collective of at least that many milliseconds
// on stderr, naming the rank and the collective (-1 when unset: no tracing).
double trace_waits_from_environment() {
  const char* v = std::getenv("FSDP_TRACE_WAITS");
  if (v == nullptr || *v == '\0')
    return -1;
  double ms = 0;
  const char* end = v + std::char_traits<char>::length(v);
  auto [ptr, ec] = std::from_chars(v, end, ms);
  if (ec != std::errc() || ptr != end || !(ms >= 0)) {
    // Read inside a wait, which must not throw for a diagnostic: say so once and trace nothing.
    std::fprintf(stderr,
                 "fsdp: FSDP_TRACE_WAITS=\"%s\" is not a non-negative number of milliseconds; "
                 "ignored\n",
                 v);
    return -1;
  }
  return ms;
}

bool is_gloo(const ProcessGroup& g) {
  return g.backend_name() == "gloo";
}

void check_contiguous(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_contiguous(), "fsdp collectives: ", what, " must be contiguous");
}

// "all-gather, 4096 B for unit 'h3'": what a collective is, for errors and the sequence check.
std::string describe(const char* kind, int64_t bytes, const std::string& detail,
                     const std::string& context) {
  std::string s = std::string(kind) + ", " + std::to_string(bytes) + " B";
  if (!detail.empty())
    s += " " + detail;
  if (!context.empty())
    s += " for " + context;
  return s;
}

const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
  }
  return "?";
}

// ProcessGroupOptions::bench_local_collectives: the collective is carried out as a local copy
// of its bytes, at issue, and nothing reaches the backend. The work returned has no backend
// call to wait for.
bool local(const ProcessGroup& g) {
  return g.bench_local_collectives();
}

// See "Gloo carrying CUDA tensors" in collectives.h: any of the call's tensors on the GPU.
bool staged_through_host(const ProcessGroup& g, std::initializer_list<torch::Tensor> tensors) {
  return is_gloo(g) && !local(g) &&
         std::any_of(tensors.begin(), tensors.end(), [](const auto& t) { return t.is_cuda(); });
}

bool staged_through_host(const ProcessGroup& g, const std::vector<torch::Tensor>& inputs,
                         const std::vector<torch::Tensor>& outputs) {
  auto cuda = [](const torch::Tensor& t) { return t.is_cuda(); };
  return is_gloo(g) && !local(g) &&
         (std::any_of(inputs.begin(), inputs.end(), cuda) ||
          std::any_of(outputs.begin(), outputs.end(), cuda));
}

torch::Tensor host_buffer(const torch::Tensor& t) {
  return torch::empty(t.sizes(), t.options().device(torch::kCPU));
}

std::unique_ptr<CollectiveWork> done_locally(ProcessGroup& group, CollectiveCounter& counter,
                                             const std::string& what, const RecordTicket& ticket) {
  return std::make_unique<CollectiveWork>(
      group, counter, what, std::vector<c10::intrusive_ptr<c10d::Work>>{}, nullptr, ticket);
}

void refuse_locally(const ProcessGroup& group, const char* kind) {
  TORCH_CHECK(!local(group), "fsdp ", kind, ": group '", group.name(),
              "' runs its collectives as local copies (bench_local_collectives, a benchmark "
              "mode): point-to-point has no local equivalent");
}

// Called before every collective is issued (debug mode only).
void check_sequence(ProcessGroup& group, const std::string& description) {
  if (auto* check = detail::GroupAccess::check(group))
    check->before(description);
}

// FSDP_COMM_STATS=0: no collective is counted or timed (every CommStats stays zero, and
// fsdp-train's wait times read 0). Read once; it exists for bench/step_overheads.py to measure
// what the accounting costs (docs/step_overheads.md).
bool accounting() {
  static const bool on = detail::env_switch("FSDP_COMM_STATS", true);
  return on;
}

// The group's counter of one kind of collective, or a scratch one nobody reads when nothing is
// counted (accounting()): the callers update it unconditionally.
CollectiveCounter& counter_of(ProcessGroup& group, CollectiveCounter CommStats::*kind) {
  if (accounting())
    return group.comm_stats().*kind;
  thread_local CollectiveCounter scratch;
  return scratch;
}

// The collective's flight-recorder entry (flight_recorder.h). Point-to-point messages take no
// number in the group's sequence: a sender's and a receiver's sequences differ by design.
RecordTicket record(ProcessGroup& group, const char* kind, int64_t bytes, const std::string& dtype,
                    const std::string& description, const std::string& context,
                    bool in_sequence = true) {
  CollectiveRecord r;
  r.group = group.name();
  r.seq = in_sequence ? detail::GroupAccess::next_sequence(group) : 0;
  r.kind = kind;
  r.context = context;
  r.bytes = bytes;
  r.dtype = dtype;
  r.description = description;
  RecordTicket t;
  t.group = r.group;
  t.seq = r.seq;
  t.id = FlightRecorder::global().issue(std::move(r));
  return t;
}

// The peers of a failed collective, and the dump, once: when one collective fails, those in
// flight behind it fail too, and each would otherwise wait for the store and dump again.
std::string diagnose_failure(ProcessGroup& group, const RecordTicket& ticket,
                             const std::string& what) {
  static std::mutex mutex;
  static double last_time = -1e9;
  static std::string last_message;
  std::lock_guard<std::mutex> lock(mutex);
  if (unix_seconds() - last_time < 60)
    return last_message.empty() ? "" : " [" + last_message + "]";
  const int me = group.global_ranks().at(static_cast<size_t>(group.rank()));
  const auto deadline =
      std::min<std::chrono::milliseconds>(group.timeout(), std::chrono::seconds(5));
  std::string peers;
  try {
    peers = detail::diagnose_peers(group.global_ranks(), me, ticket, what, deadline);
  } catch (const std::exception& e) {
    peers = std::string("peers unknown: ") + e.what();
  }
  const std::string path = FlightRecorder::global().dump("collective failed: " + what);
  last_message = peers;
  if (!path.empty())
    last_message += (last_message.empty() ? "" : "; ") + std::string("flight recorder: ") + path;
  last_time = unix_seconds();
  return last_message.empty() ? "" : " [" + last_message + "]";
}

// ---- Trace spans (fsdp/core/trace.h) --------------------------------------------------------
// Each collective records three spans while tracing is on: its issue and its wait on the
// calling thread, and its transfer on the track of the lane it ran on ("<group> lane <k>"),
// from its issue (or the end of the lane's previous transfer) to the backend's completion
// callback, which Gloo runs on the lane's worker thread as the collective finishes.

struct TraceNames {
  const char* issue_kind;
  const char* issue;
  const char* wait_kind;
  const char* wait;
  const char* transfer;
};
constexpr TraceNames kAllGatherNames{"all_gather_issue", "all-gather issue", "all_gather_wait",
                                     "all-gather wait", "all-gather"};
constexpr TraceNames kReduceScatterNames{"reduce_scatter_issue", "reduce-scatter issue",
                                         "reduce_scatter_wait", "reduce-scatter wait",
                                         "reduce-scatter"};
constexpr TraceNames kAllReduceNames{"all_reduce_issue", "all-reduce issue", "all_reduce_wait",
                                     "all-reduce wait", "all-reduce"};
constexpr TraceNames kBroadcastNames{"broadcast_issue", "broadcast issue", "broadcast_wait",
                                     "broadcast wait", "broadcast"};
constexpr TraceNames kPointToPointNames{"p2p_issue", "send/recv issue", "p2p_wait",
                                        "send/recv wait", "send/recv"};
constexpr TraceNames kBarrierNames{"barrier_issue", "barrier issue", "barrier_wait", "barrier wait",
                                   "barrier"};

// "unit 'h3'" -> "h3": the spans name a unit as the engine's own spans do.
std::string_view trace_subject(const std::string& context) {
  std::string_view v = context;
  if (v.size() > 7 && v.starts_with("unit '") && v.ends_with('\''))
    return v.substr(6, v.size() - 7);
  return v;
}

std::unique_ptr<CollectiveWork> labelled(std::unique_ptr<CollectiveWork> work,
                                         const TraceNames& names, const std::string& context) {
  work->set_trace_label(names.wait_kind, names.wait, std::string(trace_subject(context)));
  return work;
}

// The transfer's span on its lane, recorded by the backend's completion callback.
void trace_transfer(const ProcessGroup& group, const c10d::Backend& lane,
                    const c10::intrusive_ptr<c10d::Work>& work, const TraceNames& names,
                    const std::string& context, int64_t bytes, int64_t issued_ns) {
  if (!trace::enabled() || !work)
    return;
  try {
    auto future = work->getFuture();
    std::string track =
        group.name() + " lane " + std::to_string(detail::GroupAccess::lane_index(group, lane));
    std::string subject(trace_subject(context));
    std::string name = std::string(names.transfer) + (subject.empty() ? "" : " " + subject);
    future->addCallback([track = std::move(track), name = std::move(name),
                         subject = std::move(subject), bytes, issued_ns,
                         generation = trace::generation()](c10::ivalue::Future&) {
      trace::record_on_track(track, generation, "transfer", name, subject, bytes, issued_ns,
                             trace::now_ns());
    });
  } catch (const std::exception&) {
    // A backend without futures: no transfer span, the issue and wait spans remain.
  }
}

}  // namespace

torch::Tensor as_bytes(const torch::Tensor& t) {
  check_contiguous(t, "tensor viewed as bytes");
  // view(dtype) needs a last dimension to scale; a 1-d reshape of a contiguous tensor is free.
  return t.reshape({-1}).view(torch::kUInt8);
}

CollectiveWork::CollectiveWork(ProcessGroup& group, CollectiveCounter& counter, std::string what,
                               c10::intrusive_ptr<c10d::Work> work, std::function<void()> finish,
                               RecordTicket ticket)
    : CollectiveWork(group, counter, std::move(what),
                     std::vector<c10::intrusive_ptr<c10d::Work>>{std::move(work)},
                     std::move(finish), std::move(ticket)) {}

CollectiveWork::CollectiveWork(ProcessGroup& group, CollectiveCounter& counter, std::string what,
                               std::vector<c10::intrusive_ptr<c10d::Work>> works,
                               std::function<void()> finish, RecordTicket ticket)
    : group_(group),
      counter_(counter),
      what_(std::move(what)),
      works_(std::move(works)),
      finish_(std::move(finish)),
      ticket_(std::move(ticket)) {
  std::erase_if(works_, [](const auto& w) { return !w; });
}

CollectiveWork::~CollectiveWork() {
  if (!waited_) {
    try {
      wait();
    } catch (const std::exception&) {
      // Destructors must not throw; the failure was the caller's to observe via wait().
    }
  }
}

void CollectiveWork::then(std::function<void()> after) {
  TORCH_CHECK(!waited_, "CollectiveWork::then after wait()");
  auto first = std::move(finish_);
  finish_ = [first = std::move(first), after = std::move(after)]() {
    if (first)
      first();
    after();
  };
}

void CollectiveWork::wait() {
  if (waited_)
    return;
  waited_ = true;
  trace::Span span(trace_kind_, trace_label_, trace_subject_);
  auto& recorder = FlightRecorder::global();
  recorder.transition(ticket_, CollectiveState::kWaiting);
  // Without accounting the wait is not timed either (the clock is read only to count it).
  const bool timed = accounting();
  const auto start =
      timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  auto add_wait = [&] {
    if (!timed)
      return;
    const double w =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    counter_.wait_seconds += w;
    // The breakdown sums the waits; this says which collective each came from.
    static const double trace_ms = trace_waits_from_environment();
    if (trace_ms >= 0 && w * 1e3 >= trace_ms)
      std::fprintf(stderr, "[rank %d] waited %.2f ms for %s\n", group_.rank(), w * 1e3,
                   what_.c_str());
  };
  // Every backend call is waited for, even after one failed: the caller frees the buffers
  // once wait() returns or throws, and a call still running would write into freed memory.
  std::string error;
  for (auto& w : works_) {
    try {
      w->wait();
    } catch (const std::exception& e) {
      if (error.empty())
        error = e.what();
    }
  }
  try {
    if (error.empty() && finish_)
      finish_();
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!error.empty()) {
    works_.clear();
    add_wait();
    recorder.transition(ticket_, CollectiveState::kFailed, error);
    const std::string seq =
        ticket_.seq ? " (#" + std::to_string(ticket_.seq) + " of group '" + ticket_.group + "')"
                    : "";
    TORCH_CHECK(false, "[rank ", group_.global_ranks().at(group_.rank()), "] ", what_, seq,
                " over ", group_.size(), " ranks failed (timeout ", group_.timeout().count(),
                " ms; a peer may have died): ", error.substr(0, error.find('\n')),
                diagnose_failure(group_, ticket_, what_));
  }
  recorder.transition(ticket_, CollectiveState::kCompleted);
  if (is_gloo(group_)) {
    // Gloo's worker thread drops its reference to the work (and so to the buffers the work
    // holds) just after marking it complete. Waiting for that moment, a few microseconds,
    // makes buffers die when wait() returns instead of at a racy instant after: memory
    // accounting is then deterministic, and a freed buffer is not counted into the next peak.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(5);
    for (auto& w : works_) {
      while (w.use_count() > 1 && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::yield();
      }
    }
  }
  works_.clear();
  add_wait();
}

std::unique_ptr<CollectiveWork> all_gather(ProcessGroup& group,
                                           const std::vector<torch::Tensor>& inputs,
                                           const std::vector<torch::Tensor>& outputs,
                                           int64_t bucket_bytes, const std::string& context) {
  TORCH_CHECK(!inputs.empty() && inputs.size() == outputs.size(),
              "fsdp all_gather: need one output per input");
  if (staged_through_host(group, inputs, outputs)) {
    std::vector<torch::Tensor> host_in, host_out;
    for (size_t i = 0; i < inputs.size(); ++i) {
      host_in.push_back(inputs[i].cpu());
      host_out.push_back(host_buffer(outputs[i]));
    }
    auto work = all_gather(group, host_in, host_out, bucket_bytes, context);
    work->then([outputs, host_out]() {
      for (size_t i = 0; i < outputs.size(); ++i)
        outputs[i].copy_(host_out[i]);
    });
    return work;
  }
  trace::Span span(kAllGatherNames.issue_kind, kAllGatherNames.issue, trace_subject(context));
  const int n = group.size();
  int64_t in_bytes = 0;
  std::vector<torch::Tensor> in_bytes_views, out_bytes_views;
  for (size_t i = 0; i < inputs.size(); ++i) {
    auto in = as_bytes(inputs[i]);
    auto out = as_bytes(outputs[i]);
    TORCH_CHECK(out.numel() == in.numel() * n, "fsdp all_gather: output ", i, " holds ",
                out.numel(), " bytes, expected ", in.numel() * n);
    in_bytes += in.numel();
    in_bytes_views.push_back(std::move(in));
    out_bytes_views.push_back(std::move(out));
  }
  const std::string what =
      describe("all-gather", in_bytes * n, local(group) ? "(local copy)" : "", context);
  check_sequence(group, what);
  const RecordTicket ticket = record(group, "all-gather", in_bytes * n,
                                     c10::toString(inputs[0].scalar_type()), what, context);
  auto& counter = counter_of(group, &CommStats::all_gather);
  counter.calls += 1;
  counter.bytes += in_bytes * n;
  span.set_bytes(in_bytes * n);
  if (local(group)) {
    // This rank's piece in every rank's slot: the output is filled, every byte written once.
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < in_bytes_views.size(); ++i) {
      const int64_t b = in_bytes_views[i].numel();
      out_bytes_views[i].view({n, b}).copy_(in_bytes_views[i].unsqueeze(0).expand({n, b}));
    }
    return labelled(done_locally(group, counter, what, ticket), kAllGatherNames, context);
  }
  counter.sent_bytes += in_bytes * (n - 1);

  if (is_gloo(group)) {
    // Gloo unflattens its own receive buffer straight into these views, so each parameter's
    // unsharded storage is written exactly once. Buckets are byte ranges of this rank's
    // pieces: piece i's bytes [a, a + len) land at [r * b_i + a, ...) of output i for rank r,
    // contiguous on both sides, so a bucket may end in the middle of a parameter.
    const int64_t per_bucket = bucket_bytes > 0 ? std::max<int64_t>(1, bucket_bytes / n) : in_bytes;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::vector<torch::Tensor> bucket_in;
    std::vector<std::vector<torch::Tensor>> bucket_out(n);
    int64_t filled = 0;
    auto flush = [&] {
      if (bucket_in.empty())
        return;
      // Buckets take the lanes in turn, so consecutive buckets move at the same time.
      const int64_t issued = trace::enabled() ? trace::now_ns() : 0;
      int64_t bucket_bytes_out = 0;
      for (const auto& t : bucket_in)
        bucket_bytes_out += t.numel() * n;
      auto& lane = detail::GroupAccess::next_lane(group);
      works.push_back(lane.allgather_coalesced(bucket_out, bucket_in));
      trace_transfer(group, lane, works.back(), kAllGatherNames, context, bucket_bytes_out, issued);
      bucket_in.clear();
      for (auto& l : bucket_out)
        l.clear();
      filled = 0;
    };
    for (size_t i = 0; i < in_bytes_views.size(); ++i) {
      const int64_t b = in_bytes_views[i].numel();
      for (int64_t a = 0; a < b;) {
        const int64_t len = std::min(b - a, per_bucket - filled);
        bucket_in.push_back(in_bytes_views[i].narrow(0, a, len));
        for (int r = 0; r < n; ++r)
          bucket_out[r].push_back(out_bytes_views[i].narrow(0, r * b + a, len));
        a += len;
        filled += len;
        if (filled == per_bucket)
          flush();
      }
    }
    flush();
    return labelled(
        std::make_unique<CollectiveWork>(group, counter, what, std::move(works), nullptr, ticket),
        kAllGatherNames, context);
  }
  // Backends with a native flat all-gather (NCCL): gather into one buffer, then copy out. The
  // copy is enqueued by the waiting thread on the current stream, after the collective.
  auto flat_in = torch::cat(in_bytes_views);
  auto flat_out = torch::empty({in_bytes * n}, flat_in.options());
  const int64_t issued = trace::enabled() ? trace::now_ns() : 0;
  auto& lane = detail::GroupAccess::next_lane(group);
  auto work = detail::all_gather_single(lane, flat_out, flat_in);
  trace_transfer(group, lane, work, kAllGatherNames, context, in_bytes * n, issued);
  auto finish = [flat_out, out_bytes_views, in_bytes, n]() {
    auto rows = flat_out.view({n, in_bytes});
    int64_t offset = 0;
    for (const auto& out : out_bytes_views) {
      const int64_t b = out.numel() / n;
      out.view({n, b}).copy_(rows.narrow(1, offset, b));
      offset += b;
    }
  };
  return labelled(std::make_unique<CollectiveWork>(group, counter, what, std::move(work),
                                                   std::move(finish), ticket),
                  kAllGatherNames, context);
}

std::unique_ptr<CollectiveWork> reduce_scatter(ProcessGroup& group, const torch::Tensor& input,
                                               const torch::Tensor& output, ReduceOp op,
                                               const std::string& context) {
  check_contiguous(input, "reduce-scatter input");
  check_contiguous(output, "reduce-scatter output");
  if (staged_through_host(group, {input, output})) {
    auto host_out = host_buffer(output);
    auto work = reduce_scatter(group, input.cpu(), host_out, op, context);
    work->then([output, host_out]() { output.copy_(host_out); });
    return work;
  }
  trace::Span span(kReduceScatterNames.issue_kind, kReduceScatterNames.issue,
                   trace_subject(context), input.numel() * input.element_size());
  const int n = group.size();
  const int64_t s = output.numel();
  TORCH_CHECK(input.numel() == s * n, "fsdp reduce_scatter: input has ", input.numel(),
              " elements, expected ", s * n);
  const std::string what =
      describe("reduce-scatter", input.numel() * input.element_size(),
               std::string(op_name(op)) + " " + c10::toString(input.scalar_type()) +
                   (local(group) ? " (local copy)" : ""),
               context);
  TORCH_CHECK(op == ReduceOp::kSum || op == ReduceOp::kAvg,
              "fsdp reduce_scatter: only sum and avg, got ", op_name(op));
  check_sequence(group, what);
  const RecordTicket ticket = record(group, "reduce-scatter", input.numel() * input.element_size(),
                                     c10::toString(input.scalar_type()), what, context);
  auto& counter = counter_of(group, &CommStats::reduce_scatter);
  counter.calls += 1;
  counter.bytes += input.numel() * input.element_size();
  if (local(group)) {
    // The sum (or mean) over one rank: this rank's own block of its input.
    torch::NoGradGuard no_grad;
    output.copy_(input.view({n, s}).select(0, group.rank()));
    return labelled(done_locally(group, counter, what, ticket), kReduceScatterNames, context);
  }
  counter.sent_bytes += s * (n - 1) * input.element_size();

  const int64_t issued = trace::enabled() ? trace::now_ns() : 0;
  c10d::Backend& backend = detail::GroupAccess::next_lane(group);
  if (is_gloo(group)) {
    // Each rank receives the N copies of its own block, then sums them locally in rank order
    // (the same order on every run, so results are reproducible).
    auto received = torch::empty_like(input);
    torch::Tensor in = input;
    auto work = detail::all_to_all_single(backend, received, in);
    trace_transfer(group, backend, work, kReduceScatterNames, context,
                   input.numel() * input.element_size(), issued);
    auto finish = [received, output, n, s, op]() {
      torch::NoGradGuard no_grad;
      auto blocks = received.view({n, s});
      torch::sum_out(const_cast<torch::Tensor&>(output), blocks, /*dim=*/{0});
      if (op == ReduceOp::kAvg)
        output.div_(n);
    };
    return labelled(std::make_unique<CollectiveWork>(group, counter, what, std::move(work),
                                                     std::move(finish), ticket),
                    kReduceScatterNames, context);
  }
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = op == ReduceOp::kAvg ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
  torch::Tensor out = output, in = input;
  auto work = detail::reduce_scatter_single(backend, out, in, opts);
  trace_transfer(group, backend, work, kReduceScatterNames, context,
                 input.numel() * input.element_size(), issued);
  return labelled(
      std::make_unique<CollectiveWork>(group, counter, what, std::move(work), nullptr, ticket),
      kReduceScatterNames, context);
}

std::unique_ptr<CollectiveWork> reduce_scatter_exchange(ProcessGroup& group,
                                                        const torch::Tensor& input,
                                                        const torch::Tensor& output,
                                                        const std::string& context) {
  check_contiguous(input, "reduce-scatter exchange input");
  check_contiguous(output, "reduce-scatter exchange output");
  if (staged_through_host(group, {input, output})) {
    auto host_out = host_buffer(output);
    auto work = reduce_scatter_exchange(group, input.cpu(), host_out, context);
    work->then([output, host_out]() { output.copy_(host_out); });
    return work;
  }
  const int n = group.size();
  TORCH_CHECK(input.numel() == output.numel() && input.scalar_type() == output.scalar_type() &&
                  input.numel() % n == 0,
              "fsdp reduce_scatter_exchange: input and output must have the same dtype and a "
              "size divisible by the group's ",
              n, " ranks, got ", input.numel(), " and ", output.numel());
  const int64_t bytes = input.numel() * input.element_size();
  trace::Span span(kReduceScatterNames.issue_kind, kReduceScatterNames.issue,
                   trace_subject(context), bytes);
  const std::string what = describe("reduce-scatter", bytes,
                                    std::string("encoded ") + c10::toString(input.scalar_type()) +
                                        (local(group) ? " (local copy)" : ""),
                                    context);
  check_sequence(group, what);
  const RecordTicket ticket =
      record(group, "reduce-scatter", bytes, c10::toString(input.scalar_type()), what, context);
  auto& counter = counter_of(group, &CommStats::reduce_scatter);
  counter.calls += 1;
  counter.bytes += bytes;
  if (local(group)) {
    torch::NoGradGuard no_grad;
    output.copy_(input);
    return labelled(done_locally(group, counter, what, ticket), kReduceScatterNames, context);
  }
  counter.sent_bytes += bytes / n * (n - 1);
  const int64_t issued = trace::enabled() ? trace::now_ns() : 0;
  c10d::Backend& backend = detail::GroupAccess::next_lane(group);
  torch::Tensor in = input, out = output;
  auto work = detail::all_to_all_single(backend, out, in);
  trace_transfer(group, backend, work, kReduceScatterNames, context, bytes, issued);
  return labelled(
      std::make_unique<CollectiveWork>(group, counter, what, std::move(work), nullptr, ticket),
      kReduceScatterNames, context);
}

std::unique_ptr<CollectiveWork> all_reduce(ProcessGroup& group, const torch::Tensor& tensor,
                                           ReduceOp op, const std::string& context) {
  check_contiguous(tensor, "all-reduce tensor");
  if (staged_through_host(group, {tensor})) {
    auto host = tensor.cpu();
    auto work = all_reduce(group, host, op, context);
    work->then([tensor, host]() { tensor.copy_(host); });
    return work;
  }
  const int n = group.size();
  auto& counter = counter_of(group, &CommStats::all_reduce);
  const int64_t bytes = tensor.numel() * tensor.element_size();
  trace::Span span(kAllReduceNames.issue_kind, kAllReduceNames.issue, trace_subject(context),
                   bytes);
  const std::string what =
      describe("all-reduce", bytes,
               std::string(op_name(op)) + " " + c10::toString(tensor.scalar_type()) +
                   (local(group) ? " (local copy)" : ""),
               context);
  check_sequence(group, what);
  const RecordTicket ticket =
      record(group, "all-reduce", bytes, c10::toString(tensor.scalar_type()), what, context);
  counter.calls += 1;
  counter.bytes += bytes;
  if (local(group))  // in place, and any op over one rank is the tensor itself
    return labelled(done_locally(group, counter, what, ticket), kAllReduceNames, context);
  counter.sent_bytes += 2 * bytes * (n - 1) / n;
  std::vector<torch::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  const bool native_avg = !is_gloo(group);
  opts.reduceOp = op == ReduceOp::kMax                 ? c10d::ReduceOp::MAX
                  : op == ReduceOp::kMin               ? c10d::ReduceOp::MIN
                  : op == ReduceOp::kAvg && native_avg ? c10d::ReduceOp::AVG
                                                       : c10d::ReduceOp::SUM;
  const int64_t issued = trace::enabled() ? trace::now_ns() : 0;
  auto& lane = detail::GroupAccess::next_lane(group);
  auto work = lane.allreduce(tensors, opts);
  trace_transfer(group, lane, work, kAllReduceNames, context, bytes, issued);
  std::function<void()> finish;
  if (op == ReduceOp::kAvg && !native_avg) {
    finish = [tensor, n]() {
      torch::NoGradGuard no_grad;
      tensor.div_(n);
    };
  }
  return labelled(std::make_unique<CollectiveWork>(group, counter, what, std::move(work),
                                                   std::move(finish), ticket),
                  kAllReduceNames, context);
}

std::unique_ptr<CollectiveWork> broadcast(ProcessGroup& group, const torch::Tensor& tensor,
                                          int root, const std::string& context) {
  check_contiguous(tensor, "broadcast tensor");
  if (staged_through_host(group, {tensor})) {
    auto host = tensor.cpu();
    auto work = broadcast(group, host, root, context);
    work->then([tensor, host]() { tensor.copy_(host); });
    return work;
  }
  auto& counter = counter_of(group, &CommStats::broadcast);
  const int64_t bytes = tensor.numel() * tensor.element_size();
  trace::Span span(kBroadcastNames.issue_kind, kBroadcastNames.issue, trace_subject(context),
                   bytes);
  const std::string what = describe(
      "broadcast", bytes,
      "from group rank " + std::to_string(root) + (local(group) ? " (local copy)" : ""), context);
  check_sequence(group, what);
  const RecordTicket ticket =
      record(group, "broadcast", bytes, c10::toString(tensor.scalar_type()), what, context);
  counter.calls += 1;
  counter.bytes += bytes;
  if (local(group))  // every rank keeps its own values
    return labelled(done_locally(group, counter, what, ticket), kBroadcastNames, context);
  counter.sent_bytes += group.rank() == root ? bytes : 0;
  std::vector<torch::Tensor> tensors{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  const int64_t issued = trace::enabled() ? trace::now_ns() : 0;
  auto& lane = detail::GroupAccess::next_lane(group);
  auto work = lane.broadcast(tensors, opts);
  trace_transfer(group, lane, work, kBroadcastNames, context, bytes, issued);
  return labelled(
      std::make_unique<CollectiveWork>(group, counter, what, std::move(work), nullptr, ticket),
      kBroadcastNames, context);
}

std::unique_ptr<CollectiveWork> send(ProcessGroup& group, const torch::Tensor& tensor, int dst,
                                     int tag, const std::string& context) {
  check_contiguous(tensor, "send tensor");
  if (staged_through_host(group, {tensor}))
    return send(group, tensor.cpu(), dst, tag, context);  // the work keeps the host copy
  refuse_locally(group, "send");
  TORCH_CHECK(dst >= 0 && dst < group.size() && dst != group.rank(), "fsdp send: bad peer ", dst,
              " from group rank ", group.rank(), " of ", group.size());
  auto& counter = counter_of(group, &CommStats::point_to_point);
  const int64_t bytes = tensor.numel() * tensor.element_size();
  counter.calls += 1;
  counter.bytes += bytes;
  counter.sent_bytes += bytes;
  std::vector<torch::Tensor> tensors{tensor};
  auto work = detail::GroupAccess::first_lane(group).send(tensors, dst, tag);
  std::string what = describe("send", bytes, "to group rank " + std::to_string(dst), context);
  RecordTicket ticket = record(group, "send", bytes, c10::toString(tensor.scalar_type()), what,
                               context, /*in_sequence=*/false);
  return labelled(std::make_unique<CollectiveWork>(group, counter, std::move(what), std::move(work),
                                                   nullptr, std::move(ticket)),
                  kPointToPointNames, context);
}

std::unique_ptr<CollectiveWork> recv(ProcessGroup& group, const torch::Tensor& tensor, int src,
                                     int tag, const std::string& context) {
  check_contiguous(tensor, "recv tensor");
  if (staged_through_host(group, {tensor})) {
    auto host = host_buffer(tensor);
    auto work = recv(group, host, src, tag, context);
    work->then([tensor, host]() { tensor.copy_(host); });
    return work;
  }
  refuse_locally(group, "recv");
  TORCH_CHECK(src >= 0 && src < group.size() && src != group.rank(), "fsdp recv: bad peer ", src,
              " at group rank ", group.rank(), " of ", group.size());
  auto& counter = counter_of(group, &CommStats::point_to_point);
  const int64_t bytes = tensor.numel() * tensor.element_size();
  counter.calls += 1;
  counter.bytes += bytes;
  std::vector<torch::Tensor> tensors{tensor};
  auto work = detail::GroupAccess::first_lane(group).recv(tensors, src, tag);
  std::string what = describe("recv", bytes, "from group rank " + std::to_string(src), context);
  RecordTicket ticket = record(group, "recv", bytes, c10::toString(tensor.scalar_type()), what,
                               context, /*in_sequence=*/false);
  return labelled(std::make_unique<CollectiveWork>(group, counter, std::move(what), std::move(work),
                                                   nullptr, std::move(ticket)),
                  kPointToPointNames, context);
}

std::unique_ptr<CollectiveWork> barrier(ProcessGroup& group, const std::string& context) {
  const std::string what = context.empty() ? "barrier" : "barrier for " + context;
  check_sequence(group, what);
  const RecordTicket ticket = record(group, "barrier", 0, "", what, context);
  auto& counter = counter_of(group, &CommStats::barrier);
  counter.calls += 1;
  auto work = detail::GroupAccess::first_lane(group).barrier();
  return labelled(
      std::make_unique<CollectiveWork>(group, counter, what, std::move(work), nullptr, ticket),
      kBarrierNames, context);
}

std::vector<std::string> all_gather_bytes(ProcessGroup& group, const std::string& mine,
                                          const std::string& context) {
  const int n = group.size();
  const auto options = torch::TensorOptions().device(group.device_type());
  auto length = torch::tensor({static_cast<int64_t>(mine.size())}, torch::kLong).to(options);
  auto lengths = torch::empty({n}, length.options());
  all_gather(group, {length}, {lengths}, 0, context)->wait();
  const auto sizes = lengths.cpu();
  int64_t longest = 0;
  for (int r = 0; r < n; ++r)
    longest = std::max(longest, sizes[r].item<int64_t>());
  auto padded = torch::zeros({std::max<int64_t>(longest, 1)}, torch::kUInt8);
  std::memcpy(padded.data_ptr(), mine.data(), mine.size());
  padded = padded.to(options);
  auto all = torch::empty({n * padded.numel()}, padded.options());
  all_gather(group, {padded}, {all}, 0, context)->wait();
  const auto host = all.cpu();
  const auto* base = static_cast<const char*>(host.data_ptr());
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r)
    out.emplace_back(base + r * padded.numel(), static_cast<size_t>(sizes[r].item<int64_t>()));
  return out;
}

}  // namespace fsdp
