// See core_binding.h. The mask is set on every thread of the process (/proc/self/task): a
// rank started by exec may have threads before it gets here, and sched_setaffinity acts on one
// thread; threads started later inherit it.
#include "core_binding.h"

#include <sched.h>

#include <cstdlib>
#include <filesystem>
#include <string>

namespace fsdp_trainer {

std::vector<int> core_share(const std::vector<int>& cpus, int local_rank, int local_world) {
  const int n = static_cast<int>(cpus.size());
  if (local_world < 1 || local_rank < 0 || local_rank >= local_world || local_world > n)
    return {};
  const int begin = local_rank * n / local_world, end = (local_rank + 1) * n / local_world;
  return {cpus.begin() + begin, cpus.begin() + end};
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

std::string bind_to_cores(int local_rank, int local_world) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (::sched_getaffinity(0, sizeof allowed, &allowed) != 0)
    return "not bound: this process's CPUs cannot be read";
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &allowed))
      cpus.push_back(c);
  }
  const auto share = core_share(cpus, local_rank, local_world);
  if (share.empty())
    return "not bound: " + std::to_string(local_world) + " local ranks on " +
           std::to_string(cpus.size()) + " CPUs";
  cpu_set_t mine;
  CPU_ZERO(&mine);
  for (int c : share)
    CPU_SET(c, &mine);
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task", ec)) {
    const pid_t tid = static_cast<pid_t>(std::atoi(task.path().filename().c_str()));
    if (tid > 0)
      ::sched_setaffinity(tid, sizeof mine, &mine);  // a thread that just ended: nothing to do
  }
  // This thread's at least, whatever the listing said: the threads to come inherit it.
  if (ec || ::sched_setaffinity(0, sizeof mine, &mine) != 0)
    return "not bound: the CPUs could not be set";
  return "on CPUs " + cpu_list(share) + " (of " + cpu_list(cpus) + ", " +
         std::to_string(local_world) + " local ranks)";
}

}  // namespace fsdp_trainer
