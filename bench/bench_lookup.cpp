// bench_lookup: what fsdp-cpp's own bookkeeping costs per step on a model with many parameter
// tensors, apart from any compute or communication: fsdp::forward's unit lookup and hooks,
// and clip_grad_norm_'s per-parameter unit lookup. One process, units over a group of one
// rank, layers of 4x4 so that the arithmetic is negligible next to the bookkeeping.
//
//   bench_lookup [--units 600] [--steps 20]
//
// Prints the machine (model name and the relevant CPU flags), then per step the median time of
// the forward (units x fsdp::forward), of the backward, and of clip_grad_norm_, and the same
// forward without fsdp (plain module calls) as the baseline, measured in the same run.
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>

namespace {

struct ChainImpl : torch::nn::Module {
  explicit ChainImpl(int n) {
    for (int i = 0; i < n; ++i)
      layers.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(4, 4)));
  }
  torch::Tensor forward(torch::Tensor x, bool sharded) {
    for (auto& l : layers)
      x = sharded ? fsdp::forward(l, x) : l(x);
    return x;
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(Chain);

std::string cpu_line() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model, flags;
  while (std::getline(in, line)) {
    if (model.empty() && line.rfind("model name", 0) == 0)
      model = line.substr(line.find(':') + 2);
    if (flags.empty() && line.rfind("flags", 0) == 0) {
      std::istringstream words(line.substr(line.find(':') + 1));
      for (std::string w; words >> w;) {
        if (w == "avx2" || w == "avx512f" || w == "avx512_bf16" || w == "amx_bf16" || w == "fma")
          flags += (flags.empty() ? "" : " ") + w;
      }
    }
  }
  return model + "; flags: " + (flags.empty() ? "none" : flags);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fsdp-cpp's per-step bookkeeping on a model with many parameter tensors"};
  int units = 600, steps = 20;
  app.add_option("--units", units, "Linear(4, 4) units (2 parameter tensors each)");
  app.add_option("--steps", steps, "measured steps (after 3 warm-up steps)");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(1);
  std::printf("machine: %s\n", cpu_line().c_str());

  auto pg = fsdp::init_process_group();
  torch::manual_seed(0);
  Chain plain(units), model(units);
  for (auto& l : model->layers)
    fsdp::fully_shard(l, fsdp::FullyShardOptions(pg));
  fsdp::fully_shard(model, fsdp::FullyShardOptions(pg));
  const auto params = model->parameters();
  std::printf("%d units, %zu parameter tensors\n", units, params.size());

  auto x = torch::randn({2, 4});
  std::vector<double> plain_fwd, fwd, bwd, clip;
  for (int s = 0; s < steps + 3; ++s) {
    auto t = std::chrono::steady_clock::now();
    auto y0 = plain->forward(x, false);
    const double p = ms_since(t);
    t = std::chrono::steady_clock::now();
    auto y = fsdp::forward(model, x, true);
    const double f = ms_since(t);
    t = std::chrono::steady_clock::now();
    y.sum().backward();
    const double b = ms_since(t);
    t = std::chrono::steady_clock::now();
    fsdp::clip_grad_norm_(params, 1.0, *pg);
    const double c = ms_since(t);
    for (auto& q : params)
      q.mutable_grad() = torch::Tensor();
    if (s >= 3) {
      plain_fwd.push_back(p), fwd.push_back(f), bwd.push_back(b), clip.push_back(c);
    }
  }
  const double pf = median(plain_fwd), f = median(fwd);
  std::printf("forward, plain module calls: %8.3f ms\n", pf);
  std::printf("forward, fsdp::forward:      %8.3f ms  (%.2f us per unit over plain)\n", f,
              (f - pf) * 1e3 / units);
  std::printf("backward:                    %8.3f ms\n", median(bwd));
  std::printf("clip_grad_norm_:             %8.3f ms  (%.2f us per parameter tensor)\n",
              median(clip), median(clip) * 1e3 / static_cast<double>(params.size()));
  return 0;
}
