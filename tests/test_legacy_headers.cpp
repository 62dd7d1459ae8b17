// The public headers' paths from before the subsystem folders still compile, for one release:
// each forwards to the new header (and warns: compiled with -w here, on purpose).
#include <fsdp/checkpoint.h>
#include <fsdp/comm_stats.h>
#include <fsdp/consolidated.h>
#include <fsdp/cuda.h>
#include <fsdp/durable_file.h>
#include <fsdp/fused_optimizer.h>
#include <fsdp/memory.h>
#include <fsdp/nf4.h>
#include <fsdp/process_group.h>
#include <fsdp/safetensors.h>
#include <fsdp/sharded_checkpoint.h>
#include <fsdp/step_profiler.h>
#include <fsdp/tensor_visit.h>

#include <gtest/gtest.h>

namespace {

TEST(LegacyHeaders, OldPathsDeclareTheSameApi) {
  // One name from each forwarded header, reached through the old path alone.
  EXPECT_STREQ(fsdp::to_string(fsdp::CheckpointMode::kFull), "full");
  EXPECT_EQ(fsdp::CommStats{}.all_gather.calls, 0);
  EXPECT_TRUE(fsdp::ConsolidatedOptions{}.extra_tensors.empty());
  // fsdp/cuda.h declares register_nccl_backend (defined in fsdp::cuda, not linked here).
  void (*atomic_write)(const std::string&, std::string_view) = &fsdp::write_file_atomic;
  EXPECT_NE(atomic_write, nullptr);
  EXPECT_EQ(fsdp::OptimizerStateOptions{}.moments_dtype(), torch::kFloat32);
  EXPECT_GE(fsdp::memory::kNumCategories, 1);
  EXPECT_EQ(fsdp::nf4::values().size(), 16u);
  EXPECT_EQ(fsdp::ProcessGroupOptions{}.backend(), "gloo");
  EXPECT_EQ(fsdp::safetensors::dtype_name(torch::kFloat), "F32");
  auto* save = &fsdp::save_sharded;
  EXPECT_NE(save, nullptr);
  EXPECT_EQ(fsdp::StepBreakdown{}.step_s, 0);
}

}  // namespace
