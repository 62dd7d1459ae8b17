// See include/fsdp/plan/unit_overhead.h.
#include <fsdp/plan/unit_overhead.h>

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <ctime>
#include <vector>

#include <fsdp/distributed/collectives.h>
#include <fsdp/distributed/process_group.h>

namespace fsdp::plan {
namespace {

// "<prefix><i>" (appended: GCC 12 misreports "l" + std::to_string(i) as an overflow).
std::string child_name(char prefix, int i) {
  std::string out(1, prefix);
  out += std::to_string(i);
  return out;
}

// `width` Linear(16, 16) layers run in a row: one FSDP unit.
struct TinyUnitImpl : torch::nn::Module {
  explicit TinyUnitImpl(int width) {
    for (int i = 0; i < width; ++i)
      layers.push_back(register_module(child_name('l', i), torch::nn::Linear(16, 16)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : layers)
      x = l(x);
    return x;
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(TinyUnit);

struct TinyModelImpl : torch::nn::Module {
  TinyModelImpl(int units, int width) {
    for (int i = 0; i < units; ++i)
      blocks.push_back(register_module(child_name('u', i), TinyUnit(width)));
    head = register_module("head", torch::nn::Linear(16, 16));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& b : blocks)
      x = fsdp::forward(b, x);
    return head(x);
  }
  std::vector<TinyUnit> blocks;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(TinyModel);

// CPU seconds of this process, all its threads (Gloo's workers too).
double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// CPU seconds of one training step of `units` units of `width` layers: the slowest rank's
// median.
double step_seconds(const std::shared_ptr<ProcessGroup>& group, ShardingStrategy strategy,
                    c10::ScalarType dtype, int units, int width, int steps) {
  TinyModel model(units, width);
  auto options =
      FullyShardOptions(group).strategy(strategy).mp_policy(MixedPrecisionPolicy().param_dtype(
          dtype == torch::kFloat ? std::nullopt : std::optional<c10::ScalarType>(dtype)));
  for (auto& b : model->blocks)
    fully_shard(b, options);
  fully_shard(model, options);
  const auto x = torch::ones({1, 16});
  std::vector<double> times;
  for (int i = 0; i < steps + 2; ++i) {
    barrier(*group, "planner: unit overhead")->wait();
    const double start = cpu_seconds();
    fsdp::forward(model, x).sum().backward();
    const double s = cpu_seconds() - start;
    for (auto& p : model->parameters())
      p.mutable_grad() = torch::Tensor();
    if (i >= 2)  // the first steps allocate buffers and connect
      times.push_back(s);
  }
  std::sort(times.begin(), times.end());
  auto t = torch::tensor({times[times.size() / 2]}, torch::TensorOptions().dtype(torch::kDouble));
  all_reduce(*group, t, ReduceOp::kMax, "planner: unit overhead")->wait();
  return t.item<double>();
}

}  // namespace

double UnitOverhead::seconds(int64_t params) const {
  return std::max(0.0, per_unit_s + per_param_s * static_cast<double>(params));
}

UnitOverhead measure_unit_overhead(const std::shared_ptr<ProcessGroup>& group,
                                   ShardingStrategy strategy, c10::ScalarType param_dtype,
                                   int steps) {
  TORCH_CHECK(group && steps >= 1, "fsdp::plan: measure_unit_overhead arguments");
  // Per unit at each width: (12 units - 2 units) / 10; a Linear holds 2 parameter tensors, so
  // widths 1 and 6 differ by 10 per unit. Wide spans: the differences are of noisy timings
  // (Gloo's calls on a loaded machine vary by a millisecond).
  auto per_unit = [&](int width) {
    return (step_seconds(group, strategy, param_dtype, 12, width, steps) -
            step_seconds(group, strategy, param_dtype, 2, width, steps)) /
           10.0;
  };
  const double one = per_unit(1), six = per_unit(6);
  UnitOverhead out;
  out.per_param_s = std::max(0.0, (six - one) / 10.0);
  out.per_unit_s = std::max(0.0, one - 2 * out.per_param_s);
  return out;
}

}  // namespace fsdp::plan
