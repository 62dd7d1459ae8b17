// See include/fsdp/plan/step_memory.h. The engine's own step buffers come and go at the events of
// fsdp/detail/buffer_lifetimes.h, the table the engine frees them by: this file says when each
// event happens (the schedule: prefetch.cpp's rate limiter, the order of forward and backward),
// and adds what is not the engine's (autograd's gradients and activations, Gloo's staging).
// tests/test_plan.cpp compares the prediction with a measured step.
#include <fsdp/plan/step_memory.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <deque>
#include <functional>
#include <set>
#include <span>

#include <fsdp/detail/buffer_lifetimes.h>

#include "unit_bytes.h"

namespace fsdp::plan {
namespace {

namespace mem = fsdp::memory;
using fsdp::detail::Lifetime;
using fsdp::detail::UnitEvent;
using mem::Category;

using detail::Geometry;
using detail::unit_bytes;
using detail::UnitBytes;

// The byte counters and the highest total seen, with its moment.
class Ledger {
 public:
  explicit Ledger(MemoryPrediction& out) : out_(out) {}

  void add(Category c, int64_t bytes, const Moment& at) {
    cur_.bytes[static_cast<int>(c)] += bytes;
    observe(at);
  }
  // A high-water mark that is gone again when the event ends (a kernel's temporaries).
  void spike(Category c, int64_t bytes, const Moment& at) {
    add(c, bytes, at);
    cur_.bytes[static_cast<int>(c)] -= bytes;
  }
  int64_t current(Category c) const { return cur_[c]; }
  // The engine at `event` (fsdp/detail/buffer_lifetimes.h): the buffers of `table` freed there
  // go, then those allocated there come.
  void apply(std::span<const Lifetime> table, UnitEvent event, const UnitBytes& unit,
             bool holds_block, const Moment& at) {
    for (const auto& l : table) {
      if (l.freed == event)
        add_nonzero(l.category, -detail::buffer_bytes(unit, l.buffer, holds_block), at);
    }
    for (const auto& l : table) {
      if (l.allocated == event)
        add_nonzero(l.category, detail::buffer_bytes(unit, l.buffer, holds_block), at);
    }
  }

 private:
  void add_nonzero(Category c, int64_t bytes, const Moment& at) {
    if (bytes != 0)
      add(c, bytes, at);
  }
  void observe(const Moment& at) {
    out_.timeline.emplace_back(at, cur_);
    for (int c = 0; c < mem::kNumCategories; ++c)
      out_.category_peaks.bytes[c] = std::max(out_.category_peaks.bytes[c], cur_.bytes[c]);
    const int64_t total = cur_.total();
    if (total > out_.peak) {
      out_.peak = total;
      out_.at_peak = cur_;
      out_.moment = at;
    }
  }

  MemoryPrediction& out_;
  mem::CategoryBytes cur_;
};

enum class Gather { kSharded, kGathering, kGathered };

// The units' gathered state, the rate limiter's slots and its queue (prefetch.cpp).
class Schedule {
 public:
  Schedule(const std::vector<UnitBytes>& bytes, int limit, Ledger& ledger)
      : bytes_(bytes),
        state_(bytes.size(), Gather::kSharded),
        block_(bytes.size(), false),
        counted_(bytes.size(), false),
        limit_(std::max(1, limit)),
        ledger_(ledger) {}

  bool sharded(size_t u) const { return state_[u] == Gather::kSharded; }

