// See core_binding.h. The mask is set on every thread of the process (/proc/self/task): a
// rank started by exec may have threads before it gets here, and sched_setaffinity acts on one
// thread; threads started later inherit it.
#include "core_binding.h"

#include <dirent.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <utility>

namespace fsdp_trainer {
namespace {

// A topology file's integer, or -1.
int read_topology(int cpu, const char* name) {
  std::ifstream in("/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/" + name);
  int v = -1;
  return in >> v ? v : -1;
}

// This process's threads, from /proc/self/task (no exceptions: a listing that fails is empty).
std::vector<pid_t> threads() {
  std::vector<pid_t> tids;
  DIR* dir = ::opendir("/proc/self/task");
  if (!dir)
    return tids;
  while (const dirent* e = ::readdir(dir)) {
    const pid_t tid = static_cast<pid_t>(std::atoi(e->d_name));
    if (tid > 0)
      tids.push_back(tid);
  }
  ::closedir(dir);
  return tids;
}

}  // namespace

std::vector<int> allowed_cpus() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  std::vector<int> cpus;
  if (::sched_getaffinity(0, sizeof allowed, &allowed) != 0)
    return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &allowed))
      cpus.push_back(c);
  }
  return cpus;
}

std::vector<std::vector<int>> physical_cores(const std::vector<int>& cpus) {
  // (package, core id) -> its CPUs; a CPU whose topology is unreadable is a core of its own,
  // in package -1 (first).
  std::map<std::pair<int, int>, std::vector<int>> by_core;
  std::vector<std::pair<int, std::vector<int>>> cores;  // (package, CPUs)
  for (int c : cpus) {
    const int package = read_topology(c, "physical_package_id");
    const int core = read_topology(c, "core_id");
    if (package < 0 || core < 0)
      cores.push_back({-1, {c}});
    else
      by_core[{package, core}].push_back(c);
  }
  for (auto& [key, list] : by_core)
    cores.emplace_back(key.first, std::move(list));
  std::sort(cores.begin(), cores.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first < b.first : a.second.front() < b.second.front();
  });
  std::vector<std::vector<int>> out;
  for (auto& [package, list] : cores)
    out.push_back(std::move(list));
  return out;
}

std::vector<int> core_share(const std::vector<std::vector<int>>& cores, int local_rank,
                            int local_world) {
  const int n = static_cast<int>(cores.size());
  if (local_world < 1 || local_rank < 0 || local_rank >= local_world || local_world > n)
    return {};
  const int each = n / local_world;
  std::vector<int> share;
  for (int k = local_rank * each; k < (local_rank + 1) * each; ++k)
    share.insert(share.end(), cores[static_cast<size_t>(k)].begin(),
                 cores[static_cast<size_t>(k)].end());
  std::sort(share.begin(), share.end());
  return share;
}

std::string cpu_list(const std::vector<int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1)
      ++j;
    if (!out.empty())
      out += ',';
    out += std::to_string(cpus[i]);
    if (j > i)
      out += '-' + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out;
}

std::string bind_to_cores(int local_rank, int local_world, std::vector<int>* cpus_out) {
  if (cpus_out)
    cpus_out->clear();
  const std::vector<int> cpus = allowed_cpus();
  if (cpus.empty())
    return "not bound: this process's CPUs cannot be read";
  const auto cores = physical_cores(cpus);
  const auto share = core_share(cores, local_rank, local_world);
  const std::string ranks =
      std::to_string(local_world) + (local_world == 1 ? " local rank" : " local ranks");
  if (share.empty())
    return "not bound: " + ranks + " on " + std::to_string(cores.size()) + " cores";
  cpu_set_t mine;
  CPU_ZERO(&mine);
  for (int c : share)
    CPU_SET(c, &mine);
  // This thread first (the threads it starts inherit it), then every other one; repeated until
  // a pass finds every thread set, so that one started during a pass is not missed.
  if (::sched_setaffinity(0, sizeof mine, &mine) != 0)
    return "not bound: the CPUs could not be set";
  for (int pass = 0; pass < 8; ++pass) {
    bool all_set = true;
    for (const pid_t tid : threads()) {
      cpu_set_t now;
      CPU_ZERO(&now);
      if (::sched_getaffinity(tid, sizeof now, &now) == 0 && CPU_EQUAL(&now, &mine))
        continue;
      all_set = false;
      if (::sched_setaffinity(tid, sizeof mine, &mine) != 0 && errno != ESRCH)  // ESRCH: ended
        return "bound only in part: thread " + std::to_string(tid) + "'s CPUs could not be set";
    }
    if (all_set) {
      if (cpus_out)
        *cpus_out = share;
      return "on CPUs " + cpu_list(share) + " (of " + cpu_list(cpus) + ": " + ranks + ")";
    }
  }
  return "bound only in part: new threads kept appearing";
}

}  // namespace fsdp_trainer
