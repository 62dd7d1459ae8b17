// The optimizer step, measured: fsdp::FusedAdamW against torch::optim::AdamW and ATen's own
// fused CPU kernel (at::_fused_adamw_), in parameters per second and as a fraction of the
// memory bandwidth measured in the same run; file offload against the file's own read and
// write speed. One process; every method steps the same parameters and gradients (each keeps
// its own state), interleaved round by round so that machine noise hits all alike; medians.
//
//   build/bench/bench_optimizer --params 10e6,50e6,100e6 --threads 1,2 --json out.json
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fcntl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fsdp/core/memory.h>
#include <fsdp/optim/fused_optimizer.h>

namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The memory bandwidth the optimizer can hope for, measured with its own access pattern:
// four arrays read and three of them written back in place (p += g, m += g, v += g: no
// arithmetic to speak of, 28 bytes per element as AdamW's fp32 step), vectorised with AVX2
// where the CPU has it. (STREAM's copy and triad understate it: their stores to lines not read
// first cost a read-for-ownership that an in-place update does not.)
__attribute__((target("avx2"))) void rmw_avx2(float* p, const float* g, float* m, float* v,
                                              int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    p[i] += g[i];
    m[i] += g[i];
    v[i] += g[i];
  }
}
void rmw_plain(float* p, const float* g, float* m, float* v, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    p[i] += g[i];
    m[i] += g[i];
    v[i] += g[i];
  }
}

double stream_bandwidth(int64_t n, int rounds) {
  auto p = torch::zeros({n}), g = torch::zeros({n}), m = torch::zeros({n}), v = torch::zeros({n});
  float *pp = p.data_ptr<float>(), *pg = g.data_ptr<float>(), *pm = m.data_ptr<float>(),
        *pv = v.data_ptr<float>();
  const bool avx2 = __builtin_cpu_supports("avx2");
  std::vector<double> rates;
  for (int r = 0; r < rounds + 1; ++r) {
    auto t0 = Clock::now();
    at::parallel_for(0, n, 1 << 15, [&](int64_t lo, int64_t hi) {
      (avx2 ? rmw_avx2 : rmw_plain)(pp, pg, pm, pv, lo, hi);
    });
    if (r > 0)
      rates.push_back(28.0 * n / seconds(t0));
  }
  return median(rates);
}

// The file system's own sequential write and read speed for `bytes`, O_DIRECT in 64 MiB
// requests where allowed (as the offload does), after an fsync-free warm-up.
std::pair<double, double> file_bandwidth(const std::string& dir, int64_t bytes) {
  const std::string path = dir + "/bench-io.bin";
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT, 0600);
  bool direct = fd >= 0;
  if (fd < 0)
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
  ::unlink(path.c_str());
  const int64_t chunk = 64ll << 20;
  void* buf = nullptr;
  if (posix_memalign(&buf, 4096, chunk) != 0)
    return {0, 0};
  std::memset(buf, 1, chunk);
  ::posix_fallocate(fd, 0, bytes);
  auto pass = [&](bool write) {
    auto t0 = Clock::now();
    for (int64_t off = 0; off < bytes; off += chunk) {
      const int64_t n = std::min(chunk, bytes - off);
      const ssize_t r = write ? ::pwrite(fd, buf, n, off) : ::pread(fd, buf, n, off);
      if (r != n)
        std::fprintf(stderr, "bench: short I/O at %lld\n", static_cast<long long>(off));
    }
    return bytes / seconds(t0);
  };
  pass(true);  // allocate the blocks for real
  std::vector<double> w, r;
  for (int i = 0; i < 3; ++i) {
    w.push_back(pass(true));
    r.push_back(pass(false));
  }
  ::close(fd);
  std::free(buf);
  std::printf("file system at %s: %s, write %.2f GB/s, read %.2f GB/s\n", dir.c_str(),
              direct ? "O_DIRECT" : "buffered", median(w) / 1e9, median(r) / 1e9);
  return {median(w), median(r)};
}

