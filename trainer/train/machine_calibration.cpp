// See machine_calibration.h.
#include "machine_calibration.h"

#include <ATen/Parallel.h>
#include <fmt/core.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <thread>

#include <fsdp/distributed/local_launch.h>
#include <fsdp/distributed/process_group.h>
#include <fsdp/fully_shard.h>
#include <fsdp/plan/step_time.h>
#include <fsdp/plan/unit_overhead.h>

#include "config/config.h"
#include "train/matmul_speed.h"

namespace fsdp_trainer {
namespace {

namespace plan = fsdp::plan;

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

int cores() {
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

}  // namespace

std::string default_cache_dir() {
  if (const char* d = std::getenv("FSDP_CACHE_DIR"); d && *d)
    return d;
  if (const char* d = std::getenv("XDG_CACHE_HOME"); d && *d)
    return (std::filesystem::path(d) / "fsdp-cpp").string();
  const char* home = std::getenv("HOME");
  return (std::filesystem::path(home && *home ? home : "/tmp") / ".cache" / "fsdp-cpp").string();
}

const std::vector<std::string>& overhead_kinds() {
  static const std::vector<std::string> kinds = {"full_shard/fp32",    "full_shard/bf16",
                                                 "shard_grad_op/fp32", "shard_grad_op/bf16",
                                                 "no_shard/fp32",      "no_shard/bf16"};
  return kinds;
}

// FSDP_PLAN_CALIBRATION_STEPS: the timed steps of each unit-overhead measurement (21 unless
// set, 3..21), the repeats of each link timing (7, at most the steps) and the disk timing's
// file (32 x steps / 21 chunks of 8 MiB: 256 MiB at 21, 32 MiB at 3): fewer make a quicker,
// noisier profile. The tests that exercise the calibration use 3 (it is most of their time).
namespace {
int calibration_steps() {
  const char* v = std::getenv("FSDP_PLAN_CALIBRATION_STEPS");
  if (!v || !*v)
    return 21;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (*end != '\0' || n < 3 || n > 21)
    throw std::runtime_error(
        fmt::format("FSDP_PLAN_CALIBRATION_STEPS = '{}' must be a whole number from 3 to 21", v));
  return static_cast<int>(n);
}
}  // namespace

int run_calibration_rank(const std::string& file) {
  fsdp::die_with_launcher();
  try {
    const int steps = calibration_steps();
    auto pg = fsdp::init_process_group();
    // The group's figures, in the profile's own file format: the launcher merges them.
    plan::MachineProfile part;
    part.key = plan::machine_key();
    const int ranks = pg->size();
    if (ranks > 1)
      part.gloo[ranks] = plan::measure_link(*pg, int64_t{4} << 20, std::min(7, steps));
    for (const auto& kind : overhead_kinds()) {
      const auto slash = kind.find('/');
      part.unit_overhead[ranks][kind] = plan::measure_unit_overhead(
          pg, fsdp::from_string<fsdp::ShardingStrategy>(kind.substr(0, slash)),
          kind.substr(slash + 1) == "fp32" ? torch::kFloat : torch::kBFloat16, steps);
    }
    if (pg->rank() == 0)
      plan::save_machine_profile(part, file);
    pg->barrier();
    return 0;
  } catch (const std::exception& e) {
    const std::string what = e.what();
    std::fprintf(stderr, "fsdp-plan --calibration-rank: %s\n",
                 what.substr(0, what.find('\n')).c_str());
    return 1;
  }
}

plan::MachineProfile calibrate_machine(int max_ranks, const std::string& executable,
                                       const std::string& disk_dir,
                                       const std::function<void(const std::string&)>& log) {
  plan::MachineProfile p;
  p.key = plan::machine_key();
  p.measured_at = utc_now();
  calibration_steps();  // a bad value refused before any rank starts
  log("calibrating " + p.key);
  // Matmul rates in the forms a training step runs them (matmul_speed.h), per thread count.
  const int threads_before = at::get_num_threads();
  const MatmulShape shape{256, 512, 1024};
  for (int threads = 1; threads <= cores(); threads *= 2) {
    at::set_num_threads(threads);
    for (const char* dtype : {"fp32", "bf16"}) {
      const double rate =
          measure_matmul_speed(dtype == std::string("fp32") ? torch::kFloat : torch::kBFloat16,
                               shape)
              .step();
      p.matmul.push_back({dtype, threads, rate});
      log(fmt::format("matmul {} on {} thread(s): {:.1f} GFLOP/s", dtype, threads, rate / 1e9));
    }
  }
  at::set_num_threads(threads_before);
  p.memcpy_bytes_per_s = plan::measure_memcpy();
  log(fmt::format("memcpy: {:.2f} GB/s", p.memcpy_bytes_per_s / 1e9));
  p.disk = plan::measure_disk(disk_dir, (int64_t{32} * calibration_steps() / 21) << 23);
  p.disk_dir = disk_dir;
  log(fmt::format("disk in {}: write {:.2f} GB/s, read {:.2f} GB/s", disk_dir,
                  p.disk.write_bytes_per_s / 1e9, p.disk.read_bytes_per_s / 1e9));
  // Gloo between ranks of this machine and the engine's cost per unit, one group size at a time.
  for (int ranks = 1; ranks <= max_ranks; ++ranks) {
    const auto file = (std::filesystem::path(disk_dir) /
                       fmt::format("fsdp-plan-link-{}-{}.json", getpid(), ranks))
                          .string();
    fsdp::LocalLaunchOptions o;
    o.executable = executable;
    o.argv = {"fsdp-plan", "--calibration-rank", file};
    o.nproc = ranks;
    o.threads_per_rank = std::max(1, cores() / ranks);
    o.timeout = std::chrono::minutes(3);
    o.grace_after_failure = std::chrono::seconds(5);
    const auto result = fsdp::launch_local_ranks(o);
    if (result.first_failed >= 0 || result.timed_out)
      throw std::runtime_error(
          fmt::format("measuring {} rank(s) failed (rank {} exited {})", ranks, result.first_failed,
                      result.first_failed >= 0 ? result.exit_codes[result.first_failed] : -1));
    const auto part = plan::load_machine_profile(file, p.key);
    std::filesystem::remove(file);
    if (!part || !part->unit_overhead.count(ranks) || (ranks > 1 && !part->gloo.count(ranks)))
      throw std::runtime_error(fmt::format("measuring {} rank(s) wrote no figures", ranks));
    p.unit_overhead[ranks] = part->unit_overhead.at(ranks);
    const auto& fs = p.unit_overhead[ranks]["full_shard/fp32"];
    std::string line = fmt::format(
        "{} rank(s): the engine's cost per unit and micro-batch (full_shard, fp32) {:.0f} us + "
        "{:.0f} us per parameter",
        ranks, fs.per_unit_s * 1e6, fs.per_param_s * 1e6);
    if (ranks > 1) {
      p.gloo[ranks] = part->gloo.at(ranks);
      const auto& ag = p.gloo[ranks].all_gather;
      line += fmt::format("; Gloo all-gather {:.0f} us + {:.2f} GB/s", ag.latency_s * 1e6,
                          ag.bytes_per_s / 1e9);
    }
    log(line);
  }
  return p;
}

plan::MachineProfile machine_profile(const std::string& cache_dir, int max_ranks,
                                     const std::string& executable, bool recalibrate,
                                     const std::function<void(const std::string&)>& log) {
  const auto key = plan::machine_key();
  const auto path = plan::machine_profile_path(cache_dir, key);
  if (!recalibrate) {
    if (auto cached = plan::load_machine_profile(path, key)) {
      bool complete = true;
      for (int r = 1; r <= max_ranks; ++r) {
        complete = complete && (r == 1 || cached->gloo.count(r) > 0);
        for (const auto& kind : overhead_kinds())
          complete = complete && cached->unit_overhead.count(r) > 0 &&
                     cached->unit_overhead.at(r).count(kind) > 0;
      }
      if (complete) {
        log("machine profile: " + path + " (measured " + cached->measured_at + ")");
        return *cached;
      }
      max_ranks = std::max(max_ranks, cached->gloo.empty() ? 0 : cached->gloo.rbegin()->first);
    }
  }
  const auto dir = (std::filesystem::path(cache_dir) / "hardware").string();
  auto p = calibrate_machine(max_ranks, executable, dir, log);
  plan::save_machine_profile(p, path);
  log("machine profile saved: " + path);
  return p;
}

}  // namespace fsdp_trainer
