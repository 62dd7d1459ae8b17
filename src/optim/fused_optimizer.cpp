// The step driver of the fused optimizers: which parameters step, the state layout, and the
// pieces the kernels run on (see include/fsdp/optim/fused_optimizer.h).
#include <fsdp/optim/fused_optimizer.h>
#include <fsdp/optim/state_layout.h>

#include <fsdp/core/trace.h>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <unordered_map>

#include "optimizer_kernels.h"
#include "optimizer_state_store.h"

namespace fsdp {
namespace {

// Every parameter's state starts on a 64-element boundary (slot_elements, state_layout.h: a cache
// line of fp32, and a whole number of vectors at any width), so no two parameters share a line
// and threads never write the same line.
// Elements per piece of work: small enough for every thread to get several, large enough that
// the per-piece overhead (a virtual call, a few pointer sums) is noise.
constexpr int64_t kPieceElements = 1 << 15;

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

int64_t element_size(torch::Dtype dtype) {
  return dtype == torch::kBFloat16 ? 2 : 4;
}

}  // namespace

FusedOptimizer::FusedOptimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                               std::unique_ptr<torch::optim::OptimizerOptions> defaults,
                               OptimizerStateOptions state_options)
    : torch::optim::Optimizer(std::move(groups), std::move(defaults)),
      state_options_(std::move(state_options)) {
  const auto dtype = state_options_.moments_dtype();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16,
              "fused optimizer: moments_dtype must be float32 or bfloat16, not ",
              c10::toString(dtype));
}

FusedOptimizer::~FusedOptimizer() = default;

std::vector<torch::optim::OptimizerParamGroup> FusedOptimizer::one_group(
    std::vector<torch::Tensor> params) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::move(params));
  return groups;
}

void FusedOptimizer::init_state(std::vector<std::string> state_names) {
  state_names_ = std::move(state_names);
  build_layout();
}

void FusedOptimizer::build_layout() {
  std::vector<Slot> slots;
  std::unordered_map<const void*, size_t> index;
  int64_t offset = 0;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    for (const auto& p : param_groups_[g].params()) {
      TORCH_CHECK(p.device().is_cpu(),
                  "fused optimizer: parameters must be on the CPU (the CUDA path copies shards "
                  "to pinned host memory first); got one on ",
                  p.device());
      TORCH_CHECK(p.scalar_type() == torch::kFloat32,
                  "fused optimizer: parameters must be float32 (the master weights), got ",
                  c10::toString(p.scalar_type()), " of shape ", p.sizes());
      TORCH_CHECK(index.emplace(p.unsafeGetTensorImpl(), slots.size()).second,
                  "fused optimizer: a parameter appears twice in the param groups");
      Slot s;
      s.param = p;
      s.group = g;
      s.numel = p.numel();
      s.offset = offset;
      s.id = static_cast<uint32_t>(slots.size());
      offset += detail::slot_elements(s.numel);
      slots.push_back(std::move(s));
    }
  }
  // Steps already taken survive a rebuild only if nothing had state (see step()).
  slots_ = std::move(slots);
  slot_index_ = std::move(index);
  store_.reset();
  if (state_names_.empty())
    return;
  const int streams = static_cast<int>(state_names_.size());
  const int64_t esize = element_size(state_options_.moments_dtype());
  store_ = state_options_.offload_dir().empty()
               ? detail::make_memory_store(streams, offset, esize)
               : detail::make_file_store(streams, offset, esize, state_options_);
}

size_t FusedOptimizer::slot_of(const torch::Tensor& param) const {
  const auto it = slot_index_.find(param.unsafeGetTensorImpl());
  TORCH_CHECK(it != slot_index_.end(), "fused optimizer: the tensor is not one of its parameters");
  return it->second;
}

uint32_t FusedOptimizer::rounding_key(const Slot& slot) const {
  const uint64_t h = splitmix64(
      state_options_.rounding_seed() ^
      splitmix64((static_cast<uint64_t>(slot.id) << 32) ^ static_cast<uint64_t>(slot.step)));
  return static_cast<uint32_t>(h ^ (h >> 32));
}

torch::Tensor FusedOptimizer::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  // One span for the whole step: the kernels run over flat buffers, not unit by unit.
  trace::Span span("optimizer", "optimizer step");
  ensure_layout();
  step_selected(nullptr);
  return loss;
}

