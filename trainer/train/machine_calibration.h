// fsdp-plan --calibrate (issue 26): this machine's profile (fsdp/plan/machine_profile.h),
// measured: matmul rates per dtype and thread count, Gloo's collectives between ranks launched
// on it, memory copies, and the disk in a directory. Cached under the cache directory by
// machine_key(), so it is measured once per machine and instruction-set cap.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <fsdp/plan/machine_profile.h>

namespace fsdp_trainer {

/// Measures this machine with groups of 1 to `max_ranks` ranks (each launched as
/// `executable --calibration-rank FILE`, one intra-op thread per core it gets): Gloo's
/// collectives and the engine's cost per unit; and the disk in `disk_dir`. `log` is told what
/// is being measured.
fsdp::plan::MachineProfile calibrate_machine(int max_ranks, const std::string& executable,
                                             const std::string& disk_dir,
                                             const std::function<void(const std::string&)>& log);

/// The cached profile of this machine if it has figures for every group size up to
/// `max_ranks`; otherwise measured (calibrate_machine) and saved. `recalibrate`: measure even
/// when a cached profile exists.
fsdp::plan::MachineProfile machine_profile(const std::string& cache_dir, int max_ranks,
                                           const std::string& executable, bool recalibrate,
                                           const std::function<void(const std::string&)>& log);

/// The body of a `--calibration-rank FILE` rank: joins the job from the environment, times the
/// collectives on the world group (fsdp::plan::measure_link) and the engine's cost per unit
/// for each strategy and dtype (fsdp::plan::measure_unit_overhead), and rank 0 writes them to
/// FILE. Returns the exit code.
int run_calibration_rank(const std::string& file);

/// The strategies and dtypes whose unit overhead a profile holds, as "<strategy>/<dtype>".
const std::vector<std::string>& overhead_kinds();

/// $FSDP_CACHE_DIR, else $XDG_CACHE_HOME/fsdp-cpp, else ~/.cache/fsdp-cpp.
std::string default_cache_dir();

}  // namespace fsdp_trainer
