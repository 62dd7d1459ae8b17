// See include/fsdp/plan/machine_profile.h.
#include <fsdp/plan/machine_profile.h>

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <fsdp/core/json_depth.h>
#include <sched.h>
#include <torch/torch.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fsdp/core/durable_file.h>
#include <fsdp/core/file.h>

namespace fsdp::plan {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The first value of `field` in /proc/cpuinfo ("model name", "flags"), or "".
std::string cpuinfo(const std::string& field) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field, 0) != 0)
      continue;
    const auto colon = line.find(':');
    if (colon == std::string::npos)
      continue;
    auto value = line.substr(colon + 1);
    value.erase(0, value.find_first_not_of(" \t"));
    return value;
  }
  return "";
}

json link_json(const LinkCost& c) {
  return {{"latency_s", c.latency_s}, {"bytes_per_s", c.bytes_per_s}};
}

// A figure of the profile: a finite, non-negative number, or one line naming it.
double figure(const json& j, const char* name, const std::string& path) {
  if (!j.is_object() || !j.contains(name) || !j.at(name).is_number())
    throw std::runtime_error(path + ": not a machine profile ('" + name + "' missing)");
  const double v = j.at(name).get<double>();
  if (!std::isfinite(v) || v < 0)
    throw std::runtime_error(path + ": not a machine profile ('" + name + "' is " +
                             std::to_string(v) + ")");
  return v;
}

// A group size written as a JSON key ("2"), at least `least`; 0 if it is not one.
int ranks_key(const std::string& text, int least) {
  int n = 0;
  try {
    n = std::stoi(text);
  } catch (const std::exception&) {
    return 0;
  }
  return n >= least && std::to_string(n) == text ? n : 0;
}

LinkCost link_from(const json& j, const std::string& path) {
  return {figure(j, "latency_s", path), figure(j, "bytes_per_s", path)};
}

}  // namespace

double MachineProfile::matmul_flops(const std::string& dtype, int threads) const {
  for (const auto& m : matmul) {
    if (m.dtype == dtype && m.threads == threads)
      return m.flops_per_s;
  }
  return 0;
}

std::string machine_key() {
  std::string model = cpuinfo("model name");
  if (model.empty())
    model = "unknown CPU";
  cpu_set_t set;
  CPU_ZERO(&set);
  const int cores = sched_getaffinity(0, sizeof(set), &set) == 0
                        ? CPU_COUNT(&set)
                        : static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  std::istringstream flags(" " + cpuinfo("flags") + " ");
  std::string flag, isa;
  std::vector<std::string> present;
  while (flags >> flag)
    present.push_back(flag);
  for (const char* wanted : {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}) {
    if (std::find(present.begin(), present.end(), wanted) != present.end())
      isa += (isa.empty() ? "" : " ") + std::string(wanted);
  }
  // The variables that cap the kernels ATen and oneDNN pick (how an AVX2-only machine is
  // emulated): a profile measured under them describes another machine.
  for (const char* cap : {"ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"}) {
    if (const char* v = std::getenv(cap); v && *v)
      isa += " " + std::string(cap) + "=" + v;
  }
  return model + " | " + std::to_string(cores) + " cores | " + (isa.empty() ? "no AVX2" : isa);
}

std::string machine_profile_path(const std::string& cache_dir, const std::string& key) {
  std::string slug;
  for (char c : key) {
    const bool keep = std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_';
    if (keep)
      slug += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    else if (!slug.empty() && slug.back() != '-')
      slug += '-';
  }
  while (!slug.empty() && slug.back() == '-')
    slug.pop_back();
  return (std::filesystem::path(cache_dir) / "hardware" / (slug + ".json")).string();
}

void save_machine_profile(const MachineProfile& p, const std::string& path) {
  json j;
  j["key"] = p.key;
  j["measured_at"] = p.measured_at;
  j["matmul"] = json::array();
  for (const auto& m : p.matmul)
    j["matmul"].push_back(
        {{"dtype", m.dtype}, {"threads", m.threads}, {"flops_per_s", m.flops_per_s}});
  j["gloo"] = json::object();
  for (const auto& [ranks, link] : p.gloo) {
    j["gloo"][std::to_string(ranks)] = {{"all_gather", link_json(link.all_gather)},
                                        {"reduce_scatter", link_json(link.reduce_scatter)},
                                        {"all_reduce", link_json(link.all_reduce)}};
  }
  j["unit_overhead"] = json::object();
  for (const auto& [ranks, kinds] : p.unit_overhead) {
    auto& entry = j["unit_overhead"][std::to_string(ranks)];
    entry = json::object();
    for (const auto& [kind, o] : kinds)
      entry[kind] = {{"per_unit_s", o.per_unit_s}, {"per_param_s", o.per_param_s}};
  }
  j["memcpy_bytes_per_s"] = p.memcpy_bytes_per_s;
  j["disk"] = {{"dir", p.disk_dir},
               {"read_bytes_per_s", p.disk.read_bytes_per_s},
               {"write_bytes_per_s", p.disk.write_bytes_per_s}};
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  write_file_atomic(path, j.dump(2) + "\n");
}