  // issue_unshard: the unsharded buffers and the copies in flight; Gloo's staging.
  void issue(size_t u, bool counted, const Moment& at) {
    if (state_[u] != Gather::kSharded)
      return;
    state_[u] = Gather::kGathering;
    apply(u, UnitEvent::kGatherIssued, at);
    ledger_.add(Category::kOther, staging(u), at);
    if (counted) {
      ++in_use_;
      counted_[u] = true;
    }
  }
  // wait_unshard: Gloo's staging goes, then what the engine frees once the gather landed.
  void wait(size_t u, const Moment& at) {
    if (state_[u] != Gather::kGathering)
      return;
    ledger_.add(Category::kOther, -staging(u), at);
    apply(u, UnitEvent::kGatherDone, at);
    block_[u] = false;
    state_[u] = Gather::kGathered;
  }
  void unshard(size_t u, bool counted, const Moment& at) {
    queue_.erase(std::remove(queue_.begin(), queue_.end(), u), queue_.end());  // claim
    issue(u, counted, at);
    wait(u, at);
  }
  void request(size_t u, const Moment& at) {
    if (state_[u] != Gather::kSharded || std::find(queue_.begin(), queue_.end(), u) != queue_.end())
      return;
    if (in_use_ < limit_)
      issue(u, true, at);
    else
      queue_.push_back(u);
  }
  // reshard (optionally keeping a block of it, post_forward with reshard_after_forward_size).
  void reshard(size_t u, bool keep_block, const Moment& at) {
    if (state_[u] == Gather::kSharded)
      return;
    wait(u, at);
    if (keep_block) {
      block_[u] = true;
      apply(u, UnitEvent::kBlockKept, at);
    }
    apply(u, UnitEvent::kResharded, at);
    state_[u] = Gather::kSharded;
    release(u, at);
  }
  // A unit held from forward to backward gives its slot back without resharding.
  void release(size_t u, const Moment& at) {
    if (!counted_[u])
      return;
    counted_[u] = false;
    --in_use_;
    while (!queue_.empty() && in_use_ < limit_) {
      const size_t next = queue_.front();
      queue_.pop_front();
      issue(next, true, at);
    }
  }
  void drop_queue() { queue_.clear(); }

 private:
  void apply(size_t u, UnitEvent event, const Moment& at) {
    ledger_.apply(fsdp::detail::gather_lifetimes(), event, bytes_[u], block_[u], at);
  }
  // Gloo's flat buffers for one call of the gather (from the kept block: of the block's).
  int64_t staging(size_t u) const {
    return block_[u] ? bytes_[u].block_staging : bytes_[u].staging;
  }

