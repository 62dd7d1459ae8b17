// Consolidated files (include/fsdp/checkpoint/consolidated.h): one safetensors file of whole
// tensors from a sharded model, the same bytes whatever the number of ranks or the strategy that
// saved it; loaded back on 1-4 ranks (and under no_shard) bitwise; layouts that rename, transpose
// and reorder rows written and read exactly; a lower stored dtype; and a file that does not fit the
// model refused with the file, the tensor and the reason named.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <tuple>

#include <fsdp/checkpoint/consolidated.h>
#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/fsdp.h>

#include "harness/errors.h"
#include "harness/files.h"
#include "harness/multiprocess.h"
#include "harness/sharding.h"
#include "harness/small_net.h"

namespace {

namespace fs = std::filesystem;

using Net = fsdp::test::SmallNet;

// Known global values per parameter, distinct in every element.
torch::Tensor pattern(const std::string& name, at::IntArrayRef shape) {
  const auto h = static_cast<double>(std::hash<std::string>{}(name) % 97);
  return (torch::arange(c10::multiply_integers(shape), torch::kFloat) * 0.37 + h).view(shape);
}

// b.weight (5 rows) stored with its rows in this order: file row file_row[r] is our row r.
const std::vector<int64_t> kBRows = {3, 0, 4, 1, 2};

fsdp::ConsolidatedOptions layout_options() {
  fsdp::ConsolidatedOptions o;
  o.layout = [](const std::string& name, c10::IntArrayRef) {
    fsdp::TensorLayout l{"net." + name};
    if (name == "a.weight")
      l.kind = fsdp::TensorLayout::Kind::kTransposed;
    if (name == "b.weight") {
      l.kind = fsdp::TensorLayout::Kind::kRowPermuted;
      l.file_row = kBRows;
    }
    return l;
  };
  o.extra_tensors["net.constant"] = torch::arange(4, torch::kLong);
  o.metadata["made_by"] = "test";
  return o;
}

// What the file holds for each parameter under layout_options(), computed here apart from the
// library.
std::map<std::string, torch::Tensor> expected_file(const Net& net) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : net->named_parameters()) {
    auto v = pattern(p.key(), p.value().sizes());
    if (p.key() == "a.weight")
      v = v.t().contiguous();
    if (p.key() == "b.weight") {
      auto permuted = torch::empty_like(v);
      for (size_t r = 0; r < kBRows.size(); ++r)
        permuted[kBRows[r]] = v[static_cast<int64_t>(r)];
      v = permuted;
    }
    out["net." + p.key()] = v;
  }
  out["net.constant"] = torch::arange(4, torch::kLong);
  return out;
}

Net sharded_net(const std::shared_ptr<fsdp::ProcessGroup>& pg, const std::string& strategy) {
  torch::manual_seed(1);
  Net net;
  if (pg && strategy != "none") {
    fsdp::FullyShardOptions opts(pg);
    if (strategy == "no_shard")
      opts.strategy(fsdp::ShardingStrategy::kNoShard);
    if (strategy == "hybrid")
      opts.strategy(fsdp::ShardingStrategy::kHybridShard).hybrid_shard_size(2);
    fsdp::fully_shard(net->a, opts);
    fsdp::fully_shard(net, opts);
  }
  return net;
}

FSDP_WORKER(consolidated_save) {
  auto pg = fsdp::init_process_group();
  auto net = sharded_net(pg, ctx.env("STRATEGY", "full_shard"));
  {
    torch::NoGradGuard no_grad;
    for (auto& s : fsdp::param_shards(*net)) {
      auto full = pattern(s.name, s.global_shape);
      s.shard.copy_(fsdp::test::rows_held(full, s));
    }
  }
  auto options = layout_options();
  if (ctx.env("DTYPE") == "bf16")
    options.dtype = torch::kBFloat16;
  options.io_buffer_bytes = ctx.env_int("IO_BUFFER", options.io_buffer_bytes);
  fsdp::save_consolidated(ctx.env("FILE"), *net, *pg, options);
  // Every rank returns once the file is complete.
  WORKER_CHECK(fs::exists(ctx.env("FILE")));
  return 0;
}