struct Method {
  std::string name;
  std::function<void()> step;
  std::vector<double> times;
  int64_t step_peak_extra = 0;  // tracked bytes allocated during the step, above the state
  int64_t state_resident = 0;
  fsdp::OptimizerStepStats last;
  std::function<fsdp::OptimizerStepStats()> stats;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Optimizer step: fused AdamW vs torch::optim::AdamW vs at::_fused_adamw_"};
  std::vector<double> sizes{10e6, 50e6, 100e6};
  std::vector<int> threads{1, 2};
  int rounds = 5;
  int64_t tensor_elems = 4 << 20;
  std::string offload_dir = std::filesystem::temp_directory_path().string();
  std::string json_path;
  app.add_option("--params", sizes, "Parameter counts")->delimiter(',');
  app.add_option("--threads", threads, "Thread counts")->delimiter(',');
  app.add_option("--rounds", rounds, "Timed steps per method (median)");
  app.add_option("--tensor-elems", tensor_elems, "Elements per parameter tensor");
  app.add_option("--offload-dir", offload_dir, "Directory of the offloaded state ('' : none)");
  app.add_option("--json", json_path, "Write the results here as JSON");
  CLI11_PARSE(app, argc, argv);

  fsdp::memory::install_tracking_allocator();
  std::printf("kernels: %s | ATen: %s\n", fsdp::FusedOptimizer::kernel_capability().c_str(),
              at::get_cpu_capability().c_str());
  std::string json = "{\"results\": [";
  bool first_json = true;
  std::pair<double, double> disk{0, 0};
  if (!offload_dir.empty())
    disk = file_bandwidth(offload_dir, 1ll << 30);