  const std::vector<UnitBytes>& bytes_;
  std::vector<Gather> state_;
  std::vector<bool> block_;
  std::vector<bool> counted_;  // holds a rate-limiter slot
  std::deque<size_t> queue_;
  int in_use_ = 0;
  int limit_;
  Ledger& ledger_;
};

}  // namespace

std::string moment_label(const Moment& m) {
  if (m.phase == StepPhase::kOptimizer)
    return "optimizer";
  return std::string(to_string(m.phase)) + " " + (m.unit.empty() ? "(root)" : m.unit);
}

int64_t MemoryPrediction::highest_at(const std::string& label) const {
  int64_t best = -1;
  for (const auto& [m, bytes] : timeline) {
    if (moment_label(m) == label)
      best = std::max(best, bytes.total());
  }
  return best;
}

MemoryPrediction device_side(const MemoryPrediction& p) {
  MemoryPrediction out = p;
  out.peak = out.peak_without_staging = 0;
  out.at_peak = {};
  out.category_peaks = {};
  for (auto& [m, bytes] : out.timeline) {
    for (auto c : {Category::kParams, Category::kGrads, Category::kOptimizer})
      bytes.bytes[static_cast<int>(c)] = 0;
    for (int c = 0; c < mem::kNumCategories; ++c)
      out.category_peaks.bytes[c] = std::max(out.category_peaks.bytes[c], bytes.bytes[c]);
    if (bytes.total() > out.peak) {
      out.peak = bytes.total();
      out.at_peak = bytes;
      out.moment = m;
    }
  }
  out.peak_without_staging = out.peak;
  return out;
}

memory::Category MemoryPrediction::largest_category() const {
  int best = 0;
  for (int c = 1; c < mem::kNumCategories; ++c) {
    if (at_peak.bytes[c] > at_peak.bytes[best])
      best = c;
  }
  return static_cast<memory::Category>(best);
}

const char* to_string(StepPhase phase) {
  switch (phase) {
    case StepPhase::kForward:
      return "forward";
    case StepPhase::kBackward:
      return "backward";
    case StepPhase::kOptimizer:
      return "optimizer";
  }
  return "?";
}

MemoryPrediction predict_step_memory(const std::vector<UnitInfo>& units, const StepOptions& o,
                                     const ActivationModel& activations, int rank) {
  TORCH_CHECK(!units.empty() && units.back().path.empty(),
              "fsdp::plan: the units must be the blocks, then the root (\"\")");
  TORCH_CHECK(o.batch_rows >= 1 && o.seq_len >= 1 && o.micro_batches >= 1,
              "fsdp::plan: micro-batch ", o.batch_rows, " x ", o.seq_len, ", ", o.micro_batches,
              " micro-batches");
  const auto& s = o.states;
  MemoryPrediction out;
  out.states = model_states(units, s, rank);  // also checks the world and hybrid size
  const auto layout = detail::layout_of(o, rank);
  const Geometry& g = layout.geometry;
  const bool blocks_reshard = layout.blocks_reshard;
  const std::optional<int> block_k = layout.block_k;

  const size_t n_blocks = units.size() - 1, root = n_blocks;
  const std::set<std::string> post_params(activations.post_parameters.begin(),
                                          activations.post_parameters.end());
  const std::set<std::string> pre_params(activations.pre_parameters.begin(),
                                         activations.pre_parameters.end());
  std::vector<UnitBytes> bytes;
  for (size_t u = 0; u < units.size(); ++u) {
    bytes.push_back(unit_bytes(units[u], o, g, u == root ? std::nullopt : block_k,
                               u == root ? post_params : std::set<std::string>{},
                               u == root ? pre_params : std::set<std::string>{}));
  }

  Ledger ledger(out);
  const Moment start{StepPhase::kForward, "", "start", 0};
  ledger.add(Category::kParams, out.states.params, start);
  ledger.add(Category::kOptimizer, out.states.optimizer, start);
  ledger.add(Category::kOther, o.other_bytes, start);
  {
    int64_t residuals = 0;  // error feedback's, from the previous step
    for (const auto& b : bytes)
      residuals += b.residual;
    ledger.add(Category::kGrads, residuals, start);
  }

  const auto mode = [&](size_t u) {
    return u < o.checkpoint.size() ? o.checkpoint[u] : CheckpointMode::kNone;
  };
  const auto& act = activations;
  const PieceBytes pre = act.pre.at(o.batch_rows, o.seq_len);
  const PieceBytes post = act.post.at(o.batch_rows, o.seq_len);
  std::array<PieceBytes, 3> block_acts;
  for (size_t m = 0; m < 3; ++m)
    block_acts[m] = act.block[m].at(o.batch_rows, o.seq_len);
  const auto& A = Category::kActivations;
  const auto& G = Category::kGrads;

  // The gradients the engine holds across micro-batches: reduced shards (stash) and, without
  // sync, the kept unsharded ones.
  std::vector<bool> stash(units.size(), false), kept(units.size(), false);
  for (int mb = 0; mb < o.micro_batches; ++mb) {
    const bool sync = o.sync_every_micro_batch || mb == o.micro_batches - 1;
    auto at = [&](StepPhase phase, size_t u, const char* what) {
      return Moment{phase, units[u].path, what, mb};
    };
    Schedule sched(bytes, o.max_inflight_all_gathers, ledger);
    // ---- Forward (pre_forward, post_forward) ----
    {
      const auto m = at(StepPhase::kForward, root, "gather");
      sched.unshard(root, /*counted=*/false, m);
      if (o.forward_prefetch && n_blocks > 0)
        sched.request(0, m);
      const auto c = at(StepPhase::kForward, root, "compute");
      ledger.spike(A, pre.forward_peak, c);
      ledger.add(A, pre.saved, c);
    }
    for (size_t i = 0; i < n_blocks; ++i) {
      const auto m = at(StepPhase::kForward, i, "gather");
      sched.unshard(i, /*counted=*/true, m);
      if (o.forward_prefetch && i + 1 < n_blocks)
        sched.request(i + 1, m);
      const auto& a = block_acts[static_cast<size_t>(mode(i))];
      const auto c = at(StepPhase::kForward, i, "compute");
      ledger.spike(A, a.forward_peak, c);
      ledger.add(A, a.saved, c);
      if (blocks_reshard)
        sched.reshard(i, /*keep_block=*/block_k.has_value(), c);
      else
        sched.release(i, c);  // held for backward: the slot goes back
    }
    {
      const auto c = at(StepPhase::kForward, root, "compute");
      ledger.spike(A, post.forward_peak, c);
      ledger.add(A, post.saved, c);
      sched.drop_queue();  // end_forward
    }
    // ---- Backward (pre_backward, reduce_gradients, end_backward_pass) ----
    size_t pending_reduce = units.size();  // the unit whose reduce-scatter input is alive
    // The optimizer inside backward (last micro-batch): the units reduced so far, in order,
    // and which of them have had their post-reduce hook.
    const bool hooks = o.optimizer_in_backward && mb == o.micro_batches - 1;
    const size_t hook_lag =
        s.strategy == ShardingStrategy::kHybridShard && g.n > 1 && g.n < s.world_size ? 2 : 1;
    std::vector<size_t> reduced;
    std::vector<bool> hooked(units.size(), false);
    // The engine at a reduction's event (fsdp/detail/buffer_lifetimes.h).
    auto reduce_event = [&](size_t u, UnitEvent event, const Moment& m) {
      ledger.apply(fsdp::detail::reduce_lifetimes(bytes[u].reduce_kind), event, bytes[u], false, m);
    };
    // A hook: install_grads (the reduced output becomes the grads, or is added into the stash),
    // then the step, then the grads are dropped.
    auto run_hook = [&](size_t u, const Moment& m) {
      const auto& b = bytes[u];
      reduce_event(u, UnitEvent::kInstalled, m);
      if (!stash[u])
        ledger.add(G, b.final_grads, m);
      ledger.add(G, -b.final_grads, m);
      stash[u] = false;
      hooked[u] = true;
    };
    auto finish_pending = [&](const Moment& m) {
      if (pending_reduce >= units.size())
        return;
      // finish_reduce_scatter: int8 sums the N decoded pieces, then the buffers go (and Gloo's).
      const auto& pb = bytes[pending_reduce];
      ledger.spike(G, pb.decode_scratch, m);
      reduce_event(pending_reduce, UnitEvent::kScattered, m);
      ledger.add(G, -detail::backend_received_bytes(pb), m);
      pending_reduce = units.size();
    };
    auto reduce = [&](size_t u, const Moment& m) {
      const auto& b = bytes[u];
      if (!b.trainable) {
        sched.reshard(u, false, m);
        return;
      }
      if (!sync) {
        // hold_pass_grad: the unsharded grads become the kept ones (cast to the master dtype).
        ledger.add(G, b.kept_grads - b.unsharded_grads, m);
        kept[u] = true;
        sched.reshard(u, false, m);
        return;
      }
      // finish_reduce_scatters: the previous unit's collective is done.
      finish_pending(m);
      // The rows, copied into grad by grad, then the grads go (int8: the rows are encoded into
      // the wire once the parameters are resharded).
      reduce_event(u, UnitEvent::kReduceFilled, m);
      ledger.add(G, -b.unsharded_grads, m);
      if (kept[u]) {
        ledger.add(G, -b.kept_grads, m);  // commit_pass drops them at the end of the pass
        kept[u] = false;
      }
      sched.reshard(u, false, m);
      reduce_event(u, UnitEvent::kReduceIssued, m);
      ledger.add(G, detail::backend_received_bytes(b), m);
      if (b.reduce_kind != fsdp::detail::ReduceKind::kLocal)  // else nothing is in flight
        pending_reduce = u;
      if (hooks) {
        // run_post_reduce_hooks: the units whose reductions are complete by now.
        reduced.push_back(u);
        for (size_t k = 0; k + hook_lag < reduced.size(); ++k) {
          if (!hooked[reduced[k]])
            run_hook(reduced[k], m);
        }
      }
    };
    // A piece's backward, segment by segment (PieceBytes::backward): the gradients made so far
    // and the activations' high-water mark; after it, all its gradients and what it freed. A
    // checkpointed block keeps its input (the previous piece's output) until the backward pass
    // ends: the checkpoint node holds it for a recomputation (activation_checkpoint.cpp).
    int64_t held_inputs = 0;
    auto piece_backward = [&](const PieceBytes& p, int64_t grads, bool output_held, const Moment& m,
                              const std::function<void()>& at_output) {
      int64_t made = 0;
      bool reached = !at_output;
      for (size_t k = 0; k < p.backward.size(); ++k) {
        if (!reached && static_cast<int64_t>(k) >= p.segments_before_output) {
          at_output();
          reached = true;
        }
        const auto& seg = p.backward[k];
        const int64_t g = std::min(seg.grads, grads);
        ledger.add(G, g - made, m);
        made = g;
        ledger.spike(A, seg.activations, m);
      }
      if (!reached)
        at_output();
      ledger.add(G, grads - made, m);
      const int64_t held = output_held ? std::min(p.output, p.backward_release) : 0;
      held_inputs += held;
      ledger.add(A, -(p.backward_release - held), m);
    };
    const auto checkpointed = [&](size_t i) {
      return i < n_blocks && mode(i) != CheckpointMode::kNone;
    };
    {
      const auto m = at(StepPhase::kBackward, root, "compute");
      // The loss's backward, then the root's backward hook (its prefetch), then the head's
      // backward, whose parameters get their gradients here (the root's others at the end).
      piece_backward(post, bytes[root].unsharded_grads_post, false, m, [&] {
        if (o.backward_prefetch == BackwardPrefetch::kBackwardPre && n_blocks > 0)
          sched.request(n_blocks - 1, m);
      });
      // A tied head's gradient waits in autograd's buffers for the embedding's part.
      ledger.add(G, -bytes[root].unsharded_grads_tied, m);
      ledger.add(A, bytes[root].unsharded_grads_tied, m);
    }
    for (size_t i = n_blocks; i-- > 0;) {
      const auto m = at(StepPhase::kBackward, i, "gather");
      sched.unshard(i, /*counted=*/blocks_reshard, m);
      if (o.backward_prefetch == BackwardPrefetch::kBackwardPre && i > 0)
        sched.request(i - 1, m);
      const auto& a = block_acts[static_cast<size_t>(mode(i))];
      const auto c =
          at(StepPhase::kBackward, i, mode(i) == CheckpointMode::kNone ? "compute" : "recompute");
      piece_backward(a, bytes[i].unsharded_grads, checkpointed(i + 1), c, nullptr);
      const auto r = at(StepPhase::kBackward, i, "reduce");
      reduce(i, r);
      if (o.backward_prefetch == BackwardPrefetch::kBackwardPost && i > 0)
        sched.request(i - 1, r);
    }
    {
      const auto c = at(StepPhase::kBackward, root, "compute");
      piece_backward(pre, bytes[root].unsharded_grads - bytes[root].unsharded_grads_post,
                     checkpointed(0), c, nullptr);
      ledger.add(A, -bytes[root].unsharded_grads_tied, c);
      ledger.add(G, bytes[root].unsharded_grads_tied, c);
      reduce(root, at(StepPhase::kBackward, root, "reduce"));
    }
    // end_backward_pass: the last reduce-scatter input goes, the outputs become the grads.
    const auto e = at(StepPhase::kBackward, root, "end");
    ledger.add(A, -held_inputs, e);
    finish_pending(e);
    if (sync) {
      for (size_t u = 0; u < units.size(); ++u) {
        const auto& b = bytes[u];
        if (!b.trainable || hooked[u])
          continue;
        if (hooks) {  // the hooks not run during the pass run now
          run_hook(u, e);
          continue;
        }
        // install_grads: added into the stash (or becoming it), then the reduction goes.
        if (!stash[u])
          ledger.add(G, b.final_grads, e);
        reduce_event(u, UnitEvent::kInstalled, e);
        stash[u] = true;
      }
    }
    // Whatever the activations model leaves (rounding) is not carried into the next micro-batch.
    ledger.add(A, -ledger.current(A), e);
  }
  out.peak_without_staging = out.peak;
  if (o.gloo_staging) {
    StepOptions without = o;
    without.gloo_staging = false;
    out.peak_without_staging = predict_step_memory(units, without, activations, rank).peak;
  }
  return out;
}

}  // namespace fsdp::plan
