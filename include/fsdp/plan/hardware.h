// What an accelerator can do, for predicting a step where it was not measured (fsdp::plan,
// issue 26): built-in profiles of common GPUs from their vendors' data sheets, and the model
// that turns a profile into TimeInputs: compute as FLOPs over the dense matmul rate, collectives
// as ring algorithms over the link's bandwidth, the optimizer as bytes over memory bandwidth.
//
// A profile's figures are data-sheet peaks, so what it predicts is what the hardware allows: a
// lower bound on the step time and an upper bound on tokens/s. `efficiency` scales the matmul
// rate (model FLOP utilisation) for an estimate instead of a bound; docs/planner.md works the
// seeds' 13B-on-4xA100 and 70B-on-2x8xH100 cases with both. None of this has run on a GPU: on
// this project's machines the step time comes from measurement (step_time.h, machine_profile.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <fsdp/plan/step_time.h>

namespace fsdp::plan {

struct DeviceProfile {
  std::string name;  // what --hardware takes: "a100-80gb"
  std::string description;
  int64_t memory_bytes = 0;
  double memory_bytes_per_s = 0;  // device memory bandwidth
  double fp32_flops = 0;          // dense, non-tensor-core FP32
  double bf16_flops = 0;          // dense BF16 tensor-core rate, FP32 accumulate
  /// Each GPU's bandwidth in one direction to its peers: inside a node (NVLink, or PCIe where
  /// there is none) and between nodes (its share of the node's InfiniBand NICs; 0: the profile
  /// describes no multi-node system).
  double intra_node_bytes_per_s = 0;
  double inter_node_bytes_per_s = 0;
  /// Latency per ring step inside a node and across the network (not on data sheets: NCCL's
  /// cost-model constants, hardware.cpp).
  double intra_node_latency_s = 0;
  double inter_node_latency_s = 0;
  /// Device <-> host, one direction (PCIe): CPU offload's copies.
  double host_bytes_per_s = 0;
  /// The host's memory bandwidth available to this GPU's share of the host CPUs: the optimizer
  /// step when it runs there (CPU offload). 0: unknown.
  double host_memory_bytes_per_s = 0;
  /// Where each figure comes from.
  std::string source;

  double flops(torch::ScalarType dtype) const;
};

/// A100 40 GB and 80 GB SXM (in a DGX A100), H100 80 GB SXM (in a DGX H100), H200 (in a DGX
/// H200), L40S, RTX 4090.
const std::vector<DeviceProfile>& builtin_devices();
/// The built-in profile named `name`; throws naming the known ones.
const DeviceProfile& builtin_device(const std::string& name);

/// Forward FLOPs of one micro-batch through each piece of the chain (activations.h): the part
/// before the blocks (embeddings: usually none), one block, the rest (final norm, head, loss).
struct PieceFlops {
  double pre = 0, block = 0, post = 0;
  /// Of a block's forward, what selective checkpointing runs again in backward.
  double block_selective = 0;
};

/// Seconds of each piece at `flops_per_s`: a forward is its FLOPs, a backward twice them (the
/// input and the weight gradients), plus a block's forward again under full checkpointing and
/// its selective part under selective checkpointing.
ComputeTimes flop_compute_times(const PieceFlops& flops, double flops_per_s);

/// The collectives of a group of `group_size` ranks on `device`, as ring algorithms: an
/// all-gather or reduce-scatter moves (n-1)/n of its CommStats bytes through each rank's link,
/// an all-reduce twice that. `across_nodes`: the ring crosses nodes, so its slowest link is the
/// InfiniBand one (throws if the profile has none).
LinkProfile device_link(const DeviceProfile& device, int group_size, bool across_nodes);

}  // namespace fsdp::plan
