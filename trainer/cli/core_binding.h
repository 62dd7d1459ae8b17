// training.bind_cores: each local rank pinned to its own share of the machine's cores, as
// DeepSpeed's --bind_cores_to_rank and torchrun's NUMA binding do. On 2 cores the two ranks of
// the demo stop migrating between cores and sharing a core's caches with the other's threads:
// no_shard 2.6% faster (median of 5 interleaved runs, docs/step_overheads.md).
#pragma once

#include <string>
#include <vector>

namespace fsdp_trainer {

/// The CPUs of local rank `local_rank` when `cpus` (the CPUs the node's ranks may run on) are
/// split evenly among `local_world` ranks in order (a rank gets n / local_world of them, or one
/// more); empty when there are more ranks than CPUs (nothing to give each its own).
std::vector<int> core_share(const std::vector<int>& cpus, int local_rank, int local_world);

/// "0-3,8": a CPU list as /proc and taskset write it.
std::string cpu_list(const std::vector<int>& cpus);

/// Pins this process, every thread it has and every thread it starts later, to its core_share
/// of the CPUs it may run on now. Returns what to log: "on CPUs 2-3 (of 0-7, 4 local ranks)",
/// or why nothing was pinned ("not bound: 3 local ranks on 2 CPUs").
std::string bind_to_cores(int local_rank, int local_world);

}  // namespace fsdp_trainer