  for (int nt : threads) {
    at::set_num_threads(nt);
    const double bandwidth = stream_bandwidth(25'000'000, 5);
    std::printf(
        "\n%d thread(s): measured memory bandwidth %.1f GB/s (4 arrays read, 3 written "
        "in place, as AdamW)\n",
        nt, bandwidth / 1e9);
    for (double size : sizes) {
      const auto n = static_cast<int64_t>(size);
      torch::manual_seed(0);
      std::vector<torch::Tensor> params, grads;
      for (int64_t done = 0; done < n; done += tensor_elems) {
        const int64_t k = std::min(tensor_elems, n - done);
        params.push_back(torch::randn({k}));
        grads.push_back(torch::randn({k}) * 1e-2);
        params.back().mutable_grad() = grads.back();
      }
      const auto adamw = torch::optim::AdamWOptions(1e-4).weight_decay(0.1);
      std::vector<std::unique_ptr<Method>> methods;
      // Tracked bytes before a method builds its state; its warm-up step (which allocates the
      // state of torch's optimizers) follows at once, so the difference is its resident state.
      int64_t mark = fsdp::memory::stats().current_bytes;
      auto add = [&](std::string name, std::function<void()> step) {
        methods.push_back(std::make_unique<Method>());
        auto* m = methods.back().get();
        m->name = std::move(name);
        m->step = std::move(step);
        m->step();
        m->state_resident = fsdp::memory::stats().current_bytes - mark;
        mark = fsdp::memory::stats().current_bytes;
        return m;
      };
      auto torch_opt = std::make_shared<torch::optim::AdamW>(params, adamw);
      add("torch::optim::AdamW", [torch_opt] { torch_opt->step(); });
      // ATen's fused CPU kernel, called as torch.optim.AdamW(fused=True) calls it.
      mark = fsdp::memory::stats().current_bytes;
      auto aten = std::make_shared<std::vector<std::vector<torch::Tensor>>>();
      for (int k = 0; k < 2; ++k) {
        aten->emplace_back();
        for (const auto& p : params)
          aten->back().push_back(torch::zeros_like(p));
      }
      auto steps = std::make_shared<std::vector<torch::Tensor>>();
      for (size_t i = 0; i < params.size(); ++i)
        steps->push_back(torch::zeros({}, torch::kFloat));
      add("at::_fused_adamw_", [=] {
        for (auto& s : *steps)
          s.add_(1);
        at::_fused_adamw_(params, grads, (*aten)[0], (*aten)[1], {}, *steps, 1e-4, 0.9, 0.999, 0.1,
                          1e-8, /*amsgrad=*/false, /*maximize=*/false, {}, {});
      });
      mark = fsdp::memory::stats().current_bytes;
      auto fused = std::make_shared<fsdp::FusedAdamW>(params, adamw);
      add("fsdp::FusedAdamW", [fused] { fused->step(); });
      mark = fsdp::memory::stats().current_bytes;
      auto fused16 = std::make_shared<fsdp::FusedAdamW>(
          params, adamw, fsdp::OptimizerStateOptions().moments_dtype(torch::kBFloat16));
      add("fsdp::FusedAdamW bf16", [fused16] { fused16->step(); });
      std::shared_ptr<fsdp::FusedAdamW> offloaded;
      if (!offload_dir.empty()) {
        mark = fsdp::memory::stats().current_bytes;
        offloaded = std::make_shared<fsdp::FusedAdamW>(
            params, adamw, fsdp::OptimizerStateOptions().offload_dir(offload_dir));
        auto* m = add("fsdp::FusedAdamW file", [offloaded] { offloaded->step(); });
        m->stats = [offloaded] { return offloaded->last_step(); };
      }
      // Timed rounds, interleaved.
      for (int r = 0; r < rounds; ++r) {
        for (auto& m : methods) {
          const auto live = fsdp::memory::stats().current_bytes;
          fsdp::memory::reset_peak();
          const auto t0 = Clock::now();
          m->step();
          m->times.push_back(seconds(t0));
          m->step_peak_extra =
              std::max(m->step_peak_extra, fsdp::memory::stats().peak_bytes - live);
          if (m->stats)
            m->last = m->stats();
        }
      }
      const double base = median(methods[0]->times);
      std::printf("%lld params, %d thread(s):\n", static_cast<long long>(n), nt);
      std::printf("  %-24s %9s %12s %8s %8s %12s %12s\n", "method", "step ms", "Mparams/s",
                  "vs torch", "of BW", "state MiB", "temp MiB");
      for (auto& m : methods) {
        const double t = median(m->times);
        const double rate = n / t;
        // fp32: p, g, m, v read and p, m, v written = 28 B; bf16 moments: 20 B.
        const double bytes = m->name.find("bf16") != std::string::npos ? 20.0 : 28.0;
        std::printf("  %-24s %9.1f %12.1f %7.2fx %7.0f%% %12.1f %12.1f\n", m->name.c_str(), t * 1e3,
                    rate / 1e6, base / t, 100.0 * rate * bytes / bandwidth,
                    m->state_resident / 1048576.0, m->step_peak_extra / 1048576.0);
        if (m->stats) {
          const double io = (m->last.bytes_read / disk.second + m->last.bytes_written / disk.first);
          std::printf(
              "  %-24s read %.0f MB, wrote %.0f MB, waited %.1f ms; reading and writing "
              "the state once at the file system's speed: %.1f ms (step = %.2fx that)\n",
              "", m->last.bytes_read / 1e6, m->last.bytes_written / 1e6,
              m->last.io_wait_seconds * 1e3, io * 1e3, io > 0 ? t / io : 0.0);
        }
        char buf[512];
        std::snprintf(buf, sizeof buf,
                      "%s{\"params\": %lld, \"threads\": %d, \"method\": \"%s\", \"step_s\": %.6f, "
                      "\"params_per_s\": %.1f, \"vs_torch\": %.4f, \"bandwidth_fraction\": %.4f, "
                      "\"bandwidth_Bps\": %.1f, \"state_bytes\": %lld, \"temp_bytes\": %lld, "
                      "\"io_read\": %lld, \"io_written\": %lld, \"io_wait_s\": %.6f}",
                      first_json ? "" : ", ", static_cast<long long>(n), nt, m->name.c_str(), t,
                      rate, base / t, rate * bytes / bandwidth, bandwidth,
                      static_cast<long long>(m->state_resident),
                      static_cast<long long>(m->step_peak_extra),
                      static_cast<long long>(m->last.bytes_read),
                      static_cast<long long>(m->last.bytes_written), m->last.io_wait_seconds);
        json += buf;
        first_json = false;
      }
    }
  }
  char tail[128];
  std::snprintf(tail, sizeof tail, "], \"disk_write_Bps\": %.1f, \"disk_read_Bps\": %.1f}",
                disk.first, disk.second);
  json += tail;
  if (!json_path.empty())
    std::ofstream(json_path) << json << "\n";
  return 0;
}
