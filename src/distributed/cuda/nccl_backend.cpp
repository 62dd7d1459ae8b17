// "nccl" for init_process_group(): ProcessGroupNCCL on device LOCAL_RANK. Run on one H200 at
// world size 1 (docs/gpu.md).
#include <fsdp/distributed/cuda.h>
#include <fsdp/distributed/process_group.h>

#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

namespace fsdp {

void register_nccl_backend() {
  register_backend("nccl", [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                              const ProcessGroupOptions& options) {
    const int device = launch_env_from_environment().local_rank;
    TORCH_CHECK(device < c10::cuda::device_count(), "[rank ", rank, "] LOCAL_RANK ", device,
                " but only ", static_cast<int>(c10::cuda::device_count()),
                " CUDA device(s) are visible");
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = options.timeout();
    auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
    // Binding the device lets NCCL create its communicator eagerly and fail fast.
    const c10::Device bound(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
    backend->setBoundDeviceId(bound);
    backend->eagerConnectSingleDevice(bound);
    return c10::static_intrusive_pointer_cast<c10d::Backend>(backend);
  });
}

}  // namespace fsdp
