// See kernel_profile.h.
#include "observe/kernel_profile.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <map>
#include <set>
#include <stdexcept>
#include <utility>
#include <vector>

namespace fsdp_trainer {
namespace {

namespace prof = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

// The same config and activities for prepare and enable (the calls both torch 2.11 and 2.15
// declare): host ops and the device's activity.
const ProfilerConfig& config() {
  static const ProfilerConfig c(ProfilerState::KINETO);
  return c;
}
const std::set<ActivityType>& activities() {
  static const std::set<ActivityType> a{ActivityType::CPU, ActivityType::CUDA};
  return a;
}

}  // namespace

std::unique_ptr<KernelProfile> KernelProfile::start() {
  std::unique_ptr<KernelProfile> p(new KernelProfile());
  prof::prepareProfiler(config(), activities());
  prof::enableProfiler(config(), activities());
  p->running_ = true;
  return p;
}

KernelProfile::~KernelProfile() {
  if (running_) {
    try {
      prof::disableProfiler();
    } catch (...) {  // a destructor must not throw; the summary is lost either way
    }
  }
}

std::string KernelProfile::stop_and_write(const std::string& path, int steps) {
  running_ = false;
  const auto result = prof::disableProfiler();
  // Device-side events: kernels, memcpy and memset activities carry the device type CUDA.
  std::map<std::string, std::pair<int64_t, uint64_t>> by_name;  // name -> (count, ns)
  uint64_t total = 0;
  for (const auto& e : result->events()) {
    if (e.deviceType() != c10::DeviceType::CUDA)
      continue;
    auto& [count, ns] = by_name[e.name()];
    ++count;
    ns += e.durationNs();
    total += e.durationNs();
  }
  std::vector<std::pair<std::string, std::pair<int64_t, uint64_t>>> rows(by_name.begin(),
                                                                         by_name.end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.second > b.second.second; });
  nlohmann::json kernels = nlohmann::json::array();
  for (const auto& [name, v] : rows)
    kernels.push_back({{"name", name}, {"count", v.first}, {"ns", v.second}});
  const nlohmann::json summary{{"steps", steps}, {"device_ns", total}, {"kernels", kernels}};
  std::ofstream out(path);
  out << summary.dump(1) << "\n";
  if (!out)
    throw std::runtime_error(path + ": cannot write the kernel summary");
  return fmt::format("device kernels of {} step{}: {:.1f} ms a step in {} kinds ({})", steps,
                     steps == 1 ? "" : "s", static_cast<double>(total) / 1e6 / std::max(steps, 1),
                     rows.size(), path);
}

}  // namespace fsdp_trainer