FSDP_WORKER(consolidated_load) {
  auto pg = fsdp::init_process_group();
  auto net = sharded_net(pg, ctx.env("STRATEGY", "full_shard"));
  auto options = layout_options();
  options.io_buffer_bytes = ctx.env_int("IO_BUFFER", options.io_buffer_bytes);
  auto meta = fsdp::load_consolidated(ctx.env("FILE"), *net, options);
  WORKER_CHECK(meta.at("made_by") == "test");
  const bool bf16 = ctx.env("DTYPE") == "bf16";
  for (auto& s : fsdp::param_shards(*net)) {
    auto full = pattern(s.name, s.global_shape);
    if (bf16)
      full = full.to(torch::kBFloat16).to(torch::kFloat);
    auto want = fsdp::test::rows_held(full, s);
    WORKER_CHECK(torch::equal(s.shard, want)) << s.name << " on rank " << pg->rank();
  }
  return 0;
}

TEST(ConsolidatedFile, SameBytesFromAnyRanksAndLoadsOnAny) {
  const auto root = fsdp::test::fresh_dir("consolidated-matrix");
  const auto reference = (root / "one.safetensors").string();
  EXPECT_WORKERS_OK(
      fsdp::test::run_workers("consolidated_save", 1, fsdp::test::with_env({{"FILE", reference}})));
  // The file, read by the reader alone: every tensor as computed here.
  {
    fsdp::safetensors::Reader r(reference);
    const auto want = expected_file(Net());
    ASSERT_EQ(r.header().tensors.size(), want.size());
    for (const auto& [name, t] : want)
      EXPECT_TRUE(torch::equal(r.read(name), t)) << name;
    EXPECT_EQ(r.header().metadata.at("made_by"), "test");
  }
  // An I/O buffer of 40 bytes sends and reads one or two rows at a time.
  const std::vector<std::tuple<int, std::string, std::string>> savers = {
      {2, "full_shard", ""},   {3, "full_shard", ""}, {4, "full_shard", ""},
      {3, "full_shard", "40"}, {2, "no_shard", ""},   {4, "hybrid", ""}};
  for (const auto& [n, strategy, buffer] : savers) {
    const auto file =
        (root / (strategy + "-" + std::to_string(n) + buffer + ".safetensors")).string();
    auto vars = fsdp::test::with_env({{"FILE", file}, {"STRATEGY", strategy}});
    if (!buffer.empty())
      vars.env.emplace_back("IO_BUFFER", buffer);
    EXPECT_WORKERS_OK(fsdp::test::run_workers("consolidated_save", n, vars));
    EXPECT_TRUE(fsdp::test::file_bytes(file) == fsdp::test::file_bytes(reference))
        << strategy << " on " << n;
    EXPECT_FALSE(fs::exists(file + ".tmp"));
  }
  for (int m : {1, 2, 3, 4})
    EXPECT_WORKERS_OK(fsdp::test::run_workers("consolidated_load", m,
                                              fsdp::test::with_env({{"FILE", reference}})));
  EXPECT_WORKERS_OK(fsdp::test::run_workers(
      "consolidated_load", 2,
      fsdp::test::with_env({{"FILE", reference}, {"STRATEGY", "no_shard"}})));
  EXPECT_WORKERS_OK(fsdp::test::run_workers(
      "consolidated_load", 1, fsdp::test::with_env({{"FILE", reference}, {"STRATEGY", "none"}})));
  EXPECT_WORKERS_OK(fsdp::test::run_workers(
      "consolidated_load", 3, fsdp::test::with_env({{"FILE", reference}, {"IO_BUFFER", "40"}})));
  fs::remove_all(root);
}

