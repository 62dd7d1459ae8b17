// This machine, measured (fsdp::plan, issue 26; fsdp-plan --calibrate): its matmul rates per
// dtype and thread count, Gloo's collectives between ranks on it, memory copies, and the disk
// the optimizer state is offloaded to. Measured once and cached in a file keyed by what decides
// the figures (CPU model, core count and the instruction sets ATen and oneDNN may use), so a
// session on a different machine, or the same one with AVX-512 switched off, measures again.
//
// The profile is what the planner's predictions stand on where it has not timed the job itself
// (fsdp-plan --auto): built-in data-sheet profiles describe GPUs (hardware.h), this describes
// the CPU the job runs on.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <fsdp/plan/step_time.h>
#include <fsdp/plan/unit_overhead.h>

namespace fsdp::plan {

struct MatmulRate {
  std::string dtype;  // "fp32", "bf16"
  int threads = 1;
  double flops_per_s = 0;
};

/// Disk throughput in a directory: fsync'ed writes, reads of data not in the page cache.
struct DiskRates {
  double read_bytes_per_s = 0;
  double write_bytes_per_s = 0;
};

struct MachineProfile {
  /// machine_key() when measured: a profile only describes the machine with the same key.
  std::string key;
  std::string measured_at;  // UTC, ISO 8601
  std::vector<MatmulRate> matmul;
  /// By the number of ranks on this machine (each with one intra-op thread per core share):
  /// the collectives of a group of that many, measured by measure_link.
  std::map<int, LinkProfile> gloo;
  /// By the number of ranks on this machine (1 too), then "<strategy>/<dtype>" ("full_shard/
  /// bf16"; strategies full_shard, shard_grad_op, no_shard): measure_unit_overhead.
  std::map<int, std::map<std::string, UnitOverhead>> unit_overhead;
  double memcpy_bytes_per_s = 0;
  DiskRates disk;
  std::string disk_dir;

  /// The rate measured for (dtype, threads), or 0.
  double matmul_flops(const std::string& dtype, int threads) const;
};

/// "<CPU model> | <cores> cores | <ISA>": the CPU model from /proc/cpuinfo, the cores this
/// process may run on, and the instruction sets that change kernel speeds (avx2, avx512f,
/// avx512_bf16, amx_bf16 from the CPU flags, capped by ATEN_CPU_CAPABILITY and
/// ONEDNN_MAX_CPU_ISA when set).
std::string machine_key();

/// The cache file of the profile with `key` under `cache_dir`: <cache_dir>/hardware/<slug>.json.
std::string machine_profile_path(const std::string& cache_dir, const std::string& key);

/// Writes the profile atomically (a crash leaves the old file or the new one).
void save_machine_profile(const MachineProfile& profile, const std::string& path);

/// The profile in `path`: nullopt when there is none, or when it was measured on a machine with
/// another key (then it is measured again). A profile without unit overheads (written before
/// they were measured) loads with none. Throws one line naming the file and the problem for
/// a file that is not a profile (bad JSON, a missing or negative figure).
std::optional<MachineProfile> load_machine_profile(const std::string& path, const std::string& key);

/// Bytes per second of a large memcpy (the best of a few), with the current threads.
double measure_memcpy(int64_t bytes = int64_t{256} << 20);

/// Writes `bytes` (rounded up to whole writes) in 8 MiB writes to a new file in `dir` and fsyncs
/// it, drops it from the page cache, reads it back, and removes it. Throws naming the directory if
/// it cannot.
DiskRates measure_disk(const std::string& dir, int64_t bytes = int64_t{256} << 20);

}  // namespace fsdp::plan
