// Sharded checkpoints (include/fsdp/checkpoint/sharded_checkpoint.h): the reshard matrix (saved on
// 1-4 ranks, loaded on 1-4 and under no_shard; parameters and AdamW state bitwise equal to the
// saved global tensors), and nothing lost: a flipped byte, a truncated file or a tampered
// index is refused with the file and the tensor named; a save that died half-way (its .tmp
// directory) never replaces or hides the previous checkpoint.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <tuple>

#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/checkpoint/sharded_checkpoint.h>
#include <fsdp/fsdp.h>
#include <fsdp/state_dict.h>

#include "checkpoint/checkpoint_index.h"
#include "checkpoint/sharded_checkpoint_hooks.h"
#include "harness/files.h"
#include "harness/multiprocess.h"
#include "harness/sharding.h"
#include "harness/small_net.h"

namespace {

namespace fs = std::filesystem;

using Net = fsdp::test::SmallNet;
using Json = nlohmann::json;

// Known global values per tensor: a checkpoint restored on any number of ranks must give
// exactly these rows on each.
torch::Tensor pattern(const std::string& name, int which, at::IntArrayRef shape) {
  const auto h = static_cast<double>(std::hash<std::string>{}(name) % 97);
  return (torch::arange(c10::multiply_integers(shape), torch::kFloat) * 0.25 + h + 1000 * which)
      .view(shape);
}

Net sharded_net(const std::shared_ptr<fsdp::ProcessGroup>& pg, const std::string& strategy) {
  torch::manual_seed(1);
  Net net;
  if (pg && strategy != "none") {
    fsdp::FullyShardOptions opts(pg);
    if (strategy == "no_shard")
      opts.strategy(fsdp::ShardingStrategy::kNoShard);
    fsdp::fully_shard(net->a, opts);
    fsdp::fully_shard(net, opts);
  }
  return net;
}

// The rows this rank holds of each global tensor, by the library's own account.
void fill_with_patterns(Net& net, torch::optim::AdamW& opt) {
  torch::NoGradGuard no_grad;
  auto params = net->named_parameters();
  for (auto& s : fsdp::param_shards(*net)) {
    auto rows = [&](int which) {
      auto full = pattern(s.name, which, s.global_shape);
      return fsdp::test::rows_held(full, s);
    };
    s.shard.copy_(rows(0));
    const auto& p = params[s.name];
    auto st = std::make_unique<torch::optim::AdamWParamState>();
    st->step(7);
    st->exp_avg(rows(1).view(p.sizes()).clone());
    st->exp_avg_sq(rows(2).view(p.sizes()).clone());
    opt.state()[p.unsafeGetTensorImpl()] = std::move(st);
  }
}

void check_patterns(Net& net, torch::optim::AdamW& opt, const std::string& where) {
  auto params = net->named_parameters();
  for (auto& s : fsdp::param_shards(*net)) {
    auto rows = [&](int which) {
      auto full = pattern(s.name, which, s.global_shape);
      return fsdp::test::rows_held(full, s);
    };
    WORKER_CHECK(torch::equal(s.shard, rows(0))) << where << " " << s.name;
    const auto& p = params[s.name];
    auto it = opt.state().find(p.unsafeGetTensorImpl());
    WORKER_CHECK(it != opt.state().end()) << where << " no state for " << s.name;
    auto& st = static_cast<torch::optim::AdamWParamState&>(*it->second);
    WORKER_CHECK(st.step() == 7);
    WORKER_CHECK(torch::equal(st.exp_avg().reshape({-1}), rows(1).reshape({-1})))
        << where << " exp_avg " << s.name;
    WORKER_CHECK(torch::equal(st.exp_avg_sq().reshape({-1}), rows(2).reshape({-1})))
        << where << " exp_avg_sq " << s.name;
  }
}

FSDP_WORKER(ckpt_save) {
  auto pg = fsdp::init_process_group();
  auto net = sharded_net(pg, ctx.env("STRATEGY", "full_shard"));
  torch::optim::AdamW opt(net->parameters());
  fill_with_patterns(net, opt);
  fsdp::save_sharded(ctx.env("DIR"), *net, &opt, *pg, {{"step", "42"}});
  return 0;
}

FSDP_WORKER(ckpt_load) {
  auto pg = fsdp::init_process_group();
  auto net = sharded_net(pg, ctx.env("STRATEGY", "full_shard"));
  torch::optim::AdamW opt(net->parameters());
  auto meta = fsdp::load_sharded(ctx.env("DIR"), *net, &opt);
  WORKER_CHECK(meta.at("step") == "42");
  check_patterns(net, opt, "loaded on " + std::to_string(pg->size()));
  // The loaded optimizer steps like any other.
  auto out = fsdp::forward(net->a, torch::randn({3, 7}));
  net->b(out).sum().backward();
  opt.step();
  return 0;
}

TEST(ShardedCheckpoint, SavedOnNLoadsOnM) {
  auto root = fsdp::test::fresh_dir("ckpt-matrix");
  for (int n : {1, 2, 3, 4}) {
    const auto dir = (root / ("saved-on-" + std::to_string(n))).string();
    EXPECT_WORKERS_OK(
        fsdp::test::run_workers("ckpt_save", n, fsdp::test::with_env({{"DIR", dir}})));
    ASSERT_TRUE(fs::exists(fs::path(dir) / "index.json"));
    EXPECT_FALSE(fs::exists(dir + ".tmp"));
    for (int m : {1, 2, 3, 4})
      EXPECT_WORKERS_OK(
          fsdp::test::run_workers("ckpt_load", m, fsdp::test::with_env({{"DIR", dir}})));
    EXPECT_WORKERS_OK(fsdp::test::run_workers(
        "ckpt_load", 2, fsdp::test::with_env({{"DIR", dir}, {"STRATEGY", "no_shard"}})));
  }
  // Saved under no_shard (one writer per row), loaded sharded on 3.
  const auto dir = (root / "no-shard").string();
  EXPECT_WORKERS_OK(fsdp::test::run_workers(
      "ckpt_save", 2, fsdp::test::with_env({{"DIR", dir}, {"STRATEGY", "no_shard"}})));
  EXPECT_WORKERS_OK(fsdp::test::run_workers("ckpt_load", 3, fsdp::test::with_env({{"DIR", dir}})));
  fs::remove_all(root);
}

// A plain (unsharded) process: save with a group of one, then damage copies of the result.
std::string load_error(const fs::path& dir) {
  torch::manual_seed(1);
  Net net;
  torch::optim::AdamW opt(net->parameters());
  try {
    fsdp::load_sharded(dir.string(), *net, &opt);
  } catch (const fsdp::safetensors::FormatError& e) {
    return e.what();
  }
  return "";
}

FSDP_WORKER(ckpt_damage) {
  auto pg = fsdp::init_process_group();
  auto net = sharded_net(pg, "full_shard");
  torch::optim::AdamW opt(net->parameters());
  fill_with_patterns(net, opt);
  fsdp::save_sharded(ctx.env("DIR"), *net, &opt, *pg);
  return 0;
}

TEST(ShardedCheckpoint, DamageIsRefusedWithFileAndTensor) {
  auto root = fsdp::test::fresh_dir("ckpt-damage");
  const auto good = root / "good";
  EXPECT_WORKERS_OK(
      fsdp::test::run_workers("ckpt_damage", 2, fsdp::test::with_env({{"DIR", good.string()}})));
  EXPECT_EQ(load_error(good), "");
  auto copy = [&](const std::string& name) {
    auto d = root / name;
    fs::copy(good, d, fs::copy_options::recursive);
    return d;
  };
  // One flipped byte in the data of every file, at its end (the last tensor's last row).
  for (const char* file : {"rank-00000.safetensors", "rank-00001.safetensors"}) {
    auto d = copy(std::string("flip-") + file);
    {
      std::fstream f(d / file, std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(-1, std::ios::end);
      char c;
      f.read(&c, 1);
      c ^= 0x10;
      f.seekp(-1, std::ios::end);
      f.write(&c, 1);
    }
    auto msg = load_error(d);
    std::printf("flipped byte in %s: %s\n", file, msg.c_str());
    EXPECT_NE(msg.find(file), std::string::npos) << msg;
    EXPECT_NE(msg.find("checksum mismatch"), std::string::npos) << msg;
    EXPECT_NE(msg.find("tensor '"), std::string::npos) << msg;
  }
  {
    auto d = copy("truncated");
    fs::resize_file(d / "rank-00001.safetensors", fs::file_size(d / "rank-00001.safetensors") - 3);
    auto msg = load_error(d);
    std::printf("truncated: %s\n", msg.c_str());
    EXPECT_NE(msg.find("rank-00001.safetensors"), std::string::npos) << msg;
  }
  {
    auto d = copy("index");
    std::string text;
    {
      std::ifstream in(d / "index.json");
      text.assign(std::istreambuf_iterator<char>(in), {});
    }
    auto pos = text.find("\"block_rows\"");
    ASSERT_NE(pos, std::string::npos);
    text.insert(text.find_first_of("0123456789", pos), "-");  // a negative block size
    std::ofstream(d / "index.json", std::ios::trunc) << text;
    auto msg = load_error(d);
    std::printf("tampered index: %s\n", msg.c_str());
    EXPECT_NE(msg.find("index.json"), std::string::npos) << msg;
    EXPECT_NE(msg.find("block_rows invalid"), std::string::npos) << msg;
  }
  {
    auto d = copy("missing");
    fs::remove(d / "rank-00000.safetensors");
    EXPECT_NE(load_error(d).find("rank-00000.safetensors"), std::string::npos);
  }
  // File names that lead out of the checkpoint's directory: a path in the index, or a link.
  for (const char* name : {"../good/rank-00000.safetensors", "/etc/passwd"}) {
    auto d = copy(std::string("escape-") + (name[0] == '/' ? "abs" : "dotdot"));
    std::string text;
    {
      std::ifstream in(d / "index.json");
      text.assign(std::istreambuf_iterator<char>(in), {});
    }
    const std::string plain = "\"rank-00000.safetensors\"";
    ASSERT_NE(text.find(plain), std::string::npos);
    text.replace(text.find(plain), plain.size(), std::string("\"") + name + "\"");
    std::ofstream(d / "index.json", std::ios::trunc) << text;
    auto msg = load_error(d);
    std::printf("index naming %s: %s\n", name, msg.c_str());
    EXPECT_NE(msg.find("is not a plain name"), std::string::npos) << msg;
  }
  {
    auto d = copy("symlink");
    fs::remove(d / "rank-00000.safetensors");
    fs::create_symlink(fs::absolute(good / "rank-00000.safetensors"), d / "rank-00000.safetensors");
    auto msg = load_error(d);
    std::printf("link in the checkpoint: %s\n", msg.c_str());
    EXPECT_NE(msg.find("rank-00000.safetensors: not a regular file"), std::string::npos) << msg;
  }
  // Edits into other valid values: the index's checksum of itself refuses them all; edits
  // resealed with a fresh checksum (a writer's bug, a determined hand) meet the cross-checks.
  auto edit_index = [&](const std::string& name, const std::function<void(Json&)>& change,
                        bool reseal) {
    auto d = copy("edit-" + name);
    Json j;
    {
      std::ifstream in(d / "index.json");
      j = Json::parse(in);
    }
    change(j);
    if (reseal) {
      j.erase(fsdp::detail::kIndexChecksumKey);
      j[fsdp::detail::kIndexChecksumKey] = fsdp::detail::index_checksum(j.dump());
    }
    std::ofstream(d / "index.json", std::ios::trunc) << j.dump(1);
    return load_error(d);
  };
  auto first_step = [](Json& j) -> Json& { return j["optimizer"]["steps"].begin().value(); };
  const std::vector<std::tuple<std::string, std::function<void(Json&)>, bool, std::string>> edits =
      {
          {"step", [&](Json& j) { first_step(j) = first_step(j).get<int64_t>() + 1; }, false,
           "do not match its checksum"},
          {"block-sum",
           [](Json& j) {
             j["tensors"].begin().value()["pieces"][0]["xxh3"][0] = "0123456789abcdef";
           },
           false, "do not match its checksum"},
          {"no-checksum", [](Json& j) { j.erase(fsdp::detail::kIndexChecksumKey); }, false,
           "'index_xxh3', its checksum, is missing"},
          {"renamed-step",
           [](Json& j) {
             auto& steps = j["optimizer"]["steps"];
             const auto key = steps.begin().key();
             steps[key + "_renamed"] = steps[key];
             steps.erase(key);
           },
           true, "_renamed', which is no tensor of the index"},
          {"negative-step", [&](Json& j) { first_step(j) = -1; }, true, "is negative"},
          {"world-size", [](Json& j) { j["world_size"] = 1; }, true,
           "'rank-00001.safetensors' is not the file of a rank of the 1 that saved it"},
          {"optim-of-nothing",
           [](Json& j) { j["tensors"]["optim/nothing/exp_avg"] = j["tensors"].begin().value(); },
           true, "'optim/nothing/exp_avg' is optimizer state of no parameter"},
      };
  for (const auto& [name, change, reseal, expect] : edits) {
    const auto msg = edit_index(name, change, reseal);
    std::printf("index edit %s%s: %s\n", name.c_str(), reseal ? " (resealed)" : "", msg.c_str());
    EXPECT_NE(msg.find("index.json"), std::string::npos) << msg;
    EXPECT_NE(msg.find(expect), std::string::npos) << msg;
  }
  // Indexes written before the checksum (version 1) are read with every other check.
  EXPECT_EQ(edit_index(
                "version-1",
                [](Json& j) {
                  j["version"] = 1;
                  j.erase(fsdp::detail::kIndexChecksumKey);
                },
                false),
            "");
  // Not a regular file: refused at once by name, never read (a link to /dev/zero used to
  // read 8 GB, a FIFO to block).
  for (const std::string kind : {"fifo", "devzero", "directory"}) {
    for (const std::string file : {"index.json", "rank-00001.safetensors"}) {
      auto d = copy("kind-" + kind + "-" + file);
      fs::remove(d / file);
      if (kind == "fifo")
        ASSERT_EQ(::mkfifo((d / file).c_str(), 0600), 0);
      else if (kind == "devzero")
        fs::create_symlink("/dev/zero", d / file);
      else
        fs::create_directory(d / file);
      const auto start = std::chrono::steady_clock::now();
      const auto msg = load_error(d);
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::printf("%s as %s: %s (%.3f s)\n", file.c_str(), kind.c_str(), msg.c_str(), seconds);
      EXPECT_NE(msg.find(file + ": not a regular file"), std::string::npos) << msg;
      EXPECT_LT(seconds, 2.0);
    }
  }
  // A save that died half-way: its .tmp directory is ignored, the previous one loads, and the
  // next save of that name clears it.
  fs::create_directories(root / "next.tmp");
  std::ofstream(root / "next.tmp" / "rank-00000.safetensors") << "half";
  EXPECT_EQ(load_error(good), "");
  EXPECT_WORKERS_OK(fsdp::test::run_workers(
      "ckpt_damage", 2, fsdp::test::with_env({{"DIR", (root / "next").string()}})));
  EXPECT_EQ(load_error(root / "next"), "");
  // Never overwritten in place.
  auto again =
      fsdp::test::run_workers("ckpt_damage", 2, fsdp::test::with_env({{"DIR", good.string()}}));
  EXPECT_FALSE(again.ok());
  fs::remove_all(root);
}

// Rank 1 is killed (SIGKILL) once its file is written, before the index exists. Saved by
// save_sharded, the other ranks' save fails at the next barrier within the group's timeout
// instead of hanging; with ASYNC=1 (AsyncCheckpointer), rank 1 dies in its writer thread, and
// rank 0's writer waits for its file at most the group's timeout (1.5 s: the async case waits
// all of it) and does not commit.
FSDP_WORKER(ckpt_killed) {
  auto pg = fsdp::init_process_group(
      fsdp::ProcessGroupOptions().timeout(std::chrono::milliseconds(1500)));
  auto net = sharded_net(pg, "full_shard");
  torch::optim::AdamW opt(net->parameters());
  fill_with_patterns(net, opt);
  fsdp::detail::save_sharded_hook = [](int rank, const std::string& stage) {
    if (rank == 1 && stage == "files_written")
      ::kill(::getpid(), SIGKILL);
  };
  try {
    if (ctx.env_int("ASYNC", 0) != 0) {
      fsdp::AsyncCheckpointer saver(pg);
      saver.start(ctx.env("DIR"), *net, &opt);
      saver.wait();
    } else {
      fsdp::save_sharded(ctx.env("DIR"), *net, &opt, *pg);
    }
  } catch (const std::exception& e) {
    std::printf("[rank %d] save failed as expected: %.200s\n", pg->rank(), e.what());
    return 3;
  }
  return 0;
}

// A checkpoint saved on 3 ranks, then one whose save loses rank 1 after it wrote its file
// (ckpt_killed; `async`: through AsyncCheckpointer): the killed save never became a checkpoint,
// the previous one loads.
fsdp::test::RunResult killed_mid_save(const fs::path& previous, const fs::path& next, bool async) {
  EXPECT_WORKERS_OK(fsdp::test::run_workers("ckpt_damage", 3,
                                            fsdp::test::with_env({{"DIR", previous.string()}})));
  auto r = fsdp::test::run_workers(
      "ckpt_killed", 3,
      fsdp::test::with_env({{"DIR", next.string()}, {"ASYNC", async ? "1" : "0"}}));
  EXPECT_FALSE(r.timed_out) << r.describe();
  EXPECT_EQ(r.exit_codes[1], 128 + SIGKILL) << r.describe();
  EXPECT_LT(r.seconds, 30.0);
  EXPECT_FALSE(fs::exists(next));
  EXPECT_TRUE(fs::exists(next.string() + ".tmp"));
  EXPECT_EQ(load_error(previous), "");
  return r;
}

TEST(ShardedCheckpoint, RankKilledMidSaveLeavesThePreviousOne) {
  auto root = fsdp::test::fresh_dir("ckpt-killed");
  const auto previous = root / "step-1", next = root / "step-2";
  const auto r = killed_mid_save(previous, next, /*async=*/false);
  EXPECT_EQ(r.exit_codes[0], 3) << r.describe();
  EXPECT_EQ(r.exit_codes[2], 3) << r.describe();
  EXPECT_NE(load_error(next).find("cannot open"), std::string::npos);
  // The next attempt clears the debris and succeeds.
  EXPECT_WORKERS_OK(
      fsdp::test::run_workers("ckpt_damage", 3, fsdp::test::with_env({{"DIR", next.string()}})));
  EXPECT_EQ(load_error(next), "");
  fs::remove_all(root);
}

}  // namespace

namespace {

// checkpoint.async's saver: the same save as save_sharded into SYNC, and asynchronously into
// ASYNC, after which the parameters change at once (training going on): the snapshot is what
// was there when start() returned.
FSDP_WORKER(ckpt_async) {
  auto pg = fsdp::init_process_group();
  auto net = sharded_net(pg, "full_shard");
  torch::optim::AdamW opt(net->parameters());
  fill_with_patterns(net, opt);
  fsdp::save_sharded(ctx.env("SYNC"), *net, &opt, *pg, {{"step", "7"}});
  fsdp::AsyncCheckpointer saver(pg);
  saver.start(ctx.env("ASYNC"), *net, &opt, {{"step", "7"}});
  WORKER_CHECK(saver.in_flight());
  {
    torch::NoGradGuard no_grad;
    for (auto& p : net->parameters())
      p.add_(1.0);
  }
  const auto done = saver.wait();
  WORKER_CHECK(done.has_value() && done->dir == ctx.env("ASYNC"));
  WORKER_CHECK(done->stall_seconds <= done->seconds) << done->stall_seconds << " " << done->seconds;
  WORKER_CHECK(!saver.wait().has_value());  // nothing in flight any more
  return 0;
}

TEST(ShardedCheckpoint, AsyncSaveWritesSaveShardedsFilesByteForByte) {
  auto root = fsdp::test::fresh_dir("ckpt-async");
  const auto sync = root / "sync", async = root / "async";
  EXPECT_WORKERS_OK(fsdp::test::run_workers(
      "ckpt_async", 3, fsdp::test::with_env({{"SYNC", sync.string()}, {"ASYNC", async.string()}})));
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(sync))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  ASSERT_GE(names.size(), 2u);  // index.json and the ranks' files
  for (const auto& name : names) {
    ASSERT_TRUE(fs::exists(async / name)) << name;
    EXPECT_EQ(fsdp::test::file_bytes(async / name), fsdp::test::file_bytes(sync / name)) << name;
  }
  EXPECT_FALSE(fs::exists(async.string() + ".tmp"));
  EXPECT_EQ(load_error(async), "");
  fs::remove_all(root);
}

TEST(ShardedCheckpoint, AsyncSaveKilledMidWriteLeavesThePreviousOne) {
  auto root = fsdp::test::fresh_dir("ckpt-async-killed");
  const auto r = killed_mid_save(root / "step-1", root / "step-2", /*async=*/true);
  EXPECT_EQ(r.exit_codes[0], 3) << r.describe();  // its commit waited for rank 1's file
  EXPECT_NE(r.outputs[0].find("not every rank wrote its file"), std::string::npos) << r.describe();
  EXPECT_EQ(r.exit_codes[2], 0) << r.describe();  // its own file was written
  fs::remove_all(root);
}

}  // namespace