void FusedOptimizer::ensure_layout() {
  // Param groups added since the layout was built: fine until some parameter has state.
  size_t listed = 0;
  for (const auto& g : param_groups_)
    listed += g.params().size();
  if (listed != slots_.size()) {
    for (const auto& s : slots_)
      TORCH_CHECK(s.step == 0,
                  "fused optimizer: param groups changed after the first step (its state "
                  "layout is fixed then); add every group before stepping");
    build_layout();
  }
}

void FusedOptimizer::step_params(const std::vector<torch::Tensor>& params) {
  // Inside backward, the enclosing post-reduce span names the unit (param_group.cpp).
  trace::Span span("optimizer", "optimizer step (some parameters)");
  ensure_layout();
  if (params.empty())
    return;
  std::vector<char> selected(slots_.size(), 0);
  for (const auto& p : params) {
    const auto it = slot_index_.find(p.unsafeGetTensorImpl());
    TORCH_CHECK(it != slot_index_.end(), "fused optimizer: step_params got a parameter of shape ",
                p.sizes(), " that this optimizer does not step");
    selected[it->second] = 1;
  }
  step_selected(&selected);
}

void FusedOptimizer::step_selected(const std::vector<char>* selected) {
  torch::NoGradGuard no_grad;
  const auto t0 = std::chrono::steady_clock::now();
  last_ = OptimizerStepStats{};
  // First every check, then any change: a refused step leaves no parameter's count advanced.
  std::vector<size_t> active;
  std::vector<torch::Tensor> grad_copies(slots_.size());
  std::vector<const float*> grads(slots_.size(), nullptr);
  for (size_t i = 0; i < slots_.size(); ++i) {
    auto& s = slots_[i];
    if (selected && !(*selected)[i])
      continue;
    const auto& grad = s.param.grad();
    if (!grad.defined())
      continue;  // as torch's optimizers: no gradient, no step (and the step count stays)
    TORCH_CHECK(s.param.is_contiguous() && s.param.scalar_type() == torch::kFloat32,
                "fused optimizer: a parameter of shape ", s.param.sizes(),
                " is no longer a contiguous float32 tensor");
    TORCH_CHECK(s.param.numel() == s.numel, "fused optimizer: a parameter changed size");
    TORCH_CHECK(!grad.is_sparse(), "fused optimizer: sparse gradients are not supported");
    TORCH_CHECK(grad.sizes() == s.param.sizes(), "fused optimizer: a gradient of shape ",
                grad.sizes(), " for a parameter of shape ", s.param.sizes());
    check_options(param_groups_[s.group].options());
    if (grad.scalar_type() != torch::kFloat32 || !grad.is_contiguous() || !grad.is_cpu()) {
      grad_copies[i] = grad.to(torch::kCPU, torch::kFloat32).contiguous();
      grads[i] = grad_copies[i].data_ptr<float>();
    } else {
      grads[i] = grad.data_ptr<float>();
    }
    active.push_back(i);
  }
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (size_t i : active) {
    auto& s = slots_[i];
    s.step += 1;
    prepare(s, i, param_groups_[s.group].options());
    ranges.emplace_back(s.offset, s.offset + s.numel);
    last_.elements_updated += s.numel;
  }
  last_.params_updated = static_cast<int64_t>(active.size());

  const int64_t esize = element_size(state_options_.moments_dtype());
  const int streams = static_cast<int>(state_names_.size());
  struct Piece {
    size_t slot;
    int64_t begin, end;  // elements of the parameter
  };
  // Runs the kernels on the active elements within [chunk_begin, chunk_end) of the flat layout.
  auto run = [&](int64_t chunk_begin, int64_t chunk_end, void* const* state) {
    std::vector<Piece> pieces;
    for (size_t i : active) {
      const auto& s = slots_[i];
      const int64_t b = std::max(chunk_begin, s.offset) - s.offset;
      const int64_t e = std::min(chunk_end, s.offset + s.numel) - s.offset;
      for (int64_t x = b; x < e; x += kPieceElements)
        pieces.push_back({i, x, std::min(e, x + kPieceElements)});
    }
    at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t lo, int64_t hi) {
      std::vector<void*> ptrs(streams);
      for (int64_t k = lo; k < hi; ++k) {
        const auto& piece = pieces[k];
        const auto& s = slots_[piece.slot];
        for (int j = 0; j < streams; ++j)
          ptrs[j] = static_cast<char*>(state[j]) + (s.offset + piece.begin - chunk_begin) * esize;
        update(s, piece.slot, piece.begin, piece.end, grads[piece.slot] + piece.begin, ptrs.data());
      }
    });
  };
  if (store_) {
    store_->for_each_chunk(ranges, run, last_);
  } else {
    const int64_t total = slots_.empty() ? 0 : slots_.back().offset + slots_.back().numel;
    run(0, total, nullptr);
  }
  for (size_t i : active)
    slots_[i].param.unsafeGetTensorImpl()->bump_version();  // written through a raw pointer
  last_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