std::optional<MachineProfile> load_machine_profile(const std::string& path,
                                                   const std::string& key) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  if (const auto deep = json_too_deep(text.str()); !deep.empty())
    throw std::runtime_error(path + ": not a machine profile (" + deep + ")");
  const json j = json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    throw std::runtime_error(path + ": not a machine profile (not a JSON object)");
  if (!j.contains("key") || !j.at("key").is_string())
    throw std::runtime_error(path + ": not a machine profile ('key' missing)");
  if (j.at("key").get<std::string>() != key)
    return std::nullopt;
  MachineProfile p;
  p.key = key;
  p.measured_at = j.value("measured_at", "");
  if (!j.contains("matmul") || !j.at("matmul").is_array())
    throw std::runtime_error(path + ": not a machine profile ('matmul' missing)");
  for (const auto& m : j.at("matmul")) {
    if (!m.is_object() || !m.contains("dtype") || !m.at("dtype").is_string())
      throw std::runtime_error(path + ": not a machine profile (a matmul rate without a dtype)");
    const double threads = figure(m, "threads", path);
    if (threads < 1 || threads != std::floor(threads))
      throw std::runtime_error(path + ": not a machine profile (a matmul rate's threads)");
    p.matmul.push_back({m.at("dtype").get<std::string>(), static_cast<int>(threads),
                        figure(m, "flops_per_s", path)});
  }
  if (!j.contains("gloo") || !j.at("gloo").is_object())
    throw std::runtime_error(path + ": not a machine profile ('gloo' missing)");
  for (const auto& [ranks, link] : j.at("gloo").items()) {
    const int n = ranks_key(ranks, 2);
    if (n == 0)
      throw std::runtime_error(path + ": not a machine profile (gloo group size '" + ranks + "')");
    if (!link.is_object() || !link.contains("all_gather") || !link.contains("reduce_scatter") ||
        !link.contains("all_reduce"))
      throw std::runtime_error(path + ": not a machine profile (gloo " + ranks +
                               ": a collective missing)");
    p.gloo[n] = {link_from(link.at("all_gather"), path), link_from(link.at("reduce_scatter"), path),
                 link_from(link.at("all_reduce"), path)};
  }
  if (j.contains("unit_overhead")) {
    const auto& all = j.at("unit_overhead");
    if (!all.is_object())
      throw std::runtime_error(path + ": not a machine profile ('unit_overhead' is not an object)");
    for (const auto& [ranks, kinds] : all.items()) {
      const int n = ranks_key(ranks, 1);
      if (n == 0 || !kinds.is_object())
        throw std::runtime_error(path + ": not a machine profile (unit_overhead '" + ranks + "')");
      for (const auto& [kind, o] : kinds.items())
        p.unit_overhead[n][kind] = {figure(o, "per_unit_s", path), figure(o, "per_param_s", path)};
    }
  }
  p.memcpy_bytes_per_s = figure(j, "memcpy_bytes_per_s", path);
  if (!j.contains("disk"))
    throw std::runtime_error(path + ": not a machine profile ('disk' missing)");
  const auto& d = j.at("disk");
  p.disk = {figure(d, "read_bytes_per_s", path), figure(d, "write_bytes_per_s", path)};
  p.disk_dir = d.value("dir", "");
  return p;
}

double measure_memcpy(int64_t bytes) {
  TORCH_CHECK(bytes >= 4096, "fsdp::plan: measure_memcpy size");
  auto src = torch::ones({bytes}, torch::kUInt8);
  auto dst = torch::empty({bytes}, torch::kUInt8);
  dst.copy_(src);  // warm-up: pages faulted in
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    const auto start = Clock::now();
    dst.copy_(src);
    best = std::min(best, seconds_since(start));
  }
  return static_cast<double>(bytes) / std::max(best, 1e-9);
}

DiskRates measure_disk(const std::string& dir, int64_t bytes) {
  TORCH_CHECK(bytes >= (int64_t{8} << 20), "fsdp::plan: measure_disk size");
  std::filesystem::create_directories(dir);
  const std::string path =
      (std::filesystem::path(dir) / ("fsdp-plan-disk-" + std::to_string(getpid()))).string();
  constexpr int64_t kChunk = int64_t{8} << 20;
  bytes = (bytes + kChunk - 1) / kChunk * kChunk;  // whole chunks: the rates divide what moved
  std::vector<char> buffer(static_cast<size_t>(kChunk), 1);
  DiskRates out;
  const int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0)
    throw std::runtime_error("cannot measure the disk in " + dir + ": " + errno_text(errno));
  auto fail = [&](const char* what) {
    const int err = errno;
    ::close(fd);
    std::filesystem::remove(path);
    throw std::runtime_error("cannot measure the disk in " + dir + ": " + what + ": " +
                             errno_text(err));
  };
  auto start = Clock::now();
  for (int64_t done = 0; done < bytes; done += kChunk) {
    if (::write(fd, buffer.data(), static_cast<size_t>(kChunk)) != kChunk)
      fail("write");
  }
  if (::fsync(fd) != 0)
    fail("fsync");
  out.write_bytes_per_s = static_cast<double>(bytes) / std::max(seconds_since(start), 1e-9);
  // Out of the page cache, so the read comes from the disk (clean pages after the fsync).
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  start = Clock::now();
  for (int64_t done = 0; done < bytes; done += kChunk) {
    if (::pread(fd, buffer.data(), static_cast<size_t>(kChunk), done) != kChunk)
      fail("read");
  }
  out.read_bytes_per_s = static_cast<double>(bytes) / std::max(seconds_since(start), 1e-9);
  ::close(fd);
  std::filesystem::remove(path);
  return out;
}

}  // namespace fsdp::plan