TEST(ConsolidatedFile, StoredInALowerDtype) {
  const auto root = fsdp::test::fresh_dir("consolidated-bf16");
  const auto file = (root / "bf16.safetensors").string();
  EXPECT_WORKERS_OK(fsdp::test::run_workers(
      "consolidated_save", 3, fsdp::test::with_env({{"FILE", file}, {"DTYPE", "bf16"}})));
  fsdp::safetensors::Reader r(file);
  EXPECT_EQ(r.entry("net.a.weight").dtype, torch::kBFloat16);
  EXPECT_EQ(r.entry("net.constant").dtype, torch::kLong);  // not a parameter: as given
  // 175 parameter values in 2 bytes each, 4 int64 constants.
  EXPECT_EQ(r.header().data_bytes, 175u * 2 + 4 * 8);
  EXPECT_WORKERS_OK(fsdp::test::run_workers(
      "consolidated_load", 2, fsdp::test::with_env({{"FILE", file}, {"DTYPE", "bf16"}})));
  // bf16 into fp32 parameters goes through the staging buffer: a small one, a row at a time.
  EXPECT_WORKERS_OK(fsdp::test::run_workers(
      "consolidated_load", 3,
      fsdp::test::with_env({{"FILE", file}, {"DTYPE", "bf16"}, {"IO_BUFFER", "20"}})));
  fs::remove_all(root);
}

TEST(ConsolidatedFile, AFileThatDoesNotFitIsRefusedNamingIt) {
  const auto root = fsdp::test::fresh_dir("consolidated-refused");
  const auto file = (root / "net.safetensors").string();
  EXPECT_WORKERS_OK(
      fsdp::test::run_workers("consolidated_save", 2, fsdp::test::with_env({{"FILE", file}})));
  Net net;
  // Under its own names the file lacks what the layout maps to.
  auto missing = fsdp::test::error_of([&] { fsdp::load_consolidated(file, *net); });
  EXPECT_NE(missing.find(file), std::string::npos) << missing;
  EXPECT_NE(missing.find("no tensor 'gain' for parameter 'gain'"), std::string::npos) << missing;
  // Another shape.
  auto wrong = layout_options();
  wrong.layout = [](const std::string& name, c10::IntArrayRef) {
    return fsdp::TensorLayout{"net." + name};  // a.weight not transposed: [13, 7] vs [7, 13]
  };
  auto shape = fsdp::test::error_of([&] { fsdp::load_consolidated(file, *net, wrong); });
  EXPECT_NE(shape.find("'net.a.weight' (parameter 'a.weight') has shape [7, 13], the model "
                       "expects [13, 7]"),
            std::string::npos)
      << shape;
  // An integer tensor where a parameter should be.
  auto ints = layout_options();
  ints.layout = [base = layout_options().layout](const std::string& name, c10::IntArrayRef s) {
    auto l = base(name, s);
    if (name == "gain")
      l.name = "net.constant";
    return l;
  };
  auto dtype = fsdp::test::error_of([&] { fsdp::load_consolidated(file, *net, ints); });
  EXPECT_NE(dtype.find("is I64, not a floating-point type"), std::string::npos) << dtype;
  // A row order that is not a permutation (a programming error, caught before any read).
  auto bad = layout_options();
  bad.layout = [base = layout_options().layout](const std::string& name, c10::IntArrayRef s) {
    auto l = base(name, s);
    if (name == "b.weight")
      l = {"net." + name, fsdp::TensorLayout::Kind::kRowPermuted, {0, 0, 1, 2, 3}};
    return l;
  };
  auto perm = fsdp::test::error_of([&] { fsdp::load_consolidated(file, *net, bad); });
  EXPECT_NE(perm.find("the row order of parameter 'b.weight' is not a permutation"),
            std::string::npos)
      << perm;
  // Never overwritten.
  EXPECT_FALSE(
      fsdp::test::run_workers("consolidated_save", 1, fsdp::test::with_env({{"FILE", file}})).ok());
  // A truncated file.
  fs::resize_file(file, fs::file_size(file) - 3);
  auto truncated =
      fsdp::test::error_of([&] { fsdp::load_consolidated(file, *net, layout_options()); });
  EXPECT_NE(truncated.find(file), std::string::npos) << truncated;
  fs::remove_all(root);
}

}  // namespace
