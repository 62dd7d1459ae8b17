// See include/fsdp/plan/hardware.h.
#include <fsdp/plan/hardware.h>

#include <c10/util/Exception.h>

#include <algorithm>

namespace fsdp::plan {
namespace {

constexpr double kGB = 1e9;  // data sheets count bandwidth in powers of ten
constexpr double kT = 1e12;
constexpr double kUs = 1e-6;
constexpr int64_t kGiB = int64_t{1} << 30;

// Latencies are not on data sheets. These are the constants of NCCL's own cost model for ring
// collectives with the Simple protocol (NVIDIA/nccl src/graph/tuning.cc): a base of 8.4 us per
// call plus, per ring step, 3.4 us over NVLink, 5.7 us over PCIe, 14 us over the network.
constexpr double kNvlinkHop = 3.4 * kUs;
constexpr double kPcieHop = 5.7 * kUs;
constexpr double kNetHop = 14 * kUs;
constexpr double kNcclBaseLatency = 8.4 * kUs;

std::vector<DeviceProfile> make_devices() {
  std::vector<DeviceProfile> out;
  // A100 SXM (data sheet: 312 TFLOPS dense BF16, 19.5 FP32; 1,555 / 2,039 GB/s; NVLink 600 GB/s
  // counting both directions; PCIe Gen4 x16 "64 GB/s", both directions). Memory: what the
  // device reports (deviceQuery: 42,405,855,232 and 85,198,045,184 bytes). A DGX A100 has one
  // 200 Gb/s HDR InfiniBand port per GPU (8x ConnectX-6) and 2 AMD EPYC 7742 hosts (8 channels
  // of DDR4-3200: 204.8 GB/s per socket, shared by 4 GPUs).
  const std::string a100_source =
      "NVIDIA A100 Tensor Core GPU data sheet (nvidia.com/content/dam/en-zz/Solutions/"
      "Data-Center/a100/pdf/nvidia-a100-datasheet-nvidia-us-2188504-web.pdf); NVIDIA DGX A100 "
      "specifications (nvidia.com/en-us/data-center/dgx-a100/); AMD EPYC 7742 specifications";
  DeviceProfile a100_40{"a100-40gb", "NVIDIA A100 40GB SXM4 (DGX A100)",
                        42405855232, 1555 * kGB,
                        19.5 * kT,   312 * kT,
                        300 * kGB,   25 * kGB,
                        kNvlinkHop,  kNetHop,
                        32 * kGB,    204.8 * kGB / 4,
                        a100_source};
  out.push_back(a100_40);
  DeviceProfile a100_80 = a100_40;
  a100_80.name = "a100-80gb";
  a100_80.description = "NVIDIA A100 80GB SXM4 (DGX A100)";
  a100_80.memory_bytes = 85198045184;
  a100_80.memory_bytes_per_s = 2039 * kGB;
  out.push_back(a100_80);
  // H100 SXM5: 1,979 TFLOPS BF16 is with sparsity, 989.4 dense; 67 FP32; 3.35 TB/s; NVLink 900
  // GB/s both directions; PCIe Gen5 x16 "128 GB/s" both directions. Memory: 80 GiB nominal. A
  // DGX H100 has one 400 Gb/s ConnectX-7 port per GPU and 2 Xeon Platinum 8480C hosts (8
  // channels of DDR5-4800: 307.2 GB/s per socket, shared by 4 GPUs).
  out.push_back({"h100-80gb", "NVIDIA H100 80GB SXM5 (DGX H100)", 80 * kGiB, 3350 * kGB, 67 * kT,
                 989.4 * kT, 450 * kGB, 50 * kGB, kNvlinkHop, kNetHop, 64 * kGB, 307.2 * kGB / 4,
                 "NVIDIA H100 Tensor Core GPU product page and data sheet "
                 "(nvidia.com/en-us/data-center/h100/); NVIDIA DGX H100 user guide and DGX "
                 "BasePOD reference architecture (8x ConnectX-7 400 Gb/s); Intel Xeon Platinum "
                 "8480C specifications"});
  // H200 SXM: the H100's compute (989.4 TFLOPS dense BF16, 67 FP32), 141 GB of HBM3e at 4.8
  // TB/s, the same NVLink, network and PCIe as a DGX H100. Memory: the 143,771 MiB nvidia-smi
  // reports on the H200 machines our GPU checks run on (docs/gpu.md).
  out.push_back({"h200", "NVIDIA H200 141GB SXM (DGX H200)", 143771 * (int64_t{1} << 20),
                 4800 * kGB, 67 * kT, 989.4 * kT, 450 * kGB, 50 * kGB, kNvlinkHop, kNetHop,
                 64 * kGB, 307.2 * kGB / 4,
                 "NVIDIA H200 Tensor Core GPU product page and data sheet "
                 "(nvidia.com/en-us/data-center/h200/); NVIDIA DGX H200 specifications"});
  // L40S: 362.05 TFLOPS BF16 dense (733 with sparsity), 91.6 FP32, 864 GB/s, no NVLink: peers
  // talk over PCIe Gen4 x16 ("64 GB/s bidirectional"). Memory: 48 GiB nominal. No standard
  // multi-node system.
  out.push_back({"l40s", "NVIDIA L40S 48GB (PCIe)", 48 * kGiB, 864 * kGB, 91.6 * kT, 362.05 * kT,
                 32 * kGB, 0, kPcieHop, 0, 32 * kGB, 0,
                 "NVIDIA L40S data sheet (nvidia.com/en-us/data-center/l40s/)"});
  // RTX 4090: BF16 with FP32 accumulate 165.2 TFLOPS dense (the 330.3 figure accumulates in
  // FP16, 330.4 is with sparsity), 82.6 FP32, 1,008 GB/s; no NVLink, PCIe Gen4 x16. Memory: 24
  // GiB nominal.
  out.push_back({"rtx-4090", "NVIDIA GeForce RTX 4090 24GB (PCIe)", 24 * kGiB, 1008 * kGB,
                 82.6 * kT, 165.2 * kT, 32 * kGB, 0, kPcieHop, 0, 32 * kGB, 0,
                 "NVIDIA Ada GPU Architecture whitepaper, appendix A, table 2 "
                 "(images.nvidia.com/aem-dam/Solutions/geforce/ada/"
                 "nvidia-ada-gpu-architecture.pdf)"});
  return out;
}

}  // namespace

double DeviceProfile::flops(torch::ScalarType dtype) const {
  return dtype == torch::kFloat32 ? fp32_flops : bf16_flops;
}

const std::vector<DeviceProfile>& builtin_devices() {
  static const std::vector<DeviceProfile> devices = make_devices();
  return devices;
}

const DeviceProfile& builtin_device(const std::string& name) {
  std::string known;
  for (const auto& d : builtin_devices()) {
    if (d.name == name)
      return d;
    known += (known.empty() ? "" : ", ") + d.name;
  }
  TORCH_CHECK(false, "unknown hardware profile '", name, "' (known: ", known, ")");
}

ComputeTimes flop_compute_times(const PieceFlops& f, double rate) {
  TORCH_CHECK(rate > 0, "fsdp::plan: flop_compute_times needs a positive FLOP/s rate");
  ComputeTimes out;
  out.pre = {f.pre / rate, 2 * f.pre / rate};
  out.post = {f.post / rate, 2 * f.post / rate};
  const double forward = f.block / rate;
  out.block[static_cast<size_t>(CheckpointMode::kNone)] = {forward, 2 * forward};
  out.block[static_cast<size_t>(CheckpointMode::kFull)] = {forward, 3 * forward};
  out.block[static_cast<size_t>(CheckpointMode::kSelective)] = {
      forward, 2 * forward + f.block_selective / rate};
  return out;
}

LinkProfile device_link(const DeviceProfile& d, int n, bool across_nodes) {
  LinkProfile out;
  if (n <= 1)
    return out;
  TORCH_CHECK(!across_nodes || d.inter_node_bytes_per_s > 0, "hardware profile '", d.name,
              "' describes no multi-node system (no inter-node link)");
  const double link = across_nodes ? std::min(d.intra_node_bytes_per_s, d.inter_node_bytes_per_s)
                                   : d.intra_node_bytes_per_s;
  // Ring: each rank moves (n-1)/n of the gathered bytes; an all-reduce is a reduce-scatter then
  // an all-gather. Per call: NCCL's base latency, and each of the n-1 steps pays a hop (one
  // of them across the network when the ring spans nodes; NCCL's model counts one per node).
  const double hops = across_nodes ? (n - 2) * d.intra_node_latency_s + d.inter_node_latency_s
                                   : (n - 1) * d.intra_node_latency_s;
  const double share = static_cast<double>(n - 1) / n;
  const LinkCost one{kNcclBaseLatency + hops, link / share};
  out.all_gather = out.reduce_scatter = one;
  out.all_reduce = {kNcclBaseLatency + 2 * hops, link / (2 * share)};
  return out;
}

}  // namespace fsdp::plan