torch::Tensor FusedOptimizer::state_tensor(const torch::Tensor& param,
                                           const std::string& name) const {
  const auto& s = slots_[slot_of(param)];
  const auto it = std::find(state_names_.begin(), state_names_.end(), name);
  TORCH_CHECK(it != state_names_.end(), "fused optimizer: no state named '", name, "'");
  const int k = static_cast<int>(it - state_names_.begin());
  const auto dtype = state_options_.moments_dtype();
  const int64_t esize = element_size(dtype);
  auto buffer = store_->memory(k);
  if (buffer.defined())  // a view: loading a checkpoint writes straight into the state
    return buffer.narrow(0, s.offset * esize, s.numel * esize).view(dtype).view(param.sizes());
  auto t = torch::empty(param.sizes(), torch::TensorOptions().dtype(dtype));
  store_->read(k, s.offset, s.numel, t.data_ptr());
  return t;
}

void FusedOptimizer::get_state_step(const torch::Tensor& param, int64_t* step) const {
  *step = slots_[slot_of(param)].step;
}

bool FusedOptimizer::state_in_memory() const {
  return state_options_.offload_dir().empty();
}

std::map<std::string, torch::Tensor> FusedOptimizer::get_state(const torch::Tensor& param,
                                                               int64_t* step) const {
  const auto& s = slots_[slot_of(param)];
  if (step)
    *step = s.step;
  std::map<std::string, torch::Tensor> out;
  if (s.step == 0 || !store_)
    return out;
  for (const auto& name : state_names_)
    out[name] = state_tensor(param, name);
  return out;
}

void FusedOptimizer::set_state_tensor(const torch::Tensor& param, const std::string& name,
                                      const torch::Tensor& value) {
  const auto& s = slots_[slot_of(param)];
  const auto it = std::find(state_names_.begin(), state_names_.end(), name);
  TORCH_CHECK(it != state_names_.end(), "fused optimizer: no state named '", name, "'");
  const auto dtype = state_options_.moments_dtype();
  torch::Tensor t;
  if (!value.defined()) {
    t = torch::zeros({s.numel}, torch::TensorOptions().dtype(dtype));
  } else {
    TORCH_CHECK(value.numel() == s.numel, "fused optimizer: state '", name, "' has ", value.numel(),
                " elements, its parameter ", s.numel);
    t = value.to(torch::kCPU, dtype).contiguous();
  }
  store_->write(static_cast<int>(it - state_names_.begin()), s.offset, s.numel, t.data_ptr());
}

void FusedOptimizer::set_step(const torch::Tensor& param, int64_t step) {
  TORCH_CHECK(step >= 0, "fused optimizer: a negative step count");
  slots_[slot_of(param)].step = step;
}

void FusedOptimizer::set_state(const torch::Tensor& param,
                               const std::map<std::string, torch::Tensor>& state, int64_t step) {
  TORCH_CHECK(step >= 0, "fused optimizer: a negative step count");
  for (const auto& name : state_names_) {
    auto it = state.find(name);
    set_state_tensor(param, name, step == 0 || it == state.end() ? torch::Tensor() : it->second);
  }
  set_step(param, step);
}

int64_t FusedOptimizer::state_bytes() const {
  return store_ ? store_->total_bytes() : 0;
}

int64_t FusedOptimizer::resident_state_bytes() const {
  return store_ ? store_->resident_bytes() : 0;
}

std::string FusedOptimizer::offload_info() const {
  return store_ ? store_->info() : "";
}

std::string FusedOptimizer::kernel_capability() {
  return detail::kernels().capability;
}

void FusedOptimizer::save(torch::serialize::OutputArchive&) const {
  TORCH_CHECK(false,
              "fused optimizer: torch::save cannot hold its state (bf16, or in a file); use "
              "fsdp::save_sharded");
}

void FusedOptimizer::load(torch::serialize::InputArchive&) {
  TORCH_CHECK(false, "fused optimizer: use fsdp::load_sharded to restore its state");
}

}  // namespace fsdp
