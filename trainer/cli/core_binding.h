// training.bind_cores: each local rank pinned to its own share of the machine's physical cores
// (all the hardware threads of those cores), like DeepSpeed's --bind_cores_to_rank, which also
// splits physical cores evenly. Measured on the 2-core EPYC at the demo setting
// (docs/step_overheads.md): no_shard's worst round 0.971 of the bound with it, 0.795 without
// (medians 0.976 both), full_shard 0.926 against 0.857; why it helps is not measured.
#pragma once

#include <string>
#include <vector>

namespace fsdp_trainer {

/// The CPUs this process may run on (its affinity mask), in order; empty if it cannot be read.
std::vector<int> allowed_cpus();

/// The physical cores among `cpus` (the CPUs a process may run on), each as the list of its
/// hardware threads in `cpus`, ordered by package and then by first CPU; each CPU its own core
/// where /sys/devices/system/cpu/cpuN/topology cannot be read.
std::vector<std::vector<int>> physical_cores(const std::vector<int>& cpus);

/// Local rank `local_rank`'s share of `cores` among `local_world` ranks, in order: the same
/// number of whole cores for every rank (cores / local_world; the remainder unused, so that no
/// rank is the straggler), as the list of their CPUs. Empty when there are more ranks than cores.
std::vector<int> core_share(const std::vector<std::vector<int>>& cores, int local_rank,
                            int local_world);

/// "0-3,8": a CPU list as /proc and taskset write it.
std::string cpu_list(const std::vector<int>& cpus);

/// Pins this process, every thread it has and every thread it starts later, to its core_share
/// of the CPUs it may run on now (its local ranks must all start with the same CPUs: under a
/// launcher that already binds each rank, such as srun's task binding, leave it off). Returns
/// what to log, "on CPUs 2-3 (of 0-7: 4 local ranks)", or why nothing was pinned ("not bound:
/// 3 local ranks on 2 cores"); `cpus` gets the share (empty when not bound).
std::string bind_to_cores(int local_rank, int local_world, std::vector<int>* cpus = nullptr);

}  // namespace fsdp_trainer
