// Every collective goes through one door (fsdp/distributed/collectives.h): the traffic of code
// outside the engine (a consolidated save, a merged LoRA export) is counted exactly in the
// group's CommStats and passes the collective-sequence check. Counted bytes are compared with
// what the saved tensors and the adapters weigh, computed from the model alone.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include <fsdp/fsdp.h>

#include "gpt.h"
#include "harness/files.h"
#include "harness/multiprocess.h"
#include "llama.h"
#include "lora.h"
#include "peft.h"

namespace {

using fsdp_models::GPT;
using fsdp_models::GPTConfig;
using fsdp_models::Llama;
using fsdp_models::LlamaConfig;

// Bytes of the rows this rank writes (as first holder) of every parameter, and of all rows.
struct SavedBytes {
  int64_t mine = 0;
  int64_t all = 0;
};

SavedBytes saved_bytes(torch::nn::Module& model) {
  SavedBytes b;
  for (const auto& s : fsdp::param_shards(model)) {
    int64_t global = s.shard.element_size();
    for (auto d : s.global_shape)
      global *= d;
    const int64_t global_rows = s.global_shape.empty() ? 1 : s.global_shape[0];
    b.all += global;
    if (s.writer && global_rows > 0)
      b.mine += global / global_rows * s.rows;
  }
  return b;
}

FSDP_WORKER(comm_accounting) {
  auto pg = fsdp::init_process_group();
  WORKER_CHECK(pg->checks_collectives()) << "FSDP_CHECK_COLLECTIVES=1 was not picked up";
  const int rank = pg->rank(), world = pg->size();
  fsdp::test::TempDir dir("comm_accounting");

  // save_consolidated: an all-gather of the (first row, rows) table, every other rank's rows
  // sent to rank 0, a barrier.
  auto cfg = GPTConfig::preset("gpt2-test");
  torch::manual_seed(3);
  GPT gpt(cfg);
  fsdp_models::parallelize_gpt(gpt, fsdp::FullyShardOptions(pg));
  const auto n_params = static_cast<int64_t>(gpt->parameters().size());
  const auto bytes = saved_bytes(*gpt);
  const fsdp::CommStats before = pg->comm_stats();
  fsdp::save_consolidated(dir.path() + "/gpt.safetensors", *gpt, *pg);
  const fsdp::CommStats d = pg->comm_stats() - before;
  WORKER_CHECK(d.all_gather.calls == 1 && d.all_gather.bytes == n_params * 2 * 8 * world)
      << "table all-gather: " << d.all_gather.calls << " calls, " << d.all_gather.bytes << " B";
  const int64_t p2p = rank == 0 ? bytes.all - bytes.mine : bytes.mine;
  WORKER_CHECK(d.point_to_point.bytes == p2p)
      << "point-to-point " << d.point_to_point.bytes << " B, the rows weigh " << p2p;
  WORKER_CHECK(d.point_to_point.sent_bytes == (rank == 0 ? 0 : p2p));
  WORKER_CHECK(d.barrier.calls == 1) << d.barrier.calls << " barriers";
  WORKER_CHECK(d.reduce_scatter.calls == 0 && d.all_reduce.calls == 0 && d.broadcast.calls == 0);

  // save_merged_hf: one all-reduce per adapted layer assembles its lora_A (rank x in, fp32).
  auto lcfg = LlamaConfig::preset("llama-test");
  torch::manual_seed(4);
  Llama llama(lcfg);
  const auto adapted =
      fsdp_models::add_lora(*llama, "wq|wv", fsdp_models::LoraOptions().rank(4).alpha(8));
  int64_t a_bytes = 0;
  for (const auto& item : llama->named_parameters()) {
    if (item.key().find(".lora_A.") != std::string::npos)
      a_bytes += item.value().numel() * 4;
  }
  fsdp_models::parallelize_llama(llama, fsdp::FullyShardOptions(pg));
  const fsdp::CommStats before_merge = pg->comm_stats();
  fsdp_models::save_merged_hf(dir.path() + "/merged", llama, *pg);
  const fsdp::CommStats m = pg->comm_stats() - before_merge;
  WORKER_CHECK(m.all_reduce.calls == static_cast<int64_t>(adapted.size()) &&
               m.all_reduce.bytes == a_bytes)
      << m.all_reduce.calls << " all-reduces of " << m.all_reduce.bytes << " B for "
      << adapted.size() << " adapted layers of " << a_bytes << " B of lora_A";
  std::printf(
      "[rank %d/%d] ACCOUNTING OK: consolidated save %lld B point-to-point, merged "
      "export %zu all-reduces, %lld B\n",
      rank, world, (long long)d.point_to_point.bytes, adapted.size(),
      (long long)m.all_reduce.bytes);
  return 0;
}

TEST(CommAccounting, SavesAndExportsAreCountedExactlyUnderTheSequenceCheck) {
  fsdp::test::RunOptions opts;
  opts.env = {{"FSDP_CHECK_COLLECTIVES", "1"}};
  EXPECT_WORKERS_OK(fsdp::test::run_workers("comm_accounting", 3, opts));
}

}  // namespace
