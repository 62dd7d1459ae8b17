// See root_state.h: one model's units, forward nesting, backward passes and their rollback.
#include "root_state.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>

#include "param_group.h"
#include "registry.h"

namespace fsdp::detail {
namespace {

// The multi-root warning is given once per process: it is about how the program shards its
// models, not about one step.
std::atomic<bool> g_warned_other_roots{false};

bool inside_backward() {
  return torch::autograd::get_current_graph_task_id() != -1;
}

}  // namespace

// Carried by the end-of-backward callback of one pass. The engine runs the callback when the
// pass succeeds; when a node throws, the engine drops its callbacks unrun, and this destructor
// runs instead, before the exception reaches the caller of backward() (on CPU, the thread that
// called it).
struct RootState::PassToken {
  PassToken(std::weak_ptr<RootState> s, uint64_t p) : state(std::move(s)), pass(p) {}
  PassToken(const PassToken&) = delete;
  PassToken& operator=(const PassToken&) = delete;
  ~PassToken() {
    if (!ran) {
      if (auto s = state.lock())
        s->abort_backward_pass(pass);
    }
  }
  void run() {
    ran = true;
    if (auto s = state.lock())
      s->end_backward_pass(pass);
  }

  std::weak_ptr<RootState> state;
  uint64_t pass;
  bool ran = false;
};

void RootState::add(const std::shared_ptr<ParamGroup>& unit) {
  units_.push_back(unit);
}

void RootState::adopt(RootState& inner) {
  for (auto& unit : inner.units()) {
    unit->set_state(shared_from_this());
    units_.push_back(unit);
  }
  inner.units_.clear();
}

std::vector<std::shared_ptr<ParamGroup>> RootState::units() const {
  std::vector<std::shared_ptr<ParamGroup>> out;
  out.reserve(units_.size());
  for (const auto& w : units_) {
    if (auto unit = w.lock())
      out.push_back(std::move(unit));
  }
  return out;
}

std::shared_ptr<ParamGroup> RootState::root_unit() const {
  for (auto it = units_.rbegin(); it != units_.rend(); ++it) {
    if (auto unit = it->lock())
      return unit;
  }
  return nullptr;
}

bool RootState::expects_backward() const {
  for (const auto& w : units_) {
    auto unit = w.lock();
    if (unit && unit->expects_backward())
      return true;
  }
  return false;
}

// ---- Forward ----------------------------------------------------------------------------------

bool RootState::enter_forward(ParamGroup& unit) {
  const bool root_call = forward_depth_ == 0;
  ++forward_depth_;
  if (root_call) {
    // A forward inside a backward pass (a recomputation) is part of that pass, not a new
    // iteration.
    iteration_open_ = !inside_backward();
    if (iteration_open_) {
      try {
        begin_iteration(unit);
      } catch (...) {
        --forward_depth_;
        iteration_open_ = false;
        throw;
      }
    }
  }
  return root_call;
}

void RootState::begin_iteration(ParamGroup& root_call) {
  ++epoch_;
  auto units = this->units();
  // Calls whose graph died without a backward (an evaluation under grad mode, an exception
  // between forward and backward) will never run one: release what they hold.
  for (auto& unit : units)
    unit->forget_calls(std::nullopt);
  if (torch::GradMode::is_enabled() && !g_warned_other_roots) {
    for (const auto& other : live_states()) {
      if (other.get() == this || !other->expects_backward())
        continue;
      auto other_root = other->root_unit();
      g_warned_other_roots = true;
      TORCH_WARN("fsdp: unit '", root_call.name(),
                 "' begins a forward as a root while the root unit '",
                 other_root ? other_root->name() : std::string("?"),
                 "' of another FSDP model still waits for its backward. A root stays gathered "
                 "from its forward until its backward; if these are blocks of one model, call "
                 "fully_shard on the model as well, after its blocks, so that the blocks reshard "
                 "after forward. Separate models trained together (a GAN) may ignore this.");
      break;
    }
  }
  auto root = root_unit();
  prefetcher_.begin_forward(root ? root->options().max_inflight_all_gathers()
                                 : root_call.options().max_inflight_all_gathers());
}

void RootState::exit_forward(bool failed) {
  --forward_depth_;
  if (forward_depth_ > 0 || !iteration_open_)
    return;
  iteration_open_ = false;
  auto units = this->units();
  // Deferred prefetches are dropped first: releasing the units below gives slots back, which
  // must not issue gathers nobody will use.
  prefetcher_.end_forward(!failed);
  if (failed) {
    // The forward threw: its calls will never run a backward.
    for (auto& unit : units)
      unit->forget_calls(epoch_);
  }
  // A unit gathered ahead that this forward never ran (the order changed): free it now.
  for (auto& unit : units)
    unit->release();
  check_slots();
}

void RootState::check_slots() const {
  int counted = 0;
  for (const auto& unit : units())
    counted += unit->unit_state().counted() ? 1 : 0;
  TORCH_INTERNAL_ASSERT(counted == prefetcher_.slots_in_use(), "fsdp: ", counted,
                        " units hold a rate-limiter slot, the limiter counts ",
                        prefetcher_.slots_in_use());
}

// ---- Backward ---------------------------------------------------------------------------------

uint64_t RootState::on_backward_hook() {
  // One pass per graph task; a nested graph task (a reentrant backward inside a node) runs
  // inside the open pass and belongs to it: its callback is the outer task's.
  if (open_pass_ != 0)
    return open_pass_;
  open_pass_ = ++last_pass_;
  prefetcher_.begin_backward();
  auto token = std::make_shared<PassToken>(weak_from_this(), open_pass_);
  torch::autograd::Engine::get_default_engine().queue_callback([token] { token->run(); });
  return open_pass_;
}

void RootState::track_reduce_scatter(ParamGroup& unit) {
  reducing_.push_back(unit.weak_from_this());
}

void RootState::finish_reduce_scatters() {
  for (auto& w : reducing_) {
    if (auto unit = w.lock())
      unit->finish_reduce_scatter();
  }
  reducing_.clear();
}

void RootState::run_post_reduce_hooks(const ParamGroup* current) {
  for (auto& unit : units()) {
    if (unit.get() != current)
      unit->run_post_reduce_hook(/*end_of_pass=*/false, reduce_round_);
  }
  ++reduce_round_;
}

void RootState::end_backward_pass(uint64_t pass) {
  if (open_pass_ != pass)
    return;
  auto units = this->units();
  try {
    // Units whose hooks did not finish (the root, units whose inputs needed no grad, calls
    // this pass did not reach): same order on every rank (creation order), so their
    // collectives match.
    for (auto& unit : units)
      unit->finish_backward();
    for (auto& unit : units)
      unit->wait_reduces();
  } catch (...) {
    abort_backward_pass(pass);
    throw;
  }
  try {
    // The post-reduce hooks not run during the pass (the root, units whose calls could still
    // have reduced): the reductions are complete. Each installs its unit's grads.
    for (auto& unit : units)
      unit->run_post_reduce_hook(/*end_of_pass=*/true, reduce_round_);
  } catch (...) {
    abort_backward_pass(pass);
    throw;
  }
  // From here on only local work: the pass commits.
  for (auto& unit : units)
    unit->install_grads();
  reducing_.clear();
  prefetcher_.end_backward();
  for (auto& unit : units)
    unit->end_backward_pass(pass);
  open_pass_ = 0;
  check_slots();
}

void RootState::abort_backward_pass(uint64_t pass) noexcept {
  if (open_pass_ != pass)
    return;
  std::vector<std::string> errors;
  try {
    // Deferred prefetches first: a unit that reshards below gives its slot back, and a queued
    // gather must not start while the pass is being rolled back (it would stay gathered).
    prefetcher_.end_backward();
    for (auto& unit : units())
      unit->abort_backward_pass(pass, errors);
    reducing_.clear();
  } catch (const std::exception& e) {
    const std::string what = e.what();
    errors.push_back(what.substr(0, what.find('\n')));  // without a c10::Error's stack trace
  }
  open_pass_ = 0;
  if (!errors.empty()) {
    try {
      std::string all;
      for (const auto& e : errors)
        all += (all.empty() ? "" : "; ") + e;
      TORCH_WARN("fsdp: rolling back a failed backward pass also failed: ", all);
    } catch (...) {
      // A warning handler that throws: the original exception is the one to report.
    }
  }
}

}  // namespace fsdp::detail
