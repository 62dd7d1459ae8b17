// See matmul_speed.h.
#include "matmul_speed.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>

namespace fsdp_trainer {
namespace {

void sync(c10::Device device) {
  if (device.is_cuda())
    torch::cuda::synchronize(device.index());
}

// Best time of `call` in seconds (see measure_matmul_speed for the budget).
double best_seconds(const std::function<void()>& call, c10::Device device, double min_seconds) {
  using Clock = std::chrono::steady_clock;
  call();  // warm-up: thread pool start, packing buffers, kernel selection
  sync(device);
  double best = std::numeric_limits<double>::infinity(), spent = 0;
  for (int reps = 0; reps < 20; ++reps) {
    const auto t0 = Clock::now();
    call();
    sync(device);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::min(best, s);
    spent += s;
    if ((reps >= 2 && spent >= min_seconds) || spent >= 0.5)
      break;
  }
  return std::max(best, 1e-9);
}

}  // namespace

double MatmulSpeed::best() const {
  return std::max({forward, input_grad, weight_grad});
}

double MatmulSpeed::step() const {
  if (forward <= 0 || input_grad <= 0 || weight_grad <= 0)
    return 0;
  // Equal FLOPs per form: the harmonic mean is the FLOPs of all three over their total time.
  return 3.0 / (1.0 / forward + 1.0 / input_grad + 1.0 / weight_grad);
}

MatmulSpeed measure_matmul_speed(c10::ScalarType dtype, const MatmulShape& shape,
                                 c10::Device device, double min_seconds) {
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  const at::Tensor x = at::full({shape.m, shape.k}, 0.5, options);
  const at::Tensor w = at::full({shape.n, shape.k}, 0.25, options);
  const at::Tensor dy = at::full({shape.m, shape.n}, 0.125, options);
  const double flops = shape.flops();
  MatmulSpeed speed;
  speed.forward = flops / best_seconds([&] { (void)at::linear(x, w); }, device, min_seconds);
  speed.input_grad = flops / best_seconds([&] { (void)at::mm(dy, w); }, device, min_seconds);
  speed.weight_grad = flops / best_seconds([&] { (void)at::mm(dy.t(), x); }, device, min_seconds);
  return speed;
}

double peak_matmul_flops(c10::ScalarType dtype, const std::vector<MatmulShape>& shapes,
                         c10::Device device) {
  using Key = std::tuple<c10::ScalarType, std::vector<std::tuple<int64_t, int64_t, int64_t>>,
                         std::string, int>;
  static std::mutex mutex;
  static std::map<Key, double> cache;
  std::vector<std::tuple<int64_t, int64_t, int64_t>> dims;
  for (const auto& s : shapes)
    dims.emplace_back(s.m, s.k, s.n);
  const Key key{dtype, dims, device.str(), at::get_num_threads()};
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = cache.find(key); it != cache.end())
    return it->second;
  const MatmulShape square{512, 512, 512};
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  const at::Tensor a = at::full({square.m, square.k}, 0.5, options);
  const at::Tensor b = at::full({square.k, square.n}, 0.25, options);
  // A shorter budget than a dtype comparison's: the peak is the best of many timings already,
  // and every rank of every fsdp-train start pays it (the 0.02 s budget made it a third of a
  // small run's CPU per rank: ~25 ms of ~70 on our 2-core EPYC).
  constexpr double kMinSeconds = 0.005;
  double peak = square.flops() / best_seconds([&] { (void)at::mm(a, b); }, device, kMinSeconds);
  for (const auto& s : shapes) {
    if (s.m > 0 && s.k > 0 && s.n > 0)
      peak = std::max(peak, measure_matmul_speed(dtype, s, device, kMinSeconds).best());
  }
  return cache[key] = peak;
}

}  // namespace fsdp_trainer
