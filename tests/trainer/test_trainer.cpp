// fsdp-train as a user runs it: config validation (one line, exit code 2), short runs that
// write every metrics field, the same losses from --nproc and torchrun, and a reference in
// docs/trainer.md that matches the code.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include <torch/version.h>
#include <nlohmann/json.hpp>

#include <fsdp/checkpoint/safetensors.h>

#include "cli/core_binding.h"
#include "cli/preflight.h"
#include "config/config.h"
#include "data/corpus.h"
#include "data/finetune_data.h"
#include "data/pretrained_model.h"
#include "harness/command.h"
#include "harness/files.h"
#include "harness/python_ranks.h"
#include "observe/metrics.h"
#include "text/tokenizer.h"
#include "tokenizer_samples.h"

namespace {

// The vocabulary of the test data (data.vocab_size below).
constexpr int kTestVocab = 512;

namespace fs = std::filesystem;
using fsdp::test::file_bytes;

using fsdp::test::CommandResult;

CommandResult run(const std::string& command) {
  return fsdp::test::run_command(command);
}

// fsdp-train, through the client of this binary's zygote (serve_programs.cpp), which runs
// it as a new process when no zygote serves it (the binary run by hand).
std::string train_cmd() {
  return FSDP_TRAIN_CMD;
}

// fsdp-plan, served the same way.
std::string plan_cmd() {
  return FSDP_PLAN_CMD;
}

// One data directory for every run of this file: prepared once, reused (prepare is idempotent).
std::string data_dir() {
  return (fs::path(FSDP_TEST_WORK_DIR) / "data-kjv-512").string();
}

std::string write_config(const std::string& name, const std::string& body) {
  const auto path = fs::path(FSDP_TEST_WORK_DIR) / (name + ".toml");
  fs::create_directories(path.parent_path());
  std::ofstream(path) << body;
  return path.string();
}

// A config small enough for a few seconds per run on two cores. Without plot.png: gnuplot takes
// 0.15 s of a run's 0.5 s at this size; NprocTwoWritesEveryMetric draws it.
std::string tiny_config(const std::string& run_dir, const std::string& arch = "gpt",
                        const std::string& preset = "gpt2-test") {
  return "[model]\narch = \"" + arch + "\"\npreset = \"" + preset + "\"\n[data]\ndir = \"" +
         data_dir() +
         "\"\nvocab_size = 512\n[training]\nsteps = 6\nbatch_size = 2\nseq_len = 16\n"
         "eval_every = 3\neval_batches = 2\nwarmup_steps = 2\n[logging]\nrun_dir = \"" +
         run_dir +
         "\"\nprogress = \"lines\"\nlog_every = 1\nplot = false\n[generate]\ntokens = 8\n";
}

int line_count(const std::string& s) {
  return static_cast<int>(std::count(s.begin(), s.end(), '\n'));
}

// What load_config and preflight (trainer/cli/preflight.h), which fsdp-train runs before
// starting any rank, say of CONFIG (a path, or "" for none) with ARGS (--section.key=value
// overrides and --nproc N, space-separated) for `train`: the ConfigError's message, "" if none.
std::string preflight_refusal(const std::string& config, const std::string& args) {
  std::vector<std::string> overrides;
  int world = 1;
  std::istringstream words(args);
  for (std::string w; words >> w;) {
    if (w == "--nproc")
      words >> world;
    else
      overrides.push_back(w.substr(2));
  }
  try {
    fsdp_trainer::preflight(fsdp_trainer::load_config(config, overrides), "train", world, world);
  } catch (const fsdp_trainer::ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(TrainerConfig, BadInputIsOneLineAndExitCode2) {
  const auto ok = tiny_config((fs::path(FSDP_TEST_WORK_DIR) / "unused").string());
  // Every case is refused in this process by what fsdp-train runs before any rank starts
  // (load_config, then preflight); those marked kCli are also run as fsdp-train, for the one
  // line and exit code 2 of each way out (a config file, the command line, the launcher, a
  // rank, a single process).
  enum Where { kPreflight, kCli, kRank };  // kRank: refused by a rank, so only through the CLI
  struct Case {
    std::string config, args, must_mention;
    Where where = kPreflight;
  };
  std::vector<Case> cases = {
      {ok + "[training]\n", "", "training", kCli},  // a repeated section is a TOML error
      {"[training]\nstepz = 3\n", "",
       "unknown key 'training.stepz' (did you mean 'training.steps'?)"},
      {"[training]\nsteps = \"ten\"\n", "", "'training.steps' must be an integer, got string"},
      {"[logging]\nprogress = \"fancy\"\n", "", "'logging.progress' must be one of auto, bar"},
      {"[model]\narch = \"rnn\"\n", "", "'model.arch' must be one of gpt, llama"},
      {"[data]\ncorpus = \"/no/such/corpus.txt\"\n", "", "data.corpus"},
      {"[data]\ncorpus = \"/no/such/dir/*.jsonl\"\n", "", "nor a glob that matches files"},
      {"[training]\nseq_len = 1\n", "", "'training.seq_len' must be >= 2"},
      {"", "--training.steps=abc", "'training.steps' must be an integer, got 'abc'"},
      {"", "--training.nope=1", "unknown key 'training.nope'"},
      {"", "--training.steps", "must look like --section.key=value", kCli},
      {"", "--model.preset=gpt2-huge --training.steps=1",
       "'model.preset' = 'gpt2-huge' is not a gpt preset", kRank},
      {"model = 3\n", "", "'model' must be a section"},
      {"", "--fsdp.strategy=zero3", "'fsdp.strategy' must be one of full_shard, shard_grad_op"},
      {"", "--fsdp.backward_prefetch=early", "'fsdp.backward_prefetch' must be one of none"},
      {"", "--fsdp.max_inflight_all_gathers=0", "'fsdp.max_inflight_all_gathers' must be >= 1"},
      {"", "--fsdp.all_reduce_bucket_mb=0", "'fsdp.all_reduce_bucket_mb' must be > 0"},
      {"", "--fsdp.all_gather_bucket_mb=-1", "'fsdp.all_gather_bucket_mb' must be >= 0"},
      {"", "--fsdp.gloo_lanes=0", "'fsdp.gloo_lanes' must be between 1 and 16, got 0"},
      {"", "--fsdp.check_collectives=-1", "'fsdp.check_collectives' must be >= 0"},
      {"", "--training.device=tpu", "'training.device' must be one of cpu, cuda"},
      {"", "--training.memory_budget=lots", "'training.memory_budget' = 'lots' is not a size"},
      {"", "--training.memory_budget=16GiBs", "unknown unit 'GiBs'"},
      {"", "--training.memory_budget=0MiB", "'training.memory_budget' = '0MiB' must be a positive"},
      {"", "--precision.param_dtype=fp16 --precision.loss_scaling=none",
       "'precision.loss_scaling' must not be none with precision.param_dtype = fp16"},
      {"", "--precision.param_dtype=fp8", "'precision.param_dtype' must be one of fp32, bf16"},
      {"", "--precision.gather_format=int4",
       "'precision.gather_format' must be one of param_dtype, bf16, fp16, int8"},
      {"", "--precision.int8_block=0", "'precision.int8_block' must be between 1 and 1048576"},
      {"", "--fsdp.activation_checkpointing=some",
       "'fsdp.activation_checkpointing' must be one of none, full, selective"},
      {"", "--fsdp.ac_every=0", "'fsdp.ac_every' must be >= 1"},
      {"", "--optimizer.name=lamb", "'optimizer.name' must be one of adamw, adamw_fused, sgd"},
      {"", "--optimizer.name=adamw --optimizer.offload=file",
       "'optimizer.offload' = file needs a fused optimizer"},
      {"", "--optimizer.name=adamw --optimizer.moments_dtype=bf16",
       "'optimizer.moments_dtype' = bf16 needs a fused optimizer"},
      {"", "--optimizer.offload=file --optimizer.offload_dir=/no/such/dir",
       "'optimizer.offload_dir' '/no/such/dir' is not an existing directory"},
      {"", "--optimizer.chunk_mb=0", "'optimizer.chunk_mb' must be between"},
      {"", "--optimizer.name=sgd --optimizer.momentum=0 --optimizer.nesterov=true",
       "'optimizer.nesterov' needs optimizer.momentum > 0"},
      {"", "--fsdp.optimizer_in_backward=true --optimizer.name=adamw",
       "'fsdp.optimizer_in_backward' steps unit by unit through a fused optimizer"},
      {"", "--fsdp.optimizer_in_backward=true --training.grad_clip=1",
       "'fsdp.optimizer_in_backward' cannot clip by this step's global norm"},
      {"", "--fsdp.optimizer_in_backward=true --training.grad_clip=0 --precision.param_dtype=fp16",
       "'fsdp.optimizer_in_backward' cannot skip a step whose gradients overflow"},
      {"", "--training.grad_clip_mode=local",
       "'training.grad_clip_mode' must be one of global, previous_step"},
      {"", "--logging.trace_steps=3-2", "'logging.trace_steps' = '3-2' ends before it starts"},
      {"", "--logging.trace_steps=two", "'logging.trace_steps' = 'two' is not a step range"},
      {"", "--logging.trace_steps=2-", "'logging.trace_steps' = '2-' is not a step range"},
      {"", "--logging.trace_steps=0", "'logging.trace_steps' = '0' must start at step 1"},
      {"", "--training.steps=4 --logging.trace_steps=3-5",
       "'logging.trace_steps' = '3-5' goes past the last step (training.steps = 4)"},
      // The job's shape: checked by the launcher before any rank starts...
      {"", "--nproc 2 --fsdp.strategy=hybrid_shard --fsdp.hybrid_shard_size=3",
       "'fsdp.hybrid_shard_size' = 3 must divide the world size (2 ranks)", kCli},
      {"", "--nproc 2 --fsdp.hybrid_shard_size=3", "'fsdp.hybrid_shard_size'"},
      {"", "--nproc 2 --fsdp.reshard_after_forward_size=3",
       "'fsdp.reshard_after_forward_size' = 3 must divide the 2 ranks"},
      // ...and by a single process (world size 1) before it joins.
      {"", "--fsdp.strategy=hybrid_shard --fsdp.hybrid_shard_size=2",
       "'fsdp.hybrid_shard_size' = 2 must divide the world size (1 rank)", kCli},
      // Prepared data never goes into a directory holding files fsdp-train did not write.
      {"", "--data.dir=/", "'data.dir' '/' holds '", kCli},
      {"", "--data.dir=" FSDP_SOURCE_DIR, "which fsdp-train did not write"},
      // Non-finite hyperparameters, from the command line and from the file.
      {"", "--training.lr=inf", "'training.lr' must be a finite number, got 'inf'"},
      {"", "--training.lr=nan", "'training.lr' must be a finite number, got 'nan'"},
      {"[fsdp]\ntimeout_s = inf\n", "", "'fsdp.timeout_s' must be a finite number"},
      {"", "--fsdp.timeout_s=1e9", "'fsdp.timeout_s' must be > 0 and at most a week"},
      // Shapes that pass the type checks but imply more memory than the machine has: refused
      // with the sizes before anything is allocated (they used to abort in the allocator).
      {"", "--model.n_embd=1099511627776 --model.n_head=1",
       "model.n_embd = 1099511627776, data.vocab_size = 512, training.seq_len = 128: 5.803e+25 "
       "parameters"},
      {"", "--model.n_layer=1099511627776", "model.n_layer = 1099511627776"},
      {"", "--training.seq_len=1099511627776", "one micro-batch's logits"},
      {"", "--nproc 2 --model.n_layer=16777216", "for the 2 rank(s) on this host, more than its",
       kCli},
      // Fault tolerance: what it needs, what it cannot go with yet, a schedule that is wrong.
      {"", "--fsdp.fault_tolerant=true",
       "'fsdp.fault_tolerant' needs fsdp.strategy = \"hybrid_shard\" with fsdp.hybrid_shard_size "
       "set"},
      {"",
       "--fsdp.strategy=hybrid_shard --fsdp.hybrid_shard_size=1 --fsdp.fault_tolerant=true "
       "--fsdp.optimizer_in_backward=true --optimizer.name=adamw_fused --training.grad_clip=0",
       "'fsdp.fault_tolerant' cannot go with fsdp.optimizer_in_backward (the units step inside "
       "backward"},
      {"",
       "--fsdp.strategy=hybrid_shard --fsdp.hybrid_shard_size=1 --fsdp.fault_tolerant=true "
       "--fsdp.membership_schedule=5:0,2;3:0",
       "'fsdp.membership_schedule' step 3 is not >= 1 and after the previous entry's"},
      {"", "--fsdp.membership_schedule=5:0",
       "'fsdp.membership_schedule' applies to "
       "fsdp.fault_tolerant = true only"},
      {"",
       "--nproc 2 --fsdp.strategy=hybrid_shard --fsdp.hybrid_shard_size=2 "
       "--fsdp.fault_tolerant=true",
       "'fsdp.fault_tolerant' needs at least 2 replicas: 2 ranks in blocks of "
       "fsdp.hybrid_shard_size = 2 make 1"},
      {"",
       "--nproc 2 --fsdp.strategy=hybrid_shard --fsdp.hybrid_shard_size=1 "
       "--fsdp.fault_tolerant=true --fsdp.membership_schedule=4:0,2",
       "'fsdp.membership_schedule' names replica 2 at step 4, and the job has 2"},
      {"", "--fsdp.spare_replicas=1",
       "'fsdp.spare_replicas' applies to fsdp.fault_tolerant = true only"},
      {"",
       "--nproc 2 --fsdp.strategy=hybrid_shard --fsdp.hybrid_shard_size=1 "
       "--fsdp.fault_tolerant=true --fsdp.spare_replicas=2",
       "'fsdp.spare_replicas' = 2 leaves no replica to train: the job has 2"},
      // A huge value is quoted cut short (the test checks the one line; the length below).
      {"", "--training.steps=" + std::string(100000, '7'), "(100000 bytes)", kCli},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& c = cases[i];
    const std::string config =
        c.config.empty() ? "" : write_config("bad" + std::to_string(i), c.config);
    std::string args = c.args + " --data.vocab_size=512";
    if (c.args.find("--data.dir") == std::string::npos)
      args += " --data.dir=" + data_dir();
    if (c.where != kRank) {
      const std::string refused = preflight_refusal(config, args);
      EXPECT_NE(refused.find(c.must_mention), std::string::npos)
          << "case " << i << " should mention \"" << c.must_mention << "\": " << refused;
      EXPECT_EQ(refused.find('\n'), std::string::npos) << "case " << i << ": " << refused;
    }
    if (c.where == kPreflight)
      continue;
    std::string cmd = train_cmd();
    if (!config.empty()) {
      cmd += ' ';  // not " " + string&&: GCC 12 warns falsely (-Wrestrict) on that insert
      cmd += config;
    }
    cmd += " " + args;
    if (c.where == kRank)
      cmd += " --logging.run_dir=" + (fs::path(FSDP_TEST_WORK_DIR) / "bad-preset").string();
    const CommandResult r = run(cmd);
    EXPECT_EQ(r.code, 2) << "case " << i << ": " << cmd << "\n" << r.output;
    EXPECT_NE(r.output.find(c.must_mention), std::string::npos)
        << "case " << i << " should mention \"" << c.must_mention << "\":\n"
        << r.output;
    EXPECT_NE(r.output.find("error"), std::string::npos) << r.output;
    // The preset error comes from a rank after data preparation; the rest before any rank starts.
    if (c.where != kRank) {
      EXPECT_EQ(line_count(r.output), 1) << "case " << i << ":\n" << r.output;
    }
  }
  // A config that is not a regular file: a directory, a FIFO (which would block the parser
  // forever) and a device are refused by name, at once.
  const auto fifo = fs::path(FSDP_TEST_WORK_DIR) / "config.fifo";
  fs::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::vector<std::string> not_files;
  not_files.push_back(FSDP_TEST_WORK_DIR);
  not_files.push_back(fifo.string());
  not_files.push_back("/dev/zero");
  for (const auto& path : not_files) {
    const auto start = std::chrono::steady_clock::now();
    const CommandResult r = run(train_cmd() + " " + path);
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(r.code, 2) << path << "\n" << r.output;
    EXPECT_NE(r.output.find("config file '" + path + "' is not a regular file"), std::string::npos)
        << r.output;
    EXPECT_EQ(line_count(r.output), 1) << r.output;
    EXPECT_LT(took, 5.0) << path;
  }
  fs::remove(fifo);
  {
    const CommandResult r = run(train_cmd() + " --training.steps=" + std::string(100000, '7'));
    EXPECT_LT(r.output.size(), 400u) << "a 100 kB value echoed back";
  }
  // A bad config under --nproc fails before any rank is started: once, immediately.
  const CommandResult r = run(train_cmd() + " --nproc 2 --training.steps=0");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(line_count(r.output), 1) << r.output;
}

// training.device = "cuda" on a machine without a GPU (ours): fsdp-train hands over to
// fsdp-train-cuda, which refuses in one line before joining the job or touching data.
TEST(TrainerConfig, CudaDeviceWithoutGpuIsOneLineAndExitCode2) {
  if (fs::exists("/dev/nvidiactl"))
    GTEST_SKIP() << "this machine has an NVIDIA driver: tests/cuda covers the device path";
  for (const int nproc : {1, 2}) {
    std::string cmd = train_cmd();
    if (nproc > 1)
      cmd += " --nproc " + std::to_string(nproc);
    cmd += " --training.device=cuda --data.dir=" + data_dir();
    const CommandResult r = run(cmd);
    EXPECT_EQ(r.code, 2) << cmd << "\n" << r.output;
    EXPECT_NE(r.output.find("'training.device' = 'cuda' but"), std::string::npos) << r.output;
    EXPECT_EQ(line_count(r.output), 1) << r.output;  // under --nproc, before any rank starts
  }
}

TEST(TrainerConfig, PrintConfigRoundTripsAndOverridesApply) {
  const CommandResult r = run(train_cmd() +
                              " --print-config --training.steps=42 --model.arch=llama "
                              "--model.preset=llama-tiny --training.lr=0.5");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto path = write_config("printed", r.output);
  const auto c = fsdp_trainer::load_config(path, {});
  EXPECT_EQ(c.training.steps, 42);
  EXPECT_EQ(c.model.arch, "llama");
  EXPECT_DOUBLE_EQ(c.training.lr, 0.5);
  EXPECT_EQ(fsdp_trainer::to_toml(c), r.output);
  // Floats as the shortest decimal that reads back the same (and TOML floats when whole).
  EXPECT_NE(r.output.find("beta1 = 0.9\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("grad_clip = 1.0\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("min_lr = 3e-04\n"), std::string::npos) << r.output;
}

// --version is one line naming the version and the LibTorch; --help lists every command with
// one line each; "train" may be named.
TEST(TrainerConfig, VersionAndHelpNameTheProgramAndItsCommands) {
  CommandResult r = run(train_cmd() + " --version");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output.rfind("fsdp-train 0.", 0), 0u) << r.output;
  EXPECT_NE(r.output.find("LibTorch " + std::to_string(TORCH_VERSION_MAJOR) + "." +
                          std::to_string(TORCH_VERSION_MINOR) + "."),
            std::string::npos)
      << r.output;
  EXPECT_EQ(line_count(r.output), 1) << r.output;
  r = run(train_cmd() + " --help");
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* command : {"train [CONFIG]", "finetune CONFIG", "export CONFIG",
                              "generate CONFIG", "fr-analyze DIR"}) {
    const auto at = r.output.find("\n  " + std::string(command));
    EXPECT_NE(at, std::string::npos) << command << "\n" << r.output;
  }
  EXPECT_NE(r.output.find("--version"), std::string::npos) << r.output;
  r = run(train_cmd() + " train --print-config --training.steps=7");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("steps = 7\n"), std::string::npos) << r.output;
}

TEST(TrainerConfig, ReferenceInDocsMatchesTheCode) {
  std::ifstream in(fs::path(FSDP_SOURCE_DIR) / "docs" / "trainer.md");
  ASSERT_TRUE(in) << "docs/trainer.md is missing";
  std::stringstream doc;
  doc << in.rdbuf();
  const std::string reference = fsdp_trainer::reference_markdown();
  EXPECT_NE(doc.str().find(reference), std::string::npos)
      << "docs/trainer.md does not contain the current option reference; regenerate it with "
         "`fsdp-train --config-reference` and paste it in:\n"
      << reference;
  // Every option appears in the reference exactly once.
  for (const auto& o : fsdp_trainer::option_table()) {
    EXPECT_NE(reference.find("`" + o.key + "`"), std::string::npos) << o.key;
  }
}

std::vector<fsdp_trainer::StepMetrics> train_and_read(const std::string& name,
                                                      const std::string& launch,
                                                      const std::string& extra = "",
                                                      const std::string& arch = "gpt",
                                                      const std::string& preset = "gpt2-test") {
  const auto run_dir = (fs::path(FSDP_TEST_WORK_DIR) / ("run-" + name)).string();
  fs::remove_all(run_dir);
  const auto config = write_config(name, tiny_config(run_dir, arch, preset));
  const CommandResult r = run(launch + " " + config + " " + extra);
  EXPECT_EQ(r.code, 0) << launch << " " << config << "\n" << r.output;
  if (r.code != 0)
    return {};
  EXPECT_TRUE(fs::exists(fs::path(run_dir) / "config.toml"));
  EXPECT_TRUE(fs::exists(fs::path(run_dir) / "breakdown.txt"));
  EXPECT_TRUE(fs::exists(fs::path(run_dir) / "sample.txt"));
  if (extra.find("--logging.plot=true") != std::string::npos)
    EXPECT_GT(fs::file_size(fs::path(run_dir) / "plot.png"), 1000u);
  else
    EXPECT_FALSE(fs::exists(fs::path(run_dir) / "plot.png"));
  EXPECT_NE(r.output.find("Step-time breakdown"), std::string::npos) << r.output;
  return fsdp_trainer::read_metrics((fs::path(run_dir) / "metrics.jsonl").string());
}

void expect_sane(const std::vector<fsdp_trainer::StepMetrics>& m) {
  ASSERT_EQ(m.size(), 6u);
  for (size_t i = 0; i < m.size(); ++i) {
    const auto& s = m[i];
    EXPECT_EQ(s.step, static_cast<int64_t>(i) + 1);
    EXPECT_TRUE(std::isfinite(s.loss) && s.loss > 0 && s.loss < 20) << s.loss;
    EXPECT_GT(s.lr, 0);
    EXPECT_GT(s.tokens_per_second, 0);
    // MFU is a fraction of what this machine's matmuls did at start-up (matmul_speed.h).
    EXPECT_GT(s.mfu, 0);
    EXPECT_LE(s.mfu, 1.0) << "step " << s.step;
    EXPECT_GT(s.peak_bytes, 0);
    // The process holds LibTorch and the tracked tensors at least.
    ASSERT_TRUE(s.rss_bytes.has_value() && s.peak_rss_bytes.has_value());
    EXPECT_GT(*s.rss_bytes, s.peak_bytes);
    EXPECT_GE(*s.peak_rss_bytes, *s.rss_bytes);
    EXPECT_GT(s.time_forward_s, 0);
    EXPECT_GT(s.time_backward_s, 0);
    // The exposed waits are parts of the phases they happen in, and the phases of the step.
    EXPECT_LE(s.time_allgather_wait_forward_s, s.time_forward_s) << "step " << s.step;
    EXPECT_LE(
        s.time_allgather_wait_s - s.time_allgather_wait_forward_s + s.time_reducescatter_wait_s,
        s.time_backward_s)
        << "step " << s.step;
    EXPECT_LE(s.time_forward_s + s.time_backward_s + s.time_optimizer_s, s.step_time_s)
        << "step " << s.step;
    EXPECT_GT(s.time_optimizer_s, 0);
    EXPECT_GT(s.allgather_bytes, 0);
    EXPECT_GT(s.reducescatter_bytes, 0);
    EXPECT_EQ(s.allgather_bytes, m[0].allgather_bytes) << "traffic must not change per step";
    EXPECT_EQ(s.eval_loss.has_value(), s.step % 3 == 0) << s.step;
  }
  // Warm-up: the learning rate rises over the first two steps.
  EXPECT_LT(m[0].lr, m[1].lr);
}

// training.bind_cores: rank 0 runs on its share of the cores this process may use (the first
// half of them on 2 local ranks), and with more local ranks than cores nothing is pinned. (That
// every thread takes the mask: CoreBinding.EveryThreadBeforeAndAfterTakesTheShare.)
TEST(TrainerRun, BindCoresGivesEachLocalRankItsOwnCpus) {
  const std::vector<int> cpus = fsdp_trainer::allowed_cpus();
  ASSERT_GE(cpus.size(), 2u) << "the test needs 2 CPUs";
  const auto run_dir = (fs::path(FSDP_TEST_WORK_DIR) / "run-bind").string();
  const auto config = write_config("bind", tiny_config(run_dir));
  const std::string quick =
      " --training.steps=1 --training.eval_every=0 --generate.tokens=0 --training.bind_cores=true";
  auto r = run(train_cmd() + " --nproc 2 " + config + quick);
  ASSERT_EQ(r.code, 0) << r.output;
  const auto cores = fsdp_trainer::physical_cores(cpus);
  if (cores.size() < 2)
    GTEST_SKIP() << "one physical core: nothing to split";
  EXPECT_NE(r.output.find("training.bind_cores: rank 0 on CPUs " +
                          fsdp_trainer::cpu_list(fsdp_trainer::core_share(cores, 0, 2)) + " (of " +
                          fsdp_trainer::cpu_list(cpus) + ": 2 local ranks)"),
            std::string::npos)
      << r.output;
  if (cores.size() <= 4) {  // more ranks than cores (a cheap run only on a small machine)
    const auto n = std::to_string(cores.size() + 1);
    r = run(train_cmd() + " --nproc " + n + " " + config + quick);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("rank 0 not bound: " + n + " local ranks on " +
                            std::to_string(cores.size()) + " cores"),
              std::string::npos)
        << r.output;
  }
}

// fsdp-train's own file, not through the zygote (train_cmd()): its link, its start-up and the
// ranks it forks, as a user runs it.
TEST(TrainerRun, NprocTwoWritesEveryMetric) {
  std::string cmd = FSDP_TRAIN_PATH;
  cmd += " --nproc 2";  // by append: GCC 12 misreports train_cmd() + "..." here (-Warray-bounds)
  auto m = train_and_read("gpt-nproc2", cmd, "--logging.plot=true");
  expect_sane(m);
}

// logging.trace_steps: each rank writes a Chrome trace of exactly those steps, with the spans
// of the step's parts (data, each unit's forward and backward, collectives, optimizer, metrics).
TEST(TrainerRun, TraceStepsWritesEachRanksTraceOfThoseStepsOnly) {
  auto m = train_and_read("trace", train_cmd() + " --nproc 2", "--logging.trace_steps=2-3");
  ASSERT_EQ(m.size(), 6u);
  for (int rank = 0; rank < 2; ++rank) {
    const auto path = fs::path(FSDP_TEST_WORK_DIR) / "run-trace" / "trace" /
                      ("rank" + std::to_string(rank) + ".json");
    ASSERT_TRUE(fs::exists(path)) << path;
    std::ifstream in(path);
    const auto doc = nlohmann::json::parse(in);
    EXPECT_EQ(doc.at("distributedInfo").at("rank"), rank);
    EXPECT_EQ(doc.at("distributedInfo").at("world_size"), 2);
    std::set<int64_t> steps;
    std::set<std::string> kinds, step_names;
    int spans = 0;
    for (const auto& e : doc.at("traceEvents")) {
      EXPECT_EQ(e.at("pid"), rank) << e.dump();
      if (e.at("ph") != "X")
        continue;
      ++spans;
      EXPECT_GE(e.at("dur").get<double>(), 0) << e.dump();
      const auto& args = e.at("args");
      ASSERT_TRUE(args.contains("step")) << e.dump();
      steps.insert(args.at("step").get<int64_t>());
      kinds.insert(args.at("kind").get<std::string>());
      if (args.at("kind") == "step")
        step_names.insert(e.at("name").get<std::string>());
    }
    EXPECT_EQ(steps, (std::set<int64_t>{2, 3})) << "rank " << rank;
    EXPECT_EQ(step_names, (std::set<std::string>{"ProfilerStep#2", "ProfilerStep#3"}));
    for (const char* kind :
         {"data", "forward_pass", "backward_pass", "forward", "backward", "all_gather_issue",
          "all_gather_wait", "reduce_scatter_issue", "reduce_scatter_wait", "transfer",
          "optimizer_phase", "optimizer", "metrics"}) {
      EXPECT_TRUE(kinds.count(kind)) << "rank " << rank << ": no '" << kind << "' span";
    }
    std::printf("rank %d: %d spans of steps 2-3 in %ju bytes\n", rank, spans,
                static_cast<uintmax_t>(fs::file_size(path)));
  }
}

// Accumulation through the config: 2 micro-batches reduce-scatter twice per step, or once with
// no_sync; the same sequences, so the losses agree closely (summation order differs).
TEST(TrainerRun, MicroBatchesSyncAndNoSync) {
  auto sync =
      train_and_read("accum-sync", train_cmd() + " --nproc 2", "--training.micro_batches=2");
  auto no_sync = train_and_read("accum-nosync", train_cmd() + " --nproc 2",
                                "--training.micro_batches=2 --fsdp.sync_every_micro_batch=false");
  auto plain = train_and_read("accum-plain", train_cmd() + " --nproc 2");
  ASSERT_EQ(sync.size(), 6u);
  ASSERT_EQ(no_sync.size(), 6u);
  ASSERT_EQ(plain.size(), 6u);
  for (size_t i = 0; i < sync.size(); ++i) {
    EXPECT_EQ(sync[i].reducescatter_bytes, 2 * plain[i].reducescatter_bytes);
    EXPECT_EQ(no_sync[i].reducescatter_bytes, plain[i].reducescatter_bytes);
    EXPECT_NEAR(sync[i].loss, plain[i].loss, 1e-4 * plain[i].loss) << "step " << i + 1;
    EXPECT_NEAR(no_sync[i].loss, plain[i].loss, 1e-4 * plain[i].loss) << "step " << i + 1;
  }
}

// Sampling gathers the model once (generate.unshard) or once per token: the same text.
TEST(TrainerRun, SampleIsTheSameGatheredOnceOrPerToken) {
  std::vector<std::string> samples;
  for (const std::string unshard : {"true", "false"}) {
    const auto run_dir = (fs::path(FSDP_TEST_WORK_DIR) / ("run-sample-" + unshard)).string();
    fs::remove_all(run_dir);
    const auto config = write_config("sample-" + unshard, tiny_config(run_dir));
    const CommandResult r = run(train_cmd() + " --nproc 2 " + config +
                                " --training.steps=2 --training.eval_every=0 "
                                "--training.eval_batches=1 --logging.plot=false "
                                "--generate.tokens=12 --generate.unshard=" +
                                unshard);
    ASSERT_EQ(r.code, 0) << r.output;
    std::ifstream in(fs::path(run_dir) / "sample.txt");
    samples.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  EXPECT_GT(samples[0].size(), 1u);
  EXPECT_EQ(samples[0], samples[1]);
}

// A short run without evaluation, sample or plot: only metrics.jsonl matters.
std::vector<fsdp_trainer::StepMetrics> quick_run(const std::string& name, int nproc,
                                                 const std::string& extra,
                                                 const std::string& preset = "gpt2-test",
                                                 const std::string& env = "") {
  const auto run_dir = (fs::path(FSDP_TEST_WORK_DIR) / ("run-" + name)).string();
  fs::remove_all(run_dir);
  const auto config = write_config(name, tiny_config(run_dir, "gpt", preset));
  const std::string cmd = env + train_cmd() + " --nproc " + std::to_string(nproc) + " " + config +
                          " --training.steps=3 --training.eval_every=0 --training.eval_batches=1"
                          " --generate.tokens=0 --logging.plot=false " +
                          extra;
  const CommandResult r = run(cmd);
  EXPECT_EQ(r.code, 0) << cmd << "\n" << r.output;
  if (r.code != 0)
    return {};
  return fsdp_trainer::read_metrics((fs::path(run_dir) / "metrics.jsonl").string());
}

// The switches bench/step_overheads.py turns the per-step mechanisms off with: without the
// collective accounting (FSDP_COMM_STATS=0) or the peer progress reports (FSDP_PEER_PROGRESS=0)
// the run trains the same losses, bitwise; without accounting, no traffic and no wait is
// counted. Another value is refused with the variable's name.
TEST(TrainerRun, OverheadSwitchesChangeNothingButWhatTheyCount) {
  const auto on = quick_run("switches-on", 2, "");
  const auto off =
      quick_run("switches-off", 2, "", "gpt2-test", "FSDP_COMM_STATS=0 FSDP_PEER_PROGRESS=0 ");
  ASSERT_EQ(on.size(), 3u);
  ASSERT_EQ(off.size(), 3u);
  for (size_t i = 0; i < on.size(); ++i) {
    EXPECT_EQ(on[i].loss, off[i].loss) << "step " << i + 1;
    EXPECT_GT(on[i].allgather_bytes, 0) << "step " << i + 1;
    EXPECT_EQ(off[i].allgather_bytes, 0) << "step " << i + 1;
    EXPECT_EQ(off[i].reducescatter_bytes, 0) << "step " << i + 1;
    EXPECT_EQ(off[i].time_allgather_wait_s, 0.0) << "step " << i + 1;
  }
  const auto bad =
      run("FSDP_COMM_STATS=yes " + train_cmd() + " --nproc 2 " +
          write_config("switches-bad",
                       tiny_config((fs::path(FSDP_TEST_WORK_DIR) / "run-switches-bad").string())) +
          " --training.steps=1 --generate.tokens=0 --logging.plot=false");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.output.find("FSDP_COMM_STATS=\"yes\" must be 0 or 1"), std::string::npos)
      << bad.output;
}

// The same model and data under three strategies, 2 ranks: memory and traffic move the
// documented way (docs/trainer.md, "Choosing a sharding strategy"). gpt2-tiny with 8 blocks:
// enough blocks that holding all of them gathered (shard_grad_op) outweighs full_shard's
// prefetched ones (with 4, 2 in flight plus the gradient buffers come close).
TEST(TrainerRun, StrategiesTradeMemoryForTraffic) {
  const std::vector<std::string> strategies = {"full_shard", "shard_grad_op", "no_shard"};
  std::vector<fsdp_trainer::StepMetrics> last;
  for (const auto& s : strategies) {
    auto m = quick_run("strategy-" + s, 2, "--model.n_layer=8 --fsdp.strategy=" + s, "gpt2-tiny");
    ASSERT_EQ(m.size(), 3u) << s;
    for (const auto& step : m)
      EXPECT_TRUE(std::isfinite(step.loss)) << s << " step " << step.step;
    last.push_back(m.back());  // after step 1: the optimizer state exists
    std::printf(
        "STRATEGY %-13s peak_bytes %lld allgather_bytes %lld reducescatter_bytes %lld "
        "allreduce_bytes %lld loss %.4f\n",
        s.c_str(), static_cast<long long>(m.back().peak_bytes),
        static_cast<long long>(m.back().allgather_bytes),
        static_cast<long long>(m.back().reducescatter_bytes),
        static_cast<long long>(m.back().allreduce_bytes), m.back().loss);
  }
  const auto &full = last[0], &grad_op = last[1], &none = last[2];
  EXPECT_LT(full.peak_bytes, grad_op.peak_bytes);
  EXPECT_LT(grad_op.peak_bytes, none.peak_bytes);
  // full_shard gathers every block twice, shard_grad_op once; the root once in both.
  EXPECT_EQ(none.allgather_bytes, 0);
  EXPECT_GT(grad_op.allgather_bytes, 0);
  EXPECT_LT(grad_op.allgather_bytes, full.allgather_bytes);
  EXPECT_GT(full.reducescatter_bytes, 0);
  EXPECT_EQ(grad_op.reducescatter_bytes, full.reducescatter_bytes);
  EXPECT_EQ(none.reducescatter_bytes, 0);
  // no_shard all-reduces the whole gradient; the others only clipping's norm.
  EXPECT_GT(none.allreduce_bytes, 0);
  EXPECT_GT(none.allreduce_bytes, full.allreduce_bytes);
  // The same model, data and update: the losses agree up to summation order.
  EXPECT_NEAR(grad_op.loss, full.loss, 1e-4 * full.loss);
  EXPECT_NEAR(none.loss, full.loss, 1e-4 * full.loss);
}

// The overlap knobs through the trainer: prefetch, the rate limiter, all-gather buckets and
// Gloo lanes change when bytes move and what is held, never which bytes move or the math.
TEST(TrainerRun, PrefetchKnobsMoveMemoryNotMath) {
  struct Knob {
    std::string name, args;
  };
  const std::vector<Knob> knobs = {
      {"prefetch", ""},
      {"no-prefetch", "--fsdp.forward_prefetch=false --fsdp.backward_prefetch=none"},
      {"limit1", "--fsdp.max_inflight_all_gathers=1"},
      {"one-call-one-lane", "--fsdp.all_gather_bucket_mb=0 --fsdp.gloo_lanes=1"},
      {"tiny-buckets", "--fsdp.all_gather_bucket_mb=0.1 --fsdp.backward_prefetch=backward_post"},
  };
  std::vector<fsdp_trainer::StepMetrics> last;
  for (const auto& k : knobs) {
    auto m = quick_run("knob-" + k.name, 2, "--model.n_layer=8 " + k.args, "gpt2-tiny");
    ASSERT_EQ(m.size(), 3u) << k.name;
    last.push_back(m.back());
    std::printf("KNOB %-18s peak_bytes %lld allgather_bytes %lld allgather_wait %.4f s loss %.6f\n",
                k.name.c_str(), static_cast<long long>(m.back().peak_bytes),
                static_cast<long long>(m.back().allgather_bytes), m.back().time_allgather_wait_s,
                m.back().loss);
  }
  for (size_t i = 1; i < knobs.size(); ++i) {
    // Same collectives, same reduction order: bit-identical losses and byte counts.
    EXPECT_EQ(last[i].loss, last[0].loss) << knobs[i].name;
    EXPECT_EQ(last[i].allgather_bytes, last[0].allgather_bytes) << knobs[i].name;
    EXPECT_EQ(last[i].reducescatter_bytes, last[0].reducescatter_bytes) << knobs[i].name;
  }
  // Prefetch holds the next block while the current one computes; without it, or with one
  // gather at a time, it does not.
  EXPECT_LT(last[1].peak_bytes, last[0].peak_bytes);
  EXPECT_LT(last[2].peak_bytes, last[0].peak_bytes);
}

// [optimizer]: the fused AdamW follows torch's within rounding; its state in a file (bf16 or
// not) gives bitwise the in-memory run's losses, and the metrics count the streamed bytes;
// SGD trains; a directory the state cannot be written to stops the run before its first step.
TEST(TrainerRun, OptimizerChoicesAndOffload) {
  const std::string shape = "--training.steps=4 ";
  // gpt2-tiny: 3.4 MB of AdamW state per rank, against two 64 KiB chunk buffers.
  auto torch_adamw = quick_run("opt-torch", 2, shape + "--optimizer.name=adamw", "gpt2-tiny");
  auto fused = quick_run("opt-fused", 2, shape + "--optimizer.name=adamw_fused", "gpt2-tiny");
  auto offload = quick_run(
      "opt-file", 2, shape + "--optimizer.offload=file --optimizer.chunk_mb=0.0625", "gpt2-tiny");
  auto bf16 = quick_run("opt-bf16", 2, shape + "--optimizer.moments_dtype=bf16");
  auto bf16_file = quick_run(
      "opt-bf16-file", 2,
      shape + "--optimizer.moments_dtype=bf16 --optimizer.offload=file --optimizer.chunk_mb=0.1");
  // CPU offload of the parameters too (on CPU the copies happen but change nothing).
  auto cpu_offload = quick_run("opt-cpu-offload", 2,
                               shape +
                                   "--fsdp.cpu_offload=true --optimizer.offload=file "
                                   "--optimizer.chunk_mb=0.0625",
                               "gpt2-tiny");
  auto sgd = quick_run("opt-sgd", 2, "--training.steps=6 --optimizer.name=sgd --training.lr=0.3");
  for (const auto* m : {&torch_adamw, &fused, &offload, &bf16, &bf16_file, &cpu_offload})
    ASSERT_EQ(m->size(), 4u);
  ASSERT_EQ(sgd.size(), 6u);
  for (size_t i = 0; i < 4; ++i) {
    // One-ulp differences in the parameters (torch's sqrt goes through MKL) move the loss by
    // far less than 1e-5 in 4 steps.
    EXPECT_NEAR(fused[i].loss, torch_adamw[i].loss, 1e-5 * torch_adamw[i].loss) << i;
    EXPECT_EQ(offload[i].loss, fused[i].loss) << "step " << i + 1;
    EXPECT_EQ(cpu_offload[i].loss, fused[i].loss) << "step " << i + 1;
    EXPECT_EQ(bf16_file[i].loss, bf16[i].loss) << "step " << i + 1;
    EXPECT_FALSE(fused[i].offload_read_bytes.has_value());
    ASSERT_TRUE(offload[i].offload_read_bytes.has_value());
    EXPECT_GT(*offload[i].offload_read_bytes, 0);
    EXPECT_EQ(*offload[i].offload_read_bytes, *offload[i].offload_written_bytes);
    ASSERT_TRUE(bf16_file[i].offload_read_bytes.has_value());
    EXPECT_EQ(*bf16_file[i].offload_read_bytes, *bf16_file[i].offload_written_bytes);
  }
  // With the state in the file, the optimizer's resident memory is two chunk buffers.
  EXPECT_LT(*offload.back().mem_optimizer_bytes, *fused.back().mem_optimizer_bytes);
  EXPECT_LT(sgd.back().loss, sgd.front().loss);
  // The offload directory is left empty: the state files were unlinked when opened.
  const auto dir = fs::path(FSDP_TEST_WORK_DIR) / "run-opt-file" / "offload";
  EXPECT_TRUE(fs::is_directory(dir));
  EXPECT_TRUE(fs::is_empty(dir));
  // A directory on a read-only file system: every rank fails before training, naming it.
  const CommandResult r =
      run(train_cmd() + " --nproc 2 " +
          write_config("opt-ro", tiny_config((fs::path(FSDP_TEST_WORK_DIR) / "run-opt-ro").string(),
                                             "gpt", "gpt2-test")) +
          " --optimizer.offload=file --optimizer.offload_dir=/proc");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("optimizer offload directory '/proc': cannot create"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("step 1"), std::string::npos) << r.output;
}

// Activation checkpointing changes memory, not math: the losses are bit-identical, the traffic
// the same, and less is held. bf16 gathers move half the bytes; fp16 runs with a loss scale.
TEST(TrainerRun, CheckpointingAndPrecisionKnobs) {
  const std::string shape = "--model.n_layer=4 ";
  auto plain = quick_run("ac-none", 2, shape);
  auto full = quick_run("ac-full", 2, shape + "--fsdp.activation_checkpointing=full");
  auto selective = quick_run("ac-selective", 2,
                             shape + "--fsdp.activation_checkpointing=selective --fsdp.ac_every=2");
  auto bf16 = quick_run("bf16", 2, shape + "--precision.param_dtype=bf16");
  auto fp16 = quick_run("fp16", 2, shape + "--precision.param_dtype=fp16");
  // fp32 compute over an int8 all-gather and a bf16 reduce-scatter.
  auto int8 = quick_run("int8-gather", 2,
                        shape + "--precision.gather_format=int8 --precision.reduce_dtype=bf16");
  for (const auto* m : {&plain, &full, &selective, &bf16, &fp16, &int8})
    ASSERT_EQ(m->size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(full[i].loss, plain[i].loss) << "step " << i + 1;
    EXPECT_EQ(selective[i].loss, plain[i].loss) << "step " << i + 1;
    EXPECT_EQ(full[i].allgather_bytes, plain[i].allgather_bytes);
    EXPECT_EQ(2 * bf16[i].allgather_bytes, plain[i].allgather_bytes);
    // bf16 keeps 8 bits of mantissa: after 3 steps the loss moves by well under 1%.
    EXPECT_NEAR(bf16[i].loss, plain[i].loss, 1e-2 * plain[i].loss) << "step " << i + 1;
    EXPECT_NEAR(fp16[i].loss, plain[i].loss, 1e-2 * plain[i].loss) << "step " << i + 1;
    // int8 with a scale per 256 values: 1 + 4/256 bytes per value (bf16 for the 1-d
    // parameters), between a quarter and 0.3 of fp32's bytes; the reduction half.
    EXPECT_GT(int8[i].allgather_bytes * 4, plain[i].allgather_bytes);
    EXPECT_LT(int8[i].allgather_bytes * 10, plain[i].allgather_bytes * 3);
    EXPECT_EQ(2 * int8[i].reducescatter_bytes, plain[i].reducescatter_bytes);
    EXPECT_NEAR(int8[i].loss, plain[i].loss, 1e-2 * plain[i].loss) << "step " << i + 1;
    EXPECT_FALSE(plain[i].loss_scale.has_value());
    ASSERT_TRUE(fp16[i].loss_scale.has_value() && fp16[i].skipped_steps.has_value());
    EXPECT_EQ(*fp16[i].loss_scale, 65536.0 / (1 << *fp16[i].skipped_steps));
  }
  EXPECT_LT(full.back().peak_bytes, plain.back().peak_bytes);
  EXPECT_LT(selective.back().peak_bytes, plain.back().peak_bytes);
  // The breakdown of the peak: it sums to the peak; checkpointing moves activations only.
  for (const auto* m : {&plain, &full, &bf16}) {
    const auto& s = m->back();
    ASSERT_TRUE(s.mem_params_bytes && s.mem_grads_bytes && s.mem_optimizer_bytes &&
                s.mem_gathered_bytes && s.mem_activations_bytes && s.mem_other_bytes);
    EXPECT_EQ(*s.mem_params_bytes + *s.mem_grads_bytes + *s.mem_optimizer_bytes +
                  *s.mem_gathered_bytes + *s.mem_activations_bytes + *s.mem_other_bytes,
              s.peak_bytes);
    EXPECT_EQ(*s.mem_params_bytes, *plain.back().mem_params_bytes);
    EXPECT_GT(*s.mem_optimizer_bytes, *s.mem_params_bytes);  // AdamW: two moments
  }
  EXPECT_LT(*full.back().mem_activations_bytes, *plain.back().mem_activations_bytes);
  std::printf("AC peak bytes: none %lld, full %lld, selective every 2 %lld; fp16 scale %g\n",
              (long long)plain.back().peak_bytes, (long long)full.back().peak_bytes,
              (long long)selective.back().peak_bytes, *fp16.back().loss_scale);
}

// --plan: the planner's per-rank peak, predicted before step 1, against what the run measured
// (plan.json, rank 0), within 5% (of the range Gloo's staging buffers leave open) and at the
// same moment and largest category, with the gradients' own peak and each collective's bytes.
// Each test below runs one mechanism that only fsdp-train exercises; bench/plan_accuracy.py
// runs the grid (strategies, world sizes, checkpointing, gathers, the unfused loss, ...).
struct PlanCase {
  std::string name, preset;
  int nproc;
  std::string args;
};

void check_plan_run(const PlanCase& c) {
  const auto run_dir = (fs::path(FSDP_TEST_WORK_DIR) / ("run-" + c.name)).string();
  fs::remove_all(run_dir);
  auto body = tiny_config(run_dir, "gpt", c.preset);
  const auto config = write_config(c.name, body);
  const std::string cmd = train_cmd() + " --nproc " + std::to_string(c.nproc) + " " + config +
                          " --plan --training.steps=3 --training.eval_every=0"
                          " --training.eval_batches=1 --training.batch_size=8"
                          " --training.seq_len=64 --generate.tokens=0 --logging.plot=false " +
                          c.args;
  const CommandResult r = run(cmd);
  ASSERT_EQ(r.code, 0) << cmd << "\n" << r.output;
  EXPECT_NE(r.output.find("predicted peak per rank"), std::string::npos) << r.output;
  std::ifstream in(fs::path(run_dir) / "plan.json");
  ASSERT_TRUE(in.good()) << "no plan.json: " << r.output;
  const auto plan = nlohmann::json::parse(in);
  const auto& p = plan["predicted"];
  const auto& m = plan["measured"];
  const double measured = m["peak"].get<double>();
  EXPECT_GE(measured, 0.95 * p["peak_without_staging"].get<double>()) << c.name << ": " << plan;
  EXPECT_LE(measured, 1.05 * p["peak"].get<double>()) << c.name << ": " << plan;
  // Two moments can peak within a few kB of each other, and which one a run reaches depends on
  // when Gloo frees its staging buffers (a CI run measured backward h2 at 19.52 MB, predicted
  // 19.52 MB, while backward h3, predicted 20.56 MB with staging and 19.49 MB without, stayed
  // below it): the prediction must put the measured moment within 5% of the low end of its
  // range, as the peak itself.
  ASSERT_TRUE(p["moments"].contains(m["moment"].get<std::string>())) << plan;
  EXPECT_GE(p["moments"][m["moment"].get<std::string>()].get<double>(),
            0.95 * p["peak_without_staging"].get<double>())
      << c.name << ": " << plan;
  auto largest = [](const nlohmann::json& categories) {
    std::string best;
    int64_t most = -1;
    for (const auto& [name, bytes] : categories.items()) {
      if (bytes.get<int64_t>() > most)
        best = name, most = bytes.get<int64_t>();
    }
    return best;
  };
  EXPECT_EQ(largest(p["categories"]), largest(m["categories"])) << c.name << ": " << plan;
  // The step time by phase (a figure, not a check: bench/plan_accuracy.py measures it), and
  // the bytes each kind of collective moves per step, exactly as the run counted them.
  ASSERT_TRUE(plan.contains("time") && plan.contains("traffic")) << plan;
  EXPECT_GT(plan["time"]["predicted"]["step"].get<double>(), 0) << plan;
  const auto metrics = fsdp_trainer::read_metrics((fs::path(run_dir) / "metrics.jsonl").string());
  ASSERT_FALSE(metrics.empty());
  const auto& last = metrics.back();
  EXPECT_EQ(plan["traffic"]["all_gather"].get<int64_t>(), last.allgather_bytes) << c.name;
  EXPECT_EQ(plan["traffic"]["reduce_scatter"].get<int64_t>(), last.reducescatter_bytes) << c.name;
  // The global norm's all-reduce (8 bytes, when clipping) is the trainer's, not the model's;
  // with tensor parallelism it goes over the world, not the dp group these count.
  const bool tp = c.args.find("parallel.tp=") != std::string::npos;
  const int64_t norm = c.args.find("grad_clip=0") == std::string::npos && !tp ? 8 : 0;
  EXPECT_EQ(plan["traffic"]["all_reduce"].get<int64_t>() + norm, last.allreduce_bytes) << c.name;
  // The gradients' own high-water mark (the optimizer inside backward and error feedback's
  // residuals move it most), within 5%. Not for bf16 reductions into fp32 grads (root-fp32):
  // there the replay frees each unit's bf16 output as its grads are installed, the engine
  // only once all are, and the measured gradient peak is 1.31x the predicted one (2.53 vs
  // 1.93 MB), below the step's peak, which stays within 5%.
  if (c.name != "plan-root-fp32") {
    const double grads = m["category_peaks"]["gradients"].get<double>();
    EXPECT_NEAR(grads, p["category_peaks"]["gradients"].get<double>(), 0.05 * grads)
        << c.name << ": " << plan;
  }
  // Tensor parallelism: the tp group's bytes per step as the run counted them (tp_bytes), and
  // some traffic there at all.
  if (tp) {
    ASSERT_TRUE(last.tp_bytes.has_value()) << c.name;
    EXPECT_GT(plan["traffic"]["tp"]["bytes"].get<int64_t>(), 0) << plan;
    EXPECT_EQ(plan["traffic"]["tp"]["bytes"].get<int64_t>(), *last.tp_bytes) << c.name;
  }
  std::printf("%s: predicted %lld B, measured %lld B at %s\n", c.name.c_str(),
              (long long)p["peak"].get<int64_t>(), (long long)m["peak"].get<int64_t>(),
              m["moment"].get<std::string>().c_str());
}

// bf16 blocks under an fp32 root (precision.root_fp32: the first run with it, which trains),
// with the fused loss in chunks smaller than the micro-batch (the default chunk covers
// gpt2-tiny's whole micro-batch: 37 splits it).
TEST(TrainerRun, PlanPredictsThePeakWithinFivePercent) {
  check_plan_run({"plan-root-fp32", "gpt2-tiny", 2,
                  "--precision.param_dtype=bf16 --precision.root_fp32=true "
                  "--precision.reduce_dtype=bf16 --training.loss_chunk=37"});
}

// int8 reduce-scatters (the wire in flight, error feedback's residuals) on 3 ranks, and the
// optimizer inside backward at a batch small enough for the gradients to matter.
TEST(TrainerRun, PlanPredictsInt8ReductionsWithTheOptimizerInBackward) {
  check_plan_run({"plan-in-backward-int8", "gpt2-tiny", 3,
                  "--fsdp.optimizer_in_backward=true --training.grad_clip=0 "
                  "--training.batch_size=2 --training.seq_len=16 --precision.reduce_format=int8"});
}

// Tensor parallelism on 4 ranks (a 2 x 2 mesh): the units are one tp rank's parts sharded over
// the dp axis, the activations those of the split blocks with sequence parallelism, and the
// tp group's traffic counted on the meta device equals what the run's group counted.
TEST(TrainerRun, PlanPredictsATensorParallelRunWithSequenceParallelism) {
  check_plan_run({"plan-tp", "gpt2-tiny", 4,
                  "--parallel.tp=2 --parallel.sequence_parallel=true --training.batch_size=4"});
}

// A budget the prediction exceeds: the warning before step 1 names the categories and a
// change predicted to fit.
TEST(TrainerRun, PlanBudgetWarningNamesAChangeThatFits) {
  const auto run_dir = (fs::path(FSDP_TEST_WORK_DIR) / "run-plan-budget").string();
  const auto config = write_config("plan-budget", tiny_config(run_dir, "gpt", "gpt2-tiny"));
  const CommandResult r =
      run(train_cmd() + " --nproc 2 " + config +
          " --training.steps=1 --training.eval_every=0 --training.eval_batches=1"
          " --training.batch_size=8 --training.seq_len=64 --generate.tokens=0"
          " --logging.plot=false --training.memory_budget=20MiB");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("exceeds training.memory_budget = 20.00 MiB (largest: activations"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("the planner predicts"), std::string::npos) << r.output;
}

// fsdp-plan: the per-rank table of a config, one row per rank that predicts differently (3 ranks
// do not divide gpt2-tiny's rows: rank 2 holds less), and the same peak fsdp-train --plan
// predicts for rank 0; bad input is one line and exit code 2.
TEST(FsdpPlan, PrintsEachRanksPeakAndRefusesBadInputInOneLine) {
  const auto run_dir = (fs::path(FSDP_TEST_WORK_DIR) / "run-fsdp-plan").string();
  const auto config = write_config("fsdp-plan", tiny_config(run_dir, "gpt", "gpt2-tiny"));
  const std::string plan = plan_cmd() + " " + config;
  const auto r = run(plan +
                     " --world 3 --training.batch_size=8 --training.seq_len=64 "
                     "--budget 1GiB");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("on 3 rank(s), full_shard, compute fp32, 8 x 64 tokens"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("\n0 "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("\n2 "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("fits: the highest predicted peak"), std::string::npos) << r.output;
  const auto over = run(plan +
                        " --world 2 --training.batch_size=8 --training.seq_len=64 "
                        "--budget 12MiB");
  ASSERT_EQ(over.code, 0) << over.output;
  EXPECT_NE(over.output.find("over budget: rank 0: the predicted peak per rank"), std::string::npos)
      << over.output;
  EXPECT_NE(over.output.find("exceeds --budget = 12.00 MiB"), std::string::npos) << over.output;
  // Tensor parallelism on a 2 x 2 mesh: the tp group's bytes per step are those
  // TrainerRun.PlanPredictsATensorParallelRunWithSequenceParallelism finds equal to a run's
  // (4,767,744 B for this job).
  const auto tp = run(plan +
                      " --world 4 --parallel.tp=2 --parallel.sequence_parallel=true "
                      "--training.batch_size=4 --training.seq_len=64");
  ASSERT_EQ(tp.code, 0) << tp.output;
  EXPECT_NE(tp.output.find("tensor parallelism: 2 group(s) of 2 consecutive ranks"),
            std::string::npos)
      << tp.output;
  EXPECT_NE(tp.output.find("(4.55 MiB in all)"), std::string::npos) << tp.output;
  struct Case {
    std::string args, must_mention;
  };
  const std::vector<Case> bad = {
      {"--world 2 --model.preset=gpt9", "'model.preset' = 'gpt9' is not a gpt preset"},
      {"--world 2 --budget 1KiB", "--budget = 1.00 KiB is below rank 0's model states alone"},
      {"--world 3 --fsdp.strategy=hybrid_shard --fsdp.hybrid_shard_size=2",
       "'fsdp.hybrid_shard_size' = 2 must divide the world size (3 ranks)"},
      {"--world 2 --budget lots", "'--budget' = 'lots' is not a size"},
      {"--world 4 --parallel.tp=3", "'parallel.tp' = 3 must divide the world size (4 ranks)"},
      {"", "--world is required"},
  };
  for (const auto& c : bad) {
    const auto b = run(plan + " " + c.args);
    EXPECT_EQ(b.code, 2) << c.args << "\n" << b.output;
    EXPECT_EQ(line_count(b.output), 1) << c.args << "\n" << b.output;
    EXPECT_NE(b.output.find(c.must_mention), std::string::npos) << c.args << "\n" << b.output;
  }
}

// The plan cache the two --auto tests share: the first measures this machine into it, the second
// reuses that profile (run alone, it measures first).
std::string plan_cache() {
  return (fs::path(FSDP_TEST_WORK_DIR) / "plan-cache").string();
}

// fsdp-plan --auto measures this machine the first time (the profile is saved in the cache) and
// reuses the profile after.
TEST(FsdpPlan, AutoMeasuresTheMachineOnceAndReusesIt) {
  const auto run_dir = (fs::path(FSDP_TEST_WORK_DIR) / "run-fsdp-plan-auto").string();
  const auto config = write_config("fsdp-plan-auto", tiny_config(run_dir, "gpt", "gpt2-tiny"));
  const auto cache = plan_cache();
  fs::remove_all(cache);
  const std::string search = "FSDP_PLAN_CALIBRATION_STEPS=3 FSDP_CACHE_DIR=" + cache + " " +
                             plan_cmd() + " " + config +
                             " --training.seq_len=64 --training.eval_batches=1 --world 2 --auto "
                             "--budget 1GiB --global-batch 8 --space ac=none --space dtype=fp32 "
                             "--space tp=1 --top 1";
  const auto first = run(search);
  ASSERT_EQ(first.code, 0) << first.output;
  EXPECT_NE(first.output.find("machine profile saved: " + cache), std::string::npos)
      << first.output;
  const auto again = run(search);
  ASSERT_EQ(again.code, 0) << again.output;
  EXPECT_NE(again.output.find("machine profile: " + cache), std::string::npos) << again.output;
  EXPECT_EQ(again.output.find("# 2: "), std::string::npos) << again.output;
}

// fsdp-plan --auto: every point of the search space predicted (--json), the fastest that fit
// printed with a TOML snippet each; the first one, run by fsdp-train, stays within the budget.
TEST(FsdpPlan, AutoChoosesAConfigurationThatFits) {
  const auto run_dir = (fs::path(FSDP_TEST_WORK_DIR) / "run-fsdp-plan-auto").string();
  fs::remove_all(run_dir);
  const auto config = write_config("fsdp-plan-auto", tiny_config(run_dir, "gpt", "gpt2-tiny"));
  const auto cache = plan_cache();
  const std::string plan = "FSDP_CACHE_DIR=" + cache + " " + plan_cmd() + " " + config +
                           " --training.seq_len=64 --training.eval_batches=1";
  const auto json_path = (fs::path(FSDP_TEST_WORK_DIR) / "plan-auto.json").string();
  const std::string budget = "14MiB";
  const auto r =
      run(plan + " --world 2 --auto --budget " + budget +
          " --global-batch 8 --space ac=none,full --space dtype=fp32 --json " + json_path);
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* expected : {"\n1 ", "\n5 ", "# 1: ", "[fsdp]\nstrategy = ", "[training]\n"})
    EXPECT_NE(r.output.find(expected), std::string::npos) << expected << "\n" << r.output;
  std::ifstream in(json_path);
  const auto all = nlohmann::json::parse(in);
  // 5 strategies/reshard (full_shard, shard_grad_op, no_shard) x 2 AC x 1 dtype x gathers x
  // offloads x 4 micro-batch sizes, less the repeats; and tp 2 (full_shard over one dp rank).
  ASSERT_GE(all.size(), 40u);
  for (const char* tp : {"parallel.tp=1", "parallel.tp=2"}) {
    EXPECT_TRUE(std::any_of(all.begin(), all.end(), [&](const nlohmann::json& c) {
      const auto& o = c["overrides"];
      // At tp 2 the tensor-parallel group's traffic is in the step.
      const bool split = std::string(tp) == "parallel.tp=2";
      return std::find(o.begin(), o.end(), tp) != o.end() && c["step_s"].get<double>() > 0 &&
             (c["tp_bytes"].get<int64_t>() > 0) == split &&
             (c["phases"]["tensor_parallel"].get<double>() > 0) == split;
    })) << tp;
  }
  const nlohmann::json* chosen = nullptr;
  for (size_t i = 0; i < all.size(); ++i) {
    const auto& c = all[i];
    if (i > 0) {
      EXPECT_LE(c["tokens_per_s"].get<double>(), all[i - 1]["tokens_per_s"].get<double>());
    }
    EXPECT_EQ(c["fits"].get<bool>(), c["peak"].get<double>() * 1.05 <= 14.0 * (1 << 20)) << c;
    if (!chosen && c["fits"].get<bool>())
      chosen = &c;
  }
  ASSERT_NE(chosen, nullptr);
  // The budget cuts the space: some points do not fit (which of them are the fastest depends
  // on this machine's timings).
  EXPECT_TRUE(std::any_of(all.begin(), all.end(),
                          [](const nlohmann::json& c) { return !c["fits"].get<bool>(); }));
  std::string overrides;
  for (const auto& o : (*chosen)["overrides"])
    overrides += " --" + o.get<std::string>();
  const auto train = run(train_cmd() + " --nproc 2 " + config +
                         " --training.seq_len=64 --training.eval_batches=1 --training.steps=3 "
                         "--training.eval_every=0 --generate.tokens=0 --logging.plot=false" +
                         overrides);
  ASSERT_EQ(train.code, 0) << overrides << "\n" << train.output;
  const auto m = fsdp_trainer::read_metrics((fs::path(run_dir) / "metrics.jsonl").string());
  ASSERT_EQ(m.size(), 3u);
  for (const auto& s : m)
    EXPECT_LE(s.peak_bytes, int64_t{14} << 20) << "step " << s.step << overrides;
}

// fsdp-plan --hardware: the table and the time a data sheet allows; bad input to it and to
// --auto: one line, exit 2 (the search that fits nothing searches for a data sheet, so that no
// machine calibration runs).
TEST(FsdpPlan, HardwareAndAutoRefuseBadInputInOneLine) {
  const auto run_dir = (fs::path(FSDP_TEST_WORK_DIR) / "run-fsdp-plan-bad").string();
  const auto config = write_config("fsdp-plan-bad", tiny_config(run_dir, "gpt", "gpt2-tiny"));
  const auto cache = (fs::path(FSDP_TEST_WORK_DIR) / "plan-cache-unused").string();
  const std::string plan = "FSDP_CACHE_DIR=" + cache + " " + plan_cmd() + " " + config +
                           " --training.seq_len=64 --training.eval_batches=1";
  // A data sheet: the table and the time the hardware allows.
  const auto gpu = run(plan + " --world 8 --hardware a100-80gb");
  ASSERT_EQ(gpu.code, 0) << gpu.output;
  EXPECT_NE(gpu.output.find("on 8 rank(s) of NVIDIA A100 80GB SXM4"), std::string::npos)
      << gpu.output;
  EXPECT_NE(gpu.output.find("time on a100-80gb at 100% of its matmul rate: step "),
            std::string::npos)
      << gpu.output;
  EXPECT_NE(gpu.output.find("fits: the highest predicted peak"), std::string::npos) << gpu.output;

  struct Case {
    std::string args, must_mention;
  };
  const std::vector<Case> bad = {
      {"--world 2 --auto --budget 1GiB", "--auto needs --global-batch"},
      {"--world 2 --auto --global-batch 8", "--auto needs --budget"},
      {"--world 2 --auto --budget 1GiB --global-batch 7", "--global-batch 7 is not a multiple"},
      {"--world 2 --auto --budget 1MiB --global-batch 8 --space ac=none --hardware a100-80gb",
       "no configuration fits --budget = 1.00 MiB: the smallest predicted peak is"},
      {"--world 2 --auto --budget 1GiB --global-batch 8 --space colour=red",
       "unknown dimension 'colour'"},
      {"--world 2 --auto --budget 1GiB --global-batch 8 --space ac=sometimes",
       "'sometimes' is not a choice of ac"},
      {"--world 2 --hardware tpu-v9", "unknown hardware profile 'tpu-v9'"},
      {"--world 4 --nproc-per-node 2 --hardware l40s", "describes no multi-node system"},
  };
  for (const auto& c : bad) {
    const auto b = run(plan + " " + c.args);
    EXPECT_EQ(b.code, 2) << c.args << "\n" << b.output;
    EXPECT_EQ(line_count(b.output), 1) << c.args << "\n" << b.output;
    EXPECT_NE(b.output.find(c.must_mention), std::string::npos) << c.args << "\n" << b.output;
  }
  EXPECT_FALSE(fs::exists(cache)) << "a machine calibration ran";
}

// hybrid_shard on 4 ranks in 2 groups of 2: reduce-scatter inside a group, all-reduce of the
// shard across groups, both counted (they run on subgroups, not the world group).
TEST(TrainerRun, HybridShardOnFourRanks) {
  auto m =
      quick_run("strategy-hybrid", 4, "--fsdp.strategy=hybrid_shard --fsdp.hybrid_shard_size=2");
  ASSERT_EQ(m.size(), 3u);
  for (const auto& s : m) {
    EXPECT_TRUE(std::isfinite(s.loss) && s.loss > 0) << "step " << s.step << ": " << s.loss;
    EXPECT_GT(s.allgather_bytes, 0) << "step " << s.step;
    EXPECT_GT(s.reducescatter_bytes, 0) << "step " << s.step;
    EXPECT_GT(s.allreduce_bytes, 0) << "step " << s.step;
  }
  std::printf(
      "STRATEGY hybrid_shard  peak_bytes %lld allgather_bytes %lld reducescatter_bytes "
      "%lld allreduce_bytes %lld loss %.4f\n",
      static_cast<long long>(m.back().peak_bytes), static_cast<long long>(m.back().allgather_bytes),
      static_cast<long long>(m.back().reducescatter_bytes),
      static_cast<long long>(m.back().allreduce_bytes), m.back().loss);
}

// A CPU without fast bf16 (AVX2 only), emulated on any x86 machine: oneDNN limited to AVX2 and
// ATen's kernels to AVX2 make bf16 matmuls ~30-60x slower than fp32 here too. There,
// precision.param_dtype = auto computes in fp32 and says why; an explicit bf16 still runs, with
// a warning giving the measured ratio, and its MFU stays a fraction: the peak is measured on the
// forms the model runs (on such a CPU a bf16 at::linear is ~10x faster than a bf16 at::mm, so a
// peak taken from at::mm alone put MFU above 100%).
TEST(TrainerRun, PrecisionAutoOnAnAvx2CpuComputesInFp32) {
  const std::string avx2 = "ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 ";
  const auto run_dir = (fs::path(FSDP_TEST_WORK_DIR) / "run-precision-auto").string();
  fs::remove_all(run_dir);
  const auto config = write_config("precision-auto", tiny_config(run_dir));
  CommandResult r = run(avx2 + train_cmd() + " --nproc 2 " + config +
                        " --precision.param_dtype=auto --training.steps=2 --training.eval_every=0");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("compute dtype fp32 (precision.param_dtype = auto): this machine's bf16 "
                          "matmuls are "),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("x slower than fp32 ("), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("precision: compute fp32,"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("warning:"), std::string::npos) << r.output;

  // Wide enough for the matmuls to dominate the step (at the test preset's width the step is
  // overhead and MFU is small whatever the peak): there (at batch 4, 3 steps) the old
  // at::mm-only peak gave 203%.
  fs::remove_all(run_dir);
  r = run(avx2 + train_cmd() + " --nproc 2 " + config +
          " --precision.param_dtype=bf16 --model.n_embd=256 --model.n_layer=2 "
          "--training.seq_len=64 --training.batch_size=2 --training.steps=2 "
          "--training.eval_every=0");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(
      r.output.find("warning: precision.param_dtype = bf16: this machine's bf16 matmuls are "),
      std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("precision: compute bf16,"), std::string::npos) << r.output;
  const auto m = fsdp_trainer::read_metrics((fs::path(run_dir) / "metrics.jsonl").string());
  ASSERT_EQ(m.size(), 2u) << r.output;
  for (const auto& s : m) {
    EXPECT_GT(s.mfu, 0) << "step " << s.step;
    EXPECT_LE(s.mfu, 1.0) << "step " << s.step << "\n" << r.output;
  }
  std::printf("AVX2 (emulated) bf16 MFU at step 2: %.1f%%\n", 100 * m.back().mfu);
}

// The Llama family under fsdp-train: its first loss is that of a uniform guess over the
// vocabulary (what a fresh model's small logits give), and sharding does not change its math:
// full_shard gives no_shard's (DDP's) losses at every step, within fp32 rounding (the
// gradients are summed in another order: a reduce-scatter instead of an all-reduce).
TEST(TrainerRun, LlamaShardedTrainsAsReplicated) {
  auto sharded =
      train_and_read("llama-nproc2", train_cmd() + " --nproc 2", "", "llama", "llama-test");
  auto replicated = train_and_read("llama-nproc2-ddp", train_cmd() + " --nproc 2",
                                   "--fsdp.strategy=no_shard", "llama", "llama-test");
  expect_sane(sharded);
  ASSERT_EQ(sharded.size(), replicated.size());
  ASSERT_GE(sharded.size(), 2u);
  const double uniform = std::log(static_cast<double>(kTestVocab));
  EXPECT_NEAR(sharded.front().loss, uniform, 0.1 * uniform) << "first loss vs ln(vocab)";
  for (size_t i = 0; i < sharded.size(); ++i) {
    EXPECT_NEAR(sharded[i].loss, replicated[i].loss, 1e-5 * std::abs(replicated[i].loss))
        << "step " << sharded[i].step;
  }
  // Not the same numbers by accident: training moved the loss.
  EXPECT_NE(sharded.front().loss, sharded.back().loss);
}

// training.loss_chunk: the head and its cross-entropy over chunks of positions give the losses
// of the whole logits (-1) to fp32 rounding (1e-5 relative per step), with a lower peak: 512
// positions per micro-batch of a 512-word vocabulary, whose logits (1 MiB, and as much again
// for their gradient) outweigh what chunking adds (the head's fp32 gradient accumulator).
// GPT (tied head, the embedding's matrix) on 3 ranks with 2 micro-batches, Llama (untied
// `output`) on 2; a chunk size that divides nothing, and the default (0: automatic, here one
// chunk of every position, whose peak is then the unfused one's at most).
TEST(TrainerRun, LossChunkGivesTheSameLossesWithALowerPeak) {
  struct Case {
    std::string arch, preset, launch, args;
  };
  const std::string shape = " --training.batch_size=8 --training.seq_len=64";
  for (const Case& c :
       {Case{"gpt", "gpt2-test", " --nproc 3", shape + " --training.micro_batches=2"},
        Case{"llama", "llama-test", " --nproc 2", shape}}) {
    const auto whole = train_and_read("lc-whole-" + c.arch, train_cmd() + c.launch,
                                      c.args + " --training.loss_chunk=-1", c.arch, c.preset);
    const auto automatic =
        train_and_read("lc-auto-" + c.arch, train_cmd() + c.launch, c.args, c.arch, c.preset);
    const auto chunked = train_and_read("lc-chunked-" + c.arch, train_cmd() + c.launch,
                                        c.args + " --training.loss_chunk=37", c.arch, c.preset);
    ASSERT_EQ(whole.size(), chunked.size()) << c.arch;
    ASSERT_EQ(whole.size(), automatic.size()) << c.arch;
    ASSERT_GE(whole.size(), 2u);
    for (size_t i = 0; i < whole.size(); ++i) {
      EXPECT_NEAR(chunked[i].loss, whole[i].loss, 1e-5 * std::abs(whole[i].loss))
          << c.arch << " step " << whole[i].step;
      EXPECT_NEAR(automatic[i].loss, whole[i].loss, 1e-5 * std::abs(whole[i].loss))
          << c.arch << " step " << whole[i].step;
      EXPECT_LT(chunked[i].peak_bytes, whole[i].peak_bytes) << c.arch << " step " << whole[i].step;
      EXPECT_LE(automatic[i].peak_bytes, whole[i].peak_bytes)
          << c.arch << " step " << whole[i].step;
      // Evaluation goes through the same loss (no gradients).
      ASSERT_EQ(chunked[i].eval_loss.has_value(), whole[i].eval_loss.has_value());
      if (whole[i].eval_loss) {
        EXPECT_NEAR(*chunked[i].eval_loss, *whole[i].eval_loss, 1e-5 * *whole[i].eval_loss)
            << c.arch << " step " << whole[i].step;
      }
    }
    EXPECT_NE(whole.front().loss, whole.back().loss);
    std::printf("%s: peak %lld B whole, %lld B chunked\n", c.arch.c_str(),
                (long long)whole.back().peak_bytes, (long long)chunked.back().peak_bytes);
  }
}

// precision.reduce_format = int8 through the trainer (3 ranks, blocks of 64 so that the tiny
// model's units hold several): the reduce-scatter moves under 40% of fp32's bytes and the
// losses stay within 0.1% of the fp32 reduction's over the run (docs/benchmarks.md has the
// 200-step evidence), with and without error feedback.
TEST(TrainerRun, Int8GradientReductionMovesAQuarterAndTrainsTheSame) {
  const std::string shape = "--model.n_layer=4 --training.batch_size=6 --precision.int8_block=64 ";
  const auto fp32 = quick_run("int8rs-fp32", 3, shape);
  const auto int8 = quick_run("int8rs-int8", 3, shape + "--precision.reduce_format=int8");
  const auto plain = quick_run(
      "int8rs-noef", 3, shape + "--precision.reduce_format=int8 --precision.error_feedback=false");
  ASSERT_EQ(fp32.size(), 3u);
  ASSERT_EQ(int8.size(), 3u);
  ASSERT_EQ(plain.size(), 3u);
  for (size_t i = 0; i < fp32.size(); ++i) {
    EXPECT_LT(int8[i].reducescatter_bytes, 0.4 * fp32[i].reducescatter_bytes) << "step " << i + 1;
    EXPECT_EQ(int8[i].reducescatter_bytes, plain[i].reducescatter_bytes);
    EXPECT_NEAR(int8[i].loss, fp32[i].loss, 1e-3 * fp32[i].loss) << "step " << i + 1;
    EXPECT_NEAR(plain[i].loss, fp32[i].loss, 1e-3 * fp32[i].loss) << "step " << i + 1;
    std::printf(
        "step %zu: loss fp32 %.6f int8 %.6f (no feedback %.6f), reduce-scatter bytes %lld vs "
        "%lld\n",
        i + 1, fp32[i].loss, int8[i].loss, plain[i].loss, (long long)int8[i].reducescatter_bytes,
        (long long)fp32[i].reducescatter_bytes);
  }
  EXPECT_NE(int8.back().loss, fp32.back().loss);  // the gradients did go through int8
}

// fsdp.optimizer_in_backward: each unit steps inside the last micro-batch's backward. Without
// clipping the parameters are bitwise the usual step's, so every loss is equal (3 ranks, one
// micro-batch, two with and without sync on the first). With one micro-batch the gradients no
// longer grow with the model: what is left is the few units' gradients in flight (computed,
// being reduced, stepped), the same at 8 and 16 blocks, while the usual step's peak grows by the
// added blocks' gradient shards. (With several micro-batches the earlier ones' gradients are
// accumulated for the whole model whatever the mode.)
TEST(TrainerRun, OptimizerInBackwardTrainsTheSameWithOneUnitsGradients) {
  std::map<std::string, std::vector<fsdp_trainer::StepMetrics>> runs;
  for (const std::string micro : {"1", "2-sync", "2-nosync"}) {
    for (const std::string blocks : {"8", "16"}) {
      if (micro != "1" && blocks == "16")
        continue;
      std::string args = "--training.batch_size=6 --training.grad_clip=0 --model.n_layer=" + blocks;
      if (micro != "1") {
        args += " --training.micro_batches=2 --fsdp.sync_every_micro_batch=" +
                std::string(micro == "2-sync" ? "true" : "false");
      }
      const std::string key = micro + "-" + blocks;
      const auto& usual = runs["usual-" + key] = quick_run("oib-usual-" + key, 3, args);
      const auto& inside = runs["inside-" + key] =
          quick_run("oib-inside-" + key, 3, args + " --fsdp.optimizer_in_backward=true");
      ASSERT_EQ(usual.size(), 3u);
      ASSERT_EQ(inside.size(), 3u);
      for (size_t i = 0; i < usual.size(); ++i) {
        EXPECT_EQ(inside[i].loss, usual[i].loss) << key << " step " << i + 1;
        ASSERT_TRUE(usual[i].grads_peak_bytes && inside[i].grads_peak_bytes);
        ASSERT_TRUE(usual[i].mem_params_bytes);
        std::printf("%s step %zu: grads peak %lld B usual, %lld B inside backward (params %lld)\n",
                    key.c_str(), i + 1, (long long)*usual[i].grads_peak_bytes,
                    (long long)*inside[i].grads_peak_bytes, (long long)*usual[i].mem_params_bytes);
      }
      EXPECT_NE(usual.front().loss, usual.back().loss);
    }
  }
  const auto &usual8 = runs["usual-1-8"].back(), &usual16 = runs["usual-1-16"].back();
  const auto &inside8 = runs["inside-1-8"].back(), &inside16 = runs["inside-1-16"].back();
  EXPECT_EQ(*inside16.grads_peak_bytes, *inside8.grads_peak_bytes);
  EXPECT_GE(*usual16.grads_peak_bytes - *usual8.grads_peak_bytes,
            *usual16.mem_params_bytes - *usual8.mem_params_bytes);
  EXPECT_LT(*inside16.grads_peak_bytes * 2, *usual16.grads_peak_bytes);
}

// fsdp.optimizer_in_backward with clipping: by the previous step's norm (the only norm known
// while backward still runs), the losses of the usual step clipped the same way, up to the
// norm's summation order; a small clip, so that steps 2 and 3 are scaled.
TEST(TrainerRun, OptimizerInBackwardClipsByThePreviousStepsNorm) {
  const std::string shape = "--model.n_layer=8 --training.batch_size=6 --training.micro_batches=2 ";
  const std::string clip =
      shape + "--training.grad_clip=0.05 --training.grad_clip_mode=previous_step";
  const auto usual = quick_run("oib-clip-usual", 3, clip);
  const auto inside = quick_run("oib-clip-inside", 3, clip + " --fsdp.optimizer_in_backward=true");
  const auto global = quick_run("oib-clip-global", 3, shape + "--training.grad_clip=0.05");
  ASSERT_EQ(usual.size(), 3u);
  ASSERT_EQ(inside.size(), 3u);
  ASSERT_EQ(global.size(), 3u);
  for (size_t i = 0; i < usual.size(); ++i) {
    ASSERT_TRUE(usual[i].grad_norm && inside[i].grad_norm && global[i].grad_norm);
    EXPECT_NEAR(*inside[i].grad_norm, *usual[i].grad_norm, 1e-6 * *usual[i].grad_norm);
    EXPECT_NEAR(inside[i].loss, usual[i].loss, 1e-6 * usual[i].loss) << "step " << i + 1;
  }
  // Step 1 is unclipped by the previous norm and clipped by the global one: step 2 differs.
  EXPECT_GT(*usual[0].grad_norm, 0.05);
  EXPECT_NE(usual[1].loss, global[1].loss);
}

// Every collective of a training job, the trainer's own (losses, memory figures, the random
// states a checkpoint gathers) included, goes through the collectives layer: under the
// collective-sequence check (every collective compared across ranks before it runs) the job
// trains the same losses bit for bit and moves the same bytes on the model's groups.
TEST(TrainerRun, EveryCollectiveOfAJobPassesTheSequenceCheck) {
  const std::string ckpt = " --checkpoint.every=3 --checkpoint.keep=1";
  auto plain = train_and_read("seq-plain", train_cmd() + " --nproc 2", ckpt);
  auto checked = train_and_read("seq-checked", train_cmd() + " --nproc 2",
                                ckpt + " --fsdp.check_collectives=1");
  ASSERT_EQ(plain.size(), checked.size());
  ASSERT_FALSE(plain.empty());
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_EQ(plain[i].loss, checked[i].loss) << "step " << plain[i].step;
    EXPECT_EQ(plain[i].allgather_bytes, checked[i].allgather_bytes) << "step " << plain[i].step;
    EXPECT_EQ(plain[i].reducescatter_bytes, checked[i].reducescatter_bytes);
  }
}

TEST(TrainerRun, TorchrunAndNprocGiveIdenticalLosses) {
  // scripts/setup.sh installs torch with its torchrun: its absence is a broken setup, not a skip.
  ASSERT_TRUE(fs::exists(FSDP_TORCHRUN_PATH)) << "torchrun not found at " << FSDP_TORCHRUN_PATH;
  const std::string torchrun = FSDP_TORCHRUN;
  auto ours = train_and_read("launch-nproc", train_cmd() + " --nproc 2");
  auto theirs = train_and_read("launch-torchrun",
                               "OMP_NUM_THREADS=1 " + torchrun +
                                   " --standalone --no-python --nproc-per-node 2 " + train_cmd());
  ASSERT_EQ(ours.size(), theirs.size());
  for (size_t i = 0; i < ours.size(); ++i) {
    EXPECT_EQ(ours[i].loss, theirs[i].loss) << "step " << ours[i].step;
    EXPECT_EQ(ours[i].eval_loss, theirs[i].eval_loss) << "step " << ours[i].step;
  }
  std::printf("LAUNCH OK: --nproc 2 and torchrun: %zu identical losses, last %.6f\n", ours.size(),
              ours.empty() ? 0.0 : ours.back().loss);
}

// bench/vs_pytorch.py's claim that both sides train the same model on the same batches, kept
// true: fsdp-train full_shard and bench/torch_gpt.py under FSDP2 (fully_shard), 2 ranks, start
// from one GPT-2 safetensors directory that torch_gpt.py writes, read train.bin through their
// own samplers, and must give the same loss at every step. A window or an initial value taken
// differently would show as a difference of order 1e-2, not of rounding.
TEST(TrainerRun, PyTorchMirrorOfTheBenchmarkTrainsTheSameLosses) {
  const auto work = fs::path(FSDP_TEST_WORK_DIR) / "pytorch-mirror";
  fs::remove_all(work);
  fs::create_directories(work);
  const std::string bench = std::string(FSDP_SOURCE_DIR) + "/bench";
  const auto init = (work / "init").string();
  // gpt2-test's shapes with the data's vocabulary (512) and the run's context (16).
  auto r =
      run(std::string(FSDP_PYTHON) + " -c \"import sys; sys.path.insert(0, '" + bench +
          "'); import torch_gpt; torch_gpt.save_gpt('" + init + "', 512, 16, 2, 2, 22, seed=7)\"");
  ASSERT_EQ(r.code, 0) << r.output;
  auto ours = train_and_read("pytorch-mirror", train_cmd() + " --nproc 2",
                             "--model.init_from=" + init + " --training.eval_every=0");
  ASSERT_EQ(ours.size(), 6u);
  const auto steps = (work / "steps").string();
  // FSDP2's 2 ranks as torchrun would start them, forks of the tests' Python server.
  r = run(fsdp::test::python_ranks_command(
      2, FSDP_PYTHON,
      bench + "/torch_gpt.py --mode fsdp2 --hf-dir " + init + " --train-bin " + data_dir() +
          "/train.bin --out " + steps + " --steps 6 --batch 2 --seq-len 16 --warmup-steps 2",
      "TMPDIR=" + work.string()));
  ASSERT_EQ(r.code, 0) << r.output;
  std::vector<double> theirs;
  std::ifstream in(steps + ".0");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("step"))
      theirs.push_back(j.at("loss").get<double>());
  }
  ASSERT_EQ(theirs.size(), ours.size());
  double worst = 0;
  for (size_t i = 0; i < ours.size(); ++i) {
    EXPECT_NEAR(ours[i].loss, theirs[i], 1e-5 * std::abs(theirs[i])) << "step " << i + 1;
    worst = std::max(worst, std::abs(ours[i].loss - theirs[i]));
  }
  std::printf("MIRROR OK: fsdp-train full_shard vs PyTorch FSDP2, 6 steps, max |loss diff| %.2g\n",
              worst);
}

}  // namespace

namespace {

// fsdp-train with checkpoints into `run_dir` (not cleared: a resumed run continues in it).
CommandResult checkpoint_run(const std::string& name, const std::string& run_dir, int nproc,
                             const std::string& extra) {
  const auto config = write_config(name, tiny_config(run_dir, "gpt", "gpt2-test"));
  const std::string cmd = train_cmd() + " --nproc " + std::to_string(nproc) + " " + config +
                          " --training.eval_every=0 --training.eval_batches=1"
                          " --generate.tokens=0 --logging.plot=false " +
                          extra;
  auto r = run(cmd);
  EXPECT_EQ(r.code, 0) << cmd << "\n" << r.output;
  return r;
}

}  // namespace

// logging.tensorboard on a 2-rank run, resumed from its step-3 checkpoint, then run afresh:
// TensorBoard's own reader (tests/python/check_tensorboard.py, which checks every record's
// CRCs) charts at each step the loss, lr and held-out loss of metrics.jsonl (to float32), each
// step once although the resumed run logged steps 4-6 again; a fresh run replaces the files.
TEST(TrainerRun, TensorBoardChartsWhatMetricsJsonlHolds) {
  const auto dir = fs::path(FSDP_TEST_WORK_DIR) / "tensorboard";
  fs::remove_all(dir);
  const auto config = write_config("tensorboard", tiny_config(dir.string()));
  const std::string base = train_cmd() + " --nproc 2 " + config +
                           " --logging.tensorboard=true --logging.plot=false --generate.tokens=0";
  const std::string cmd = base + " --checkpoint.every=3";
  const auto read_back = [&] {
    const auto r = run(std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR +
                       "/tests/python/check_tensorboard.py " + (dir / "tensorboard").string());
    EXPECT_EQ(r.code, 0) << r.output;
    return r.code == 0 ? nlohmann::json::parse(r.output) : nlohmann::json::object();
  };
  const auto f32 = [](double v) { return static_cast<double>(static_cast<float>(v)); };
  auto r = run(cmd);
  ASSERT_EQ(r.code, 0) << cmd << "\n" << r.output;
  EXPECT_NE(r.output.find("tensorboard/"), std::string::npos) << r.output;
  r = run(cmd + " --checkpoint.resume=" + (dir / "checkpoints" / "step-00000003").string());
  ASSERT_EQ(r.code, 0) << r.output;
  const auto m = fsdp_trainer::read_metrics((dir / "metrics.jsonl").string());
  ASSERT_EQ(m.size(), 6u);
  auto tb = read_back();
  ASSERT_EQ(tb["files"].size(), 2u) << tb.dump();
  const auto& records = tb["records"];
  const auto second_start =
      std::find_if(records.begin(), records.end(), [&](const nlohmann::json& x) {
        return x["kind"] == "session_start" && x["file"] == tb["files"][1];
      });
  ASSERT_NE(second_start, records.end());
  EXPECT_EQ((*second_start)["step"], 4);
  const auto& loss = tb["scalars"]["train/loss"];
  const auto& lr = tb["scalars"]["train/lr"];
  const auto& eval = tb["scalars"]["eval/loss"];
  ASSERT_EQ(loss.size(), 6u) << tb.dump();
  ASSERT_EQ(lr.size(), 6u);
  ASSERT_EQ(eval.size(), 2u);  // training.eval_every = 3
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(loss[i][0], m[i].step);
    EXPECT_EQ(loss[i][1].get<double>(), f32(m[i].loss)) << "step " << m[i].step;
    EXPECT_EQ(lr[i][0], m[i].step);
    EXPECT_EQ(lr[i][1].get<double>(), f32(m[i].lr)) << "step " << m[i].step;
  }
  EXPECT_EQ(eval[0][0], 3);
  EXPECT_EQ(eval[0][1].get<double>(), f32(*m[2].eval_loss));
  EXPECT_EQ(eval[1][0], 6);
  EXPECT_EQ(eval[1][1].get<double>(), f32(*m[5].eval_loss));
  // Every field of the line has its chart (memory by category, waits, collective bytes...).
  for (const auto& s : fsdp_trainer::tensorboard_scalars(m[5]))
    EXPECT_TRUE(tb["scalars"].contains(s.tag)) << s.tag;
  r = run(base + " --training.steps=2");
  ASSERT_EQ(r.code, 0) << r.output;
  tb = read_back();
  EXPECT_EQ(tb["files"].size(), 1u) << tb.dump();
  EXPECT_EQ(tb["scalars"]["train/loss"].size(), 2u) << tb.dump();
}

// training.grad_clip_mode = previous_step with the optimizer inside backward: the previous
// step's norm travels in the checkpoint, so a job resumed from step 3 clips step 4 as the
// uninterrupted one did and every loss is equal bit for bit (a clip small enough to scale every
// step).
TEST(TrainerRun, PreviousStepClippingResumesExactly) {
  const auto work = fs::path(FSDP_TEST_WORK_DIR);
  const auto a = work / "prevclip-a", b = work / "prevclip-b";
  for (const auto& d : {a, b})
    fs::remove_all(d);
  const std::string args =
      "--training.steps=6 --checkpoint.every=3 --training.grad_clip=0.05 "
      "--training.grad_clip_mode=previous_step --fsdp.optimizer_in_backward=true";
  checkpoint_run("prevclip-a", a.string(), 3, args);
  checkpoint_run("prevclip-b", b.string(), 3, args);
  auto resumed = checkpoint_run(
      "prevclip-b", b.string(), 3,
      args + " --checkpoint.resume=" + (b / "checkpoints" / "step-00000003").string());
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
  auto ma = fsdp_trainer::read_metrics((a / "metrics.jsonl").string());
  auto mb = fsdp_trainer::read_metrics((b / "metrics.jsonl").string());
  ASSERT_EQ(ma.size(), 6u);
  ASSERT_EQ(mb.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(ma[i].loss, mb[i].loss) << "step " << i + 1;
    ASSERT_TRUE(ma[i].grad_norm && mb[i].grad_norm);
    EXPECT_GT(*ma[i].grad_norm, 0.05) << "step " << i + 1 << ": not clipped";
  }
}

// 6 steps in one go vs a job that resumes from its step-3 checkpoint (as after a crash there) and
// redoes steps 4-6, under full_shard and under no_shard: the same losses bit for bit and byte-
// identical checkpoints at step 6 (parameters, AdamW state, data position and step all restored;
// the step-6 checkpoint it replaces is moved aside and removed only once the new one is
// complete). Then the step-3 checkpoint resumes on 3 ranks under shard_grad_op (resharding), and
// checkpoint.keep removes the oldest.
// A checkpoint to resume from, or a model.init_from, that cannot be read is refused before the
// job measures the machine and builds its model (precision.param_dtype = auto's measurement
// line comes before the build, and must not appear).
TEST(TrainerRun, ABadSavedInputIsRefusedBeforeTheModelIsBuilt) {
  const auto work = fs::path(FSDP_TEST_WORK_DIR) / "bad-saved-input";
  fs::remove_all(work);
  fs::create_directories(work / "ckpt" / "step-00000001");
  std::ofstream(work / "ckpt" / "step-00000001" / "index.json") << "{\"format\": \"nope\"}";
  const auto config = write_config("bad-saved-input", tiny_config((work / "run").string()));
  const std::string cmd = train_cmd() + " --nproc 2 " + config + " --precision.param_dtype=auto ";
  auto r = run(cmd + "--checkpoint.resume=" + (work / "ckpt" / "step-00000001").string());
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find((work / "ckpt" / "step-00000001" / "index.json").string() +
                          ": not an fsdp-cpp checkpoint index"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("compute dtype"), std::string::npos) << r.output;
  fs::create_directories(work / "empty");  // a directory, but neither kind of saved model
  r = run(cmd + "--model.init_from=" + (work / "empty").string());
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("is neither a sharded checkpoint"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("compute dtype"), std::string::npos) << r.output;
}

// checkpoint.async: the same checkpoints as synchronous saves, byte for byte, written while the
// steps after them run; the run says how long the step that saved stalled.
TEST(TrainerRun, AsyncCheckpointsEqualSynchronousOnes) {
  const auto work = fs::path(FSDP_TEST_WORK_DIR);
  const auto sync = work / "ckpt-sync", async = work / "ckpt-async";
  for (const auto& d : {sync, async})
    fs::remove_all(d);
  const std::string args = "--training.steps=6 --checkpoint.every=3 --checkpoint.keep=2";
  checkpoint_run("ckpt-sync", sync.string(), 2, args);
  const auto r = checkpoint_run("ckpt-async", async.string(), 2, args + " --checkpoint.async=true");
  EXPECT_NE(r.output.find("step 3: checkpoint"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("training stalled"), std::string::npos) << r.output;
  const auto ms = fsdp_trainer::read_metrics((sync / "metrics.jsonl").string());
  const auto ma = fsdp_trainer::read_metrics((async / "metrics.jsonl").string());
  ASSERT_EQ(ma.size(), ms.size());
  for (size_t i = 0; i < ms.size(); ++i)
    EXPECT_EQ(ma[i].loss, ms[i].loss) << "step " << i + 1;
  for (const char* step : {"step-00000003", "step-00000006"}) {
    for (const char* f : {"rank-00000.safetensors", "rank-00001.safetensors"}) {
      const auto x = file_bytes(sync / "checkpoints" / step / f);
      EXPECT_FALSE(x.empty()) << step << "/" << f;
      EXPECT_TRUE(x == file_bytes(async / "checkpoints" / step / f)) << step << "/" << f;
    }
    EXPECT_FALSE(fs::exists(async / "checkpoints" / (std::string(step) + ".tmp")));
  }
}

TEST(TrainerRun, ResumeIsExactAndReshards) {
  const auto work = fs::path(FSDP_TEST_WORK_DIR);
  const auto a = work / "resume-a", b = work / "resume-b", c = work / "resume-c";
  for (const auto& d : {a, b, c})
    fs::remove_all(d);
  const std::string every = " --checkpoint.every=3";
  checkpoint_run("resume-a", a.string(), 2, "--training.steps=6" + every);
  checkpoint_run("resume-b", b.string(), 2, "--training.steps=6" + every);
  {
    // The step-6 checkpoint the resumed job must write again is spoiled; its metrics lines
    // from step 4 on are dropped by the resumed job and written anew.
    std::ofstream(b / "checkpoints" / "step-00000006" / "rank-00000.safetensors",
                  std::ios::binary | std::ios::trunc)
        << "stale";
  }
  auto resumed = checkpoint_run("resume-b", b.string(), 2,
                                "--training.steps=6 --checkpoint.resume=" +
                                    (b / "checkpoints" / "step-00000003").string() + every);
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
  auto ma = fsdp_trainer::read_metrics((a / "metrics.jsonl").string());
  auto mb = fsdp_trainer::read_metrics((b / "metrics.jsonl").string());
  ASSERT_EQ(ma.size(), 6u);
  ASSERT_EQ(mb.size(), 6u);
  for (size_t i = 0; i < 6; ++i)
    EXPECT_EQ(ma[i].loss, mb[i].loss) << "step " << i + 1;
  for (const char* f : {"rank-00000.safetensors", "rank-00001.safetensors"}) {
    const auto x = file_bytes(a / "checkpoints" / "step-00000006" / f);
    EXPECT_FALSE(x.empty());
    EXPECT_TRUE(x == file_bytes(b / "checkpoints" / "step-00000006" / f)) << f;
  }
  // Exact under no_shard too (replicated rows: rank 0 writes them, every rank reads them).
  const auto d = work / "resume-d", e = work / "resume-e";
  for (const auto& dir : {d, e})
    fs::remove_all(dir);
  const std::string no_shard = " --fsdp.strategy=no_shard" + every;
  checkpoint_run("resume-d", d.string(), 2, "--training.steps=6" + no_shard);
  checkpoint_run("resume-e", e.string(), 2, "--training.steps=6" + no_shard);
  checkpoint_run("resume-e", e.string(), 2,
                 "--training.steps=6 --checkpoint.resume=" +
                     (e / "checkpoints" / "step-00000003").string() + no_shard);
  auto md = fsdp_trainer::read_metrics((d / "metrics.jsonl").string());
  auto me = fsdp_trainer::read_metrics((e / "metrics.jsonl").string());
  ASSERT_EQ(md.size(), 6u);
  ASSERT_EQ(me.size(), 6u);
  for (size_t i = 0; i < 6; ++i)
    EXPECT_EQ(md[i].loss, me[i].loss) << "no_shard, step " << i + 1;
  const auto x = file_bytes(d / "checkpoints" / "step-00000006" / "rank-00000.safetensors");
  EXPECT_FALSE(x.empty());
  EXPECT_TRUE(x == file_bytes(e / "checkpoints" / "step-00000006" / "rank-00000.safetensors"));
  EXPECT_FALSE(fs::exists(d / "checkpoints" / "step-00000006" / "rank-00001.safetensors"));

  // Another world size and strategy, from a given directory.
  const auto from = (a / "checkpoints" / "step-00000003").string();
  checkpoint_run("resume-c", c.string(), 3,
                 "--training.steps=5 --fsdp.strategy=shard_grad_op --checkpoint.every=1 "
                 "--checkpoint.keep=1 --checkpoint.resume=" +
                     from);
  auto mc = fsdp_trainer::read_metrics((c / "metrics.jsonl").string());
  ASSERT_EQ(mc.size(), 2u);
  EXPECT_EQ(mc.front().step, 4);
  // Same model, same position in the data: the first resumed loss is near the 2-rank one.
  EXPECT_NEAR(mc.front().loss, ma[3].loss, 0.05 * ma[3].loss);
  // keep = 1: only step 5 is left.
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(c / "checkpoints"))
    left.push_back(e.path().filename().string());
  EXPECT_EQ(left, std::vector<std::string>{"step-00000005"});
  // Nothing to resume from is a clear error.
  const auto config = write_config("resume-none", tiny_config((work / "resume-none").string()));
  auto none = run(train_cmd() + " " + config + " --checkpoint.resume=latest --generate.tokens=0");
  EXPECT_NE(none.code, 0);
  EXPECT_NE(none.output.find("no complete checkpoint"), std::string::npos) << none.output;
}

// parallel.tp = 2 on 4 ranks (dp 2) trains what plain FSDP on 2 ranks trains: the same batches
// (each tp group reads one dp rank's part), the same initial values (each rank fills its parts of
// the whole tensors), every step's loss within 1e-5 in fp32. Its checkpoints hold whole tensors:
// one saved with tp 2 resumes with tp 1, one saved with tp 1 resumes with tp 2, and the steps
// after equal the plain run's within 1e-5. Its Hugging Face export is byte for byte the plain
// job's export of the same checkpoint. A tp that does not divide the heads or the world, or
// goes with what it does not support yet, is refused in one line.
TEST(TrainerRun, TensorParallelTrainsAndResumesLikeDataParallel) {
  const auto work = fs::path(FSDP_TEST_WORK_DIR);
  const auto plain = work / "tp-plain", split = work / "tp-split", back = work / "tp-back",
             exported = work / "tp-export";
  for (const auto& d : {plain, split, back, exported})
    fs::remove_all(d);
  const std::string common = " --precision.param_dtype=fp32 --checkpoint.every=4";
  checkpoint_run("tp-plain", plain.string(), 2, "--training.steps=8" + common);
  auto tp_run =
      checkpoint_run("tp-split", split.string(), 4,
                     "--training.steps=8 --parallel.tp=2 --checkpoint.export_hf=true" + common);
  EXPECT_NE(tp_run.output.find("mesh: dp 2 x tp 2"), std::string::npos) << tp_run.output;
  const auto want = fsdp_trainer::read_metrics((plain / "metrics.jsonl").string());
  ASSERT_EQ(want.size(), 8u);
  double worst = 0;
  auto compare = [&](const fs::path& run_dir, size_t first, const char* what) {
    const auto got = fsdp_trainer::read_metrics((run_dir / "metrics.jsonl").string());
    ASSERT_EQ(got.size(), 8 - first) << what;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].step, static_cast<int64_t>(first + i) + 1) << what;
      EXPECT_NEAR(got[i].loss, want[first + i].loss, 1e-5) << what << ", step " << first + i + 1;
      EXPECT_EQ(got[i].tokens, want[first + i].tokens) << what << ": tokens counted once";
      worst = std::max(worst, std::abs(got[i].loss - want[first + i].loss));
    }
  };
  compare(split, 0, "tp 2");
  {
    // The tp groups' traffic is counted apart from the units' (dp) groups', the same every step;
    // a plain run has none.
    const auto tp = fsdp_trainer::read_metrics((split / "metrics.jsonl").string());
    for (const auto& m : tp) {
      ASSERT_TRUE(m.tp_bytes.has_value()) << "step " << m.step;
      EXPECT_GT(*m.tp_bytes, 0);
      EXPECT_EQ(*m.tp_bytes, *tp.front().tp_bytes) << "step " << m.step;
    }
    EXPECT_FALSE(want.front().tp_bytes.has_value());
    EXPECT_NE(file_bytes(split / "breakdown.txt").find("tensor parallel "), std::string::npos);
  }
  // The export at tp 2 is the plain job's export of the same checkpoint.
  const auto config = write_config("tp-plain", tiny_config(plain.string()));
  auto r = run(train_cmd() + " export --nproc 2 " + config + " --checkpoint " +
               (split / "checkpoints" / "step-00000008").string() + " --out " + exported.string());
  ASSERT_EQ(r.code, 0) << r.output;
  const auto from_tp = file_bytes(split / "hf" / "model.safetensors");
  EXPECT_FALSE(from_tp.empty());
  EXPECT_TRUE(from_tp == file_bytes(exported / "model.safetensors"));
  EXPECT_FALSE(fs::exists(split / "hf.tp-staging"));
  // tp 2 -> 1 (steps 5-8 again, in the same run directory) and 1 -> 2.
  checkpoint_run("tp-split", split.string(), 2,
                 "--training.steps=8 --checkpoint.resume=" +
                     (split / "checkpoints" / "step-00000004").string() + common);
  compare(split, 0, "tp 2, then tp 1 from step 4");
  checkpoint_run("tp-back", back.string(), 4,
                 "--training.steps=8 --parallel.tp=2 --checkpoint.resume=" +
                     (plain / "checkpoints" / "step-00000004").string() + common);
  compare(back, 4, "tp 1, then tp 2 from step 4");
  // hybrid_shard on the dp axis: shards of 1 dp rank, replicated twice.
  const auto hybrid = work / "tp-hybrid";
  fs::remove_all(hybrid);
  checkpoint_run("tp-hybrid", hybrid.string(), 4,
                 "--training.steps=8 --parallel.tp=2 --fsdp.strategy=hybrid_shard "
                 "--fsdp.hybrid_shard_size=1" +
                     common);
  compare(hybrid, 0, "tp 2, hybrid_shard on dp");
  // Sequence parallelism: the same losses, and the sample of a prompt the group's size does not
  // divide is the plain run's.
  const auto sequence = work / "tp-sequence";
  fs::remove_all(sequence);
  checkpoint_run("tp-sequence", sequence.string(), 4,
                 "--training.steps=8 --parallel.tp=2 --parallel.sequence_parallel=true" + common);
  compare(sequence, 0, "tp 2, sequence parallel");
  auto sample = [&](const std::string& args) {
    auto g = run(train_cmd() + " generate " + args + " " + config + " --checkpoint " +
                 (plain / "checkpoints" / "step-00000008").string());
    EXPECT_EQ(g.code, 0) << g.output;
    const auto at = g.output.find("sample (");
    return at == std::string::npos ? g.output : g.output.substr(at);
  };
  EXPECT_EQ(sample("--nproc 2"),
            sample("--nproc 4 --parallel.tp=2 --parallel.sequence_parallel=true"));
  std::printf(
      "TP TRAINER OK: 8 steps at tp 2, resumed at tp 1 and from tp 1, largest loss "
      "difference %.3g\n",
      worst);

  for (const auto& [args, refusal] : std::vector<std::pair<std::string, std::string>>{
           {"--nproc 3 --parallel.tp=2", "'parallel.tp' = 2 must divide the world size (3 ranks)"},
           {"--nproc 2 --parallel.sequence_parallel=true",
            "'parallel.sequence_parallel' needs parallel.tp > 1"},
           {"--nproc 2 --parallel.tp=2 --parallel.sequence_parallel=true --training.seq_len=15",
            "'parallel.sequence_parallel' needs training.seq_len (15) divisible by parallel.tp "
            "(2)"},
           {"--nproc 4 --parallel.tp=4", "'parallel.tp' = 4: tensor_parallelize_gpt: n_head 2"},
           {"--nproc 4 --parallel.tp=2 --fsdp.strategy=hybrid_shard --fsdp.hybrid_shard_size=3",
            "'fsdp.hybrid_shard_size' = 3 must divide the data-parallel ranks (world 4 / "
            "parallel.tp 2 = 2)"},
       }) {
    auto bad = run(train_cmd() + " " + config + " " + args + " --training.steps=1");
    EXPECT_NE(bad.code, 0) << args;
    EXPECT_NE(bad.output.find(refusal), std::string::npos) << args << "\n" << bad.output;
  }
}

namespace {

// The line "<prefix><number>" of `output`, as the number (NaN if absent).
double number_after(const std::string& output, const std::string& prefix) {
  const auto at = output.find(prefix);
  return at == std::string::npos ? std::nan("") : std::stod(output.substr(at + prefix.size()));
}

}  // namespace

// A saved model used again: checkpoint.export_hf writes a Hugging Face directory at the end of
// training; `fsdp-train export` writes the same bytes from the step-6 checkpoint on another
// number of ranks; `fsdp-train generate` samples the run's own text from the checkpoint and
// from the export; model.init_from starts a new run from the export with the trained model's
// held-out loss. Misuse of the commands is one line and exit code 2.
TEST(TrainerRun, ExportGenerateAndInitFromSavedModels) {
  const auto work = fs::path(FSDP_TEST_WORK_DIR);
  const auto a = work / "saved-a", b = work / "saved-b", out = work / "saved-export";
  for (const auto& d : {a, b, out})
    fs::remove_all(d);
  const auto config = write_config("saved", tiny_config(a.string(), "llama", "llama-test"));
  auto trained = run(train_cmd() + " --nproc 2 " + config +
                     " --checkpoint.every=3 --checkpoint.export_hf=true --logging.plot=false");
  ASSERT_EQ(trained.code, 0) << trained.output;
  const auto hf = a / "hf";
  ASSERT_TRUE(fs::exists(hf / "config.json") && fs::exists(hf / "model.safetensors"));
  const auto sample = file_bytes(a / "sample.txt");
  ASSERT_FALSE(sample.empty());

  auto exported = run(train_cmd() + " export --nproc 3 " + config + " --checkpoint latest --out " +
                      out.string());
  ASSERT_EQ(exported.code, 0) << exported.output;
  EXPECT_TRUE(file_bytes(out / "model.safetensors") == file_bytes(hf / "model.safetensors"));
  EXPECT_TRUE(file_bytes(out / "config.json") == file_bytes(hf / "config.json"));
  // Both carry the run's tokenizer as transformers reads it (test_hf_model.cpp checks that
  // it encodes as ours): tokenizer.json written from data.dir's tokenizer.model.
  const fsdp_trainer::Tokenizer tok((fs::path(data_dir()) / "tokenizer.model").string());
  for (const auto& [name, bytes] : fsdp_trainer::tokenizer_export_files(tok, 16)) {
    EXPECT_TRUE(file_bytes(hf / name) == bytes) << name;
    EXPECT_TRUE(file_bytes(out / name) == bytes) << name;
  }

  for (const auto& from : {(a / "checkpoints" / "step-00000006").string(), hf.string()}) {
    auto g = run(train_cmd() + " generate --nproc 2 " + config + " --checkpoint " + from);
    ASSERT_EQ(g.code, 0) << g.output;
    EXPECT_NE(g.output.find(sample), std::string::npos) << from << "\n" << g.output;
  }
  // generate never writes into the run directory.
  EXPECT_TRUE(file_bytes(a / "sample.txt") == sample);

  // New runs starting from the export: on 2 ranks (the trained run's held-out batches) the
  // step-0 held-out loss is the trained model's final one; on 3 ranks, from the export and from
  // the step-6 checkpoint, the same.
  const auto b_config = write_config("saved-b", tiny_config(b.string(), "llama", "llama-test"));
  auto start_from = [&](int nproc, const std::string& from) {
    auto r = run(train_cmd() + " --nproc " + std::to_string(nproc) + " " + b_config +
                 " --training.steps=1 --logging.plot=false --generate.tokens=0 "
                 "--model.init_from=" +
                 from);
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("parameters from " + from), std::string::npos) << r.output;
    return number_after(r.output, "step 0: held-out loss ");
  };
  const double trained_loss = number_after(trained.output, "step 6: held-out loss ");
  EXPECT_EQ(start_from(2, hf.string()), trained_loss) << trained.output;
  EXPECT_EQ(start_from(3, hf.string()),
            start_from(3, (a / "checkpoints" / "step-00000006").string()));

  // checkpoint.export_dtype / export_shard_mb: bf16 in sharded files with their index (half the
  // bytes), which a new run starts from with the held-out loss of the rounded weights.
  const auto half = work / "saved-export-bf16";
  fs::remove_all(half);
  auto sharded =
      run(train_cmd() + " export --nproc 3 " + config + " --checkpoint latest --out " +
          half.string() + " --checkpoint.export_dtype=bf16 --checkpoint.export_shard_mb=0.02");
  ASSERT_EQ(sharded.code, 0) << sharded.output;
  EXPECT_FALSE(fs::exists(half / "model.safetensors"));
  ASSERT_TRUE(fs::exists(half / "model.safetensors.index.json"));
  uintmax_t bf16_bytes = 0;
  int files = 0;
  for (const auto& e : fs::directory_iterator(half)) {
    if (e.path().extension() == ".safetensors") {
      bf16_bytes += e.file_size();
      ++files;
    }
  }
  EXPECT_GE(files, 3);
  const auto fp32_bytes = fs::file_size(hf / "model.safetensors");
  EXPECT_LT(bf16_bytes, fp32_bytes * 6 / 10) << bf16_bytes << " vs " << fp32_bytes;
  EXPECT_NE(file_bytes(half / "config.json").find("\"torch_dtype\": \"bfloat16\""),
            std::string::npos);
  const double rounded_loss = start_from(2, half.string());
  EXPECT_NEAR(rounded_loss, trained_loss, 0.02 * trained_loss);
  std::printf("bf16 export in %d files, %ju bytes (fp32: %ju): held-out loss %.5f (fp32 %.5f)\n",
              files, bf16_bytes, fp32_bytes, rounded_loss, trained_loss);

  struct Case {
    std::string args, message;
  };
  const std::vector<Case> misuse = {
      {"export " + config + " --checkpoint latest", "export needs --out DIR"},
      {"generate " + config, "this command needs --checkpoint PATH"},
      {config + " --checkpoint latest", "--checkpoint and --out belong to the commands"},
      {"export " + config + " --checkpoint " + work.string() + " --out " + (work / "x").string(),
       "is neither a sharded checkpoint (index.json) nor a Hugging Face directory"},
      {config + " --model.init_from=" + (work / "missing").string(),
       "'model.init_from' '" + (work / "missing").string() + "' is not a directory"}};
  for (const auto& c : misuse) {
    auto r = run(train_cmd() + " " + c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << c.args << "\n" << r.output;
  }
  // An export never overwrites: exit 1, the directory untouched.
  auto twice =
      run(train_cmd() + " export " + config + " --checkpoint latest --out " + out.string());
  EXPECT_EQ(twice.code, 1);
  EXPECT_NE(twice.output.find("exists (exports are never overwritten)"), std::string::npos)
      << twice.output;
}

// A fresh run in the directory of an earlier, longer one: its first checkpoint replaces the
// earlier run's later ones (which "latest" would otherwise resume), and is itself kept.
TEST(TrainerRun, AFreshRunReplacesTheCheckpointsOfAnEarlierLongerRun) {
  const auto dir = fs::path(FSDP_TEST_WORK_DIR) / "replaced";
  fs::remove_all(dir);
  const auto config = write_config("replaced", tiny_config(dir.string()));
  const std::string common = " --logging.plot=false --generate.tokens=0 --checkpoint.every=2";
  auto first = run(train_cmd() + " --nproc 2 " + config + common);
  ASSERT_EQ(first.code, 0) << first.output;
  const auto ckpt = dir / "checkpoints";
  EXPECT_TRUE(fs::exists(ckpt / "step-00000006") && fs::exists(ckpt / "step-00000004"));
  auto fresh = run(train_cmd() + " --nproc 2 " + config + common + " --training.steps=2");
  ASSERT_EQ(fresh.code, 0) << fresh.output;
  EXPECT_TRUE(fs::exists(ckpt / "step-00000002" / "index.json"));
  EXPECT_FALSE(fs::exists(ckpt / "step-00000004"));
  EXPECT_FALSE(fs::exists(ckpt / "step-00000006"));
  EXPECT_NE(fresh.output.find("a checkpoint of the run this one replaced"), std::string::npos)
      << fresh.output;
}

namespace {

// A job started in the background (sh -c), its output in `log`.
struct BackgroundJob {
  pid_t pid = -1;
  std::string log;

  std::unique_ptr<fsdp::test::CommandTimer> timer;

  BackgroundJob(const std::string& command, std::string log_path)
      : log(std::move(log_path)), timer(std::make_unique<fsdp::test::CommandTimer>(command)) {
    const std::string line = command + " > " + log + " 2>&1";
    pid = ::fork();
    if (pid == 0) {
      ::setpgid(0, 0);  // its own process group: killed whole if the test gives up
      ::execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
  }
  // Exit code, or -1 after `seconds` (the whole group is then killed).
  int wait(double seconds) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    int status = 0;
    while (::waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > until) {
        ::kill(-pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        pid = -1;
        return -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    pid = -1;
    timer.reset();
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  ~BackgroundJob() {
    if (pid > 0)
      wait(0);
  }
  std::string output() const { return file_bytes(log); }
};

// The process whose environment holds every one of `vars` ("KEY=value"), or 0.
pid_t find_process_with_env(const std::vector<std::string>& vars) {
  for (const auto& e : fs::directory_iterator("/proc")) {
    const auto name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos)
      continue;
    const auto environ_bytes = file_bytes(e.path() / "environ");
    std::set<std::string> entries;
    for (size_t at = 0; at < environ_bytes.size();) {
      const auto end = environ_bytes.find('\0', at);
      entries.insert(environ_bytes.substr(at, end - at));
      at = end == std::string::npos ? environ_bytes.size() : end + 1;
    }
    if (std::all_of(vars.begin(), vars.end(), [&](const auto& v) { return entries.count(v); }))
      return static_cast<pid_t>(std::stol(name));
  }
  return 0;
}

// The pid a fault-tolerant job's launcher (1-rank replicas) last named for `rank` in `output`
// ("fsdp launch: ranks 0-2 started (pids 11, 12, 13)", "fsdp launch: rank 0 started (pid 11)",
// "fsdp launch: replica 1 restarted (incarnation 1, pid 14)"), or 0.
pid_t pid_named_by_launcher(const std::string& output, int rank) {
  static const std::regex started(
      R"(fsdp launch: ranks? (\d+)(?:-\d+)? started \(pids? ([\d, ]+)\))");
  static const std::regex restarted(
      R"(fsdp launch: replica (\d+) restarted \(incarnation \d+, pid (\d+)\))");
  pid_t pid = 0;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (std::regex_search(line, m, restarted) && std::stoi(m[1]) == rank) {
      pid = static_cast<pid_t>(std::stol(m[2]));
    } else if (std::regex_search(line, m, started)) {
      std::istringstream pids(m[2].str());
      int r = std::stoi(m[1]);
      for (std::string p; std::getline(pids, p, ','); ++r) {
        if (r == rank)
          pid = static_cast<pid_t>(std::stol(p));
      }
    }
  }
  return pid;
}

// Waits for `path` to exist; false after `seconds`.
bool wait_for(const fs::path& path, double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!fs::exists(path)) {
    if (std::chrono::steady_clock::now() > until)
      return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// The restart tests' job: 25 steps of 2 x 32 tokens (about 1 s of steps on two cores), a
// checkpoint every 5. The kill follows the step-5 checkpoint; 15 steps after it, the step-20
// one must not exist yet (the kill came mid-run).
constexpr int kRestartSteps = 25;
const std::string kRestartArgs =
    " --training.steps=25 --training.seq_len=32 --training.batch_size=2 "
    "--training.eval_every=0 --generate.tokens=0 --logging.plot=false";

// That job under torchrun; once its step-5 checkpoint is complete, rank `victim` of the first
// attempt is SIGKILLed (within a few steps of it: far from the end). Returns the job's exit code.

int torchrun_with_a_killed_rank(const std::string& name, const fs::path& run_dir, int nproc,
                                int max_restarts, int victim, std::string* output) {
  const std::string tag = "FSDP_TEST_TAG=" + name + "-" + std::to_string(::getpid());
  const auto config =
      write_config(name, tiny_config(run_dir.string(), "gpt", "gpt2-tiny") +
                             "[checkpoint]\nevery = 5\nkeep = 3\nresume = \"auto\"\n");
  BackgroundJob job(tag + " OMP_NUM_THREADS=1 " + std::string(FSDP_TORCHRUN) +
                        " --standalone --no-python --max-restarts=" + std::to_string(max_restarts) +
                        " --nproc-per-node " + std::to_string(nproc) + " " + train_cmd() + " " +
                        config + kRestartArgs,
                    (fs::path(FSDP_TEST_WORK_DIR) / (name + ".log")).string());
  EXPECT_TRUE(wait_for(run_dir / "checkpoints" / "step-00000005" / "index.json", 120))
      << job.output();
  const pid_t pid = find_process_with_env(
      {tag, "RANK=" + std::to_string(victim), "TORCHELASTIC_RESTART_COUNT=0"});
  EXPECT_GT(pid, 0) << "rank " << victim << " not found";
  // Still mid-run: far from the last step.
  EXPECT_FALSE(fs::exists(run_dir / "checkpoints" / "step-00000020"));
  if (pid > 0)
    ::kill(pid, SIGKILL);
  const int code = job.wait(240);
  *output = job.output();
  return code;
}

// fsdp-train finetune on SmolLM2-135M-Instruct (GGUF, found beside torch) with the shipped KJV
// instruction set, 2 ranks, fp32 compute: LoRA lowers the held-out loss, holds optimizer state
// for the adapters only, and writes the PEFT adapter, the merged model and the answers; QLoRA
// gathers 4-bit block weights instead of fp32 ones and resumes exactly; a bad JSONL line and a
// truncated model file are one-line errors naming the file, exit code 2. Each test's time is
// independent of the CPU's bf16 speed. Where the claim is about the pipeline rather than the
// whole model's answers, the runs fine-tune SmolLM2's first 2 blocks (smollm2_cut()), which
// are a quarter of the parameters.

// SmolLM2's GGUF cut to its first 2 blocks by scripts/cut_gguf.py (the same tensors, bytes,
// tokenizer and chat template; block_count 2), made and cached on first use by
// tests/python/smollm2_reference.py (which imports no torch for this).
std::string smollm2_cut() {
  const auto r = run(std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR +
                     "/tests/python/smollm2_reference.py gguf smollm2:2");
  EXPECT_EQ(r.code, 0) << r.output;
  const auto at = r.output.find("FILE ");
  return at == std::string::npos ? "" : r.output.substr(at + 5, r.output.find('\n', at) - at - 5);
}

// The first n of the 40 held-out conversations: the held-out loss is computed before the first
// step and after the last, and on all 40 that took a third of each run.
std::string small_eval_file(int n) {
  const auto path = fs::path(FSDP_TEST_WORK_DIR) / ("kjv_eval_" + std::to_string(n) + ".jsonl");
  std::ifstream in(fs::path(FSDP_SOURCE_DIR) / "data" / "instruct" / "kjv_eval.jsonl");
  std::ostringstream out;
  std::string line;
  for (int i = 0; i < n && std::getline(in, line); ++i)
    out << line << "\n";
  fs::create_directories(path.parent_path());
  std::ofstream(path) << out.str();
  return path.string();
}

// `eval_size` held-out conversations; `samples` of them answered before and after.
std::vector<fsdp_trainer::StepMetrics> finetune_run(const std::string& name,
                                                    const std::string& extra, std::string* out,
                                                    int eval_size = 8, int samples = 1) {
  const auto run_dir = (fs::path(FSDP_TEST_WORK_DIR) / ("run-" + name)).string();
  fs::remove_all(run_dir);
  const auto data = fs::path(FSDP_SOURCE_DIR) / "data" / "instruct";
  const std::string cmd =
      train_cmd() + " finetune --nproc 2 " + FSDP_SOURCE_DIR + "/configs/smollm2-lora.toml" +
      " --training.steps=4 --training.batch_size=1 --training.eval_every=0 --logging.plot=false" +
      // fp32 whatever the CPU: the config's auto would make the test's time and figures depend
      // on the machine's bf16 speed.
      " --precision.param_dtype=fp32" + " --logging.progress=lines --finetune.answer_tokens=8" +
      " --finetune.samples=" + std::to_string(samples) +
      " --finetune.train_file=" + (data / "kjv_train.jsonl").string() +
      " --finetune.eval_file=" + small_eval_file(eval_size) + " --logging.run_dir=" + run_dir +
      " " + extra;
  const CommandResult r = run(cmd);
  EXPECT_EQ(r.code, 0) << cmd << "\n" << r.output;
  *out = r.output;
  if (r.code != 0)
    return {};
  return fsdp_trainer::read_metrics((fs::path(run_dir) / "metrics.jsonl").string());
}

// LoRA on SmolLM2 (2 blocks: 9 query and 3 kv heads, 1,536 hidden features) split over 3
// tensor-parallel ranks, its weights read whole and moved into the split model through a
// sharded checkpoint: every step's loss within 1e-5 of one plain rank's (fp32), and the PEFT
// adapter it writes (through the whole model) within 1e-5 of the plain run's, tensor by tensor.
TEST(TrainerRun, FinetunesSmolLM2WithLoraSplitOverThreeTensorParallelRanks) {
  const auto cut = smollm2_cut();
  ASSERT_FALSE(cut.empty());
  const auto data = fs::path(FSDP_SOURCE_DIR) / "data" / "instruct";
  auto finetune = [&](const std::string& name, const std::string& launch) {
    const auto run_dir = fs::path(FSDP_TEST_WORK_DIR) / ("run-" + name);
    fs::remove_all(run_dir);
    const std::string cmd =
        train_cmd() + " finetune " + launch + " " + FSDP_SOURCE_DIR +
        "/configs/smollm2-lora.toml --finetune.model=" + cut +
        " --training.steps=3 --training.batch_size=2 --training.eval_every=0"
        " --logging.plot=false --precision.param_dtype=fp32 --finetune.samples=0"
        " --finetune.train_file=" +
        (data / "kjv_train.jsonl").string() + " --finetune.eval_file=" + small_eval_file(2) +
        " --logging.run_dir=" + run_dir.string();
    const CommandResult r = run(cmd);
    EXPECT_EQ(r.code, 0) << cmd << "\n" << r.output;
    return run_dir;
  };
  const auto plain = finetune("ft-tp-plain", "--nproc 1");
  const auto split = finetune("ft-tp-split", "--nproc 3 --parallel.tp=3");
  const auto want = fsdp_trainer::read_metrics((plain / "metrics.jsonl").string());
  const auto got = fsdp_trainer::read_metrics((split / "metrics.jsonl").string());
  ASSERT_EQ(want.size(), 3u);
  ASSERT_EQ(got.size(), 3u);
  double worst = 0;
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_NEAR(got[i].loss, want[i].loss, 1e-5) << "step " << i + 1;
    worst = std::max(worst, std::abs(got[i].loss - want[i].loss));
  }
  const fsdp::safetensors::Reader a((plain / "adapter" / "adapter_model.safetensors").string());
  const fsdp::safetensors::Reader b((split / "adapter" / "adapter_model.safetensors").string());
  ASSERT_EQ(a.header().tensors.size(), b.header().tensors.size());
  double worst_adapter = 0;
  for (const auto& entry : a.header().tensors) {
    const auto& name = entry.name;
    const auto x = a.read(name), y = b.read(name);
    ASSERT_EQ(x.sizes(), y.sizes()) << name;
    const double d = (x - y).abs().max().item<double>();
    worst_adapter = std::max(worst_adapter, d);
    EXPECT_LE(d, 1e-5) << name;
  }
  EXPECT_FALSE(fs::exists(split / "adapter.tp-staging"));
  std::printf(
      "TP FINETUNE OK: 3 steps at tp 3, largest loss difference %.3g, adapter %.3g over "
      "%zu tensors\n",
      worst, worst_adapter, a.header().tensors.size());
}

TEST(TrainerRun, FinetunesSmolLM2WithLora) {
  const auto cut = smollm2_cut();
  ASSERT_FALSE(cut.empty());
  // Text for the export's tokenizer (below), written beside the run directory (which the run
  // starts by removing).
  const auto corpus = fs::path(FSDP_TEST_WORK_DIR) / "ft-lora-corpus.txt";
  {
    std::string lines;
    for (const char* name : {"kjv", "fortunes"}) {
      const auto all = fsdp_trainer::load_corpus(name);
      lines += all.substr(0, all.find('\n', 20000)) + "\n";
    }
    std::ifstream jsonl(fs::path(FSDP_SOURCE_DIR) / "data/instruct/kjv_train.jsonl");
    std::string line;
    for (int i = 0; i < 50 && std::getline(jsonl, line); ++i)
      lines += line + "\n";
    std::ofstream(corpus, std::ios::binary) << lines << "<|im_start|>user\nHi<|im_end|>";
  }
  // transformers' side imports torch and transformers while fsdp-train runs, then waits for the
  // merged export.
  const fs::path dir = fs::path(FSDP_TEST_WORK_DIR) / "run-ft-lora";
  const auto reference_json = fs::path(FSDP_TEST_WORK_DIR) / "ft-lora-transformers.json";
  fs::remove(reference_json);
  fsdp::test::StartedCommand transformers(std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR +
                                          "/tests/python/check_export.py --wait " +
                                          (dir / "merged").string() + " " + small_eval_file(4) +
                                          " 8 " + corpus.string() + " " + reference_json.string());
  // 4 held-out conversations: on the 2-block model, evaluating 8 before and after took a
  // quarter of the run.
  std::string lora_out;
  const auto lora = finetune_run(
      "ft-lora",
      "--finetune.model=" + cut + " --finetune.export_merged=true --logging.tensorboard=true",
      &lora_out, 4);
  ASSERT_EQ(lora.size(), 4u) << lora_out;
  // finetune writes TensorBoard's file as train does: each step's loss, read by TensorBoard.
  {
    const auto tb = run(std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR +
                        "/tests/python/check_tensorboard.py " +
                        (fs::path(FSDP_TEST_WORK_DIR) / "run-ft-lora" / "tensorboard").string());
    ASSERT_EQ(tb.code, 0) << tb.output;
    const auto loss = nlohmann::json::parse(tb.output)["scalars"]["train/loss"];
    ASSERT_EQ(loss.size(), lora.size()) << tb.output;
    for (size_t i = 0; i < lora.size(); ++i) {
      EXPECT_EQ(loss[i][0], lora[i].step);
      EXPECT_EQ(loss[i][1].get<double>(), static_cast<double>(static_cast<float>(lora[i].loss)));
    }
  }
  // The held-out loss over the answers falls.
  const auto at = lora_out.find("held-out loss: ");
  ASSERT_NE(at, std::string::npos) << lora_out;
  double before = 0, after = 0;
  ASSERT_EQ(std::sscanf(lora_out.c_str() + at, "held-out loss: %lf -> %lf", &before, &after), 2);
  EXPECT_LT(after, before);
  std::printf("LoRA held-out loss %.4f -> %.4f in 4 steps\n", before, after);
  // Optimizer state for the adapters only: 2 blocks of 81,408 trainable parameters, 81,408 per
  // rank, 8 bytes each (651 KB), against 141 MB for the whole model's.
  ASSERT_TRUE(lora.back().mem_optimizer_bytes.has_value());
  EXPECT_LT(*lora.back().mem_optimizer_bytes, 1 << 20);
  for (const char* f : {"adapter/adapter_config.json", "adapter/adapter_model.safetensors",
                        "merged/config.json", "merged/model.safetensors", "answers.txt"})
    EXPECT_TRUE(fs::is_regular_file(dir / f)) << f;
  std::ifstream answers(dir / "answers.txt");
  const std::string text((std::istreambuf_iterator<char>(answers)), {});
  EXPECT_NE(text.find("   before:"), std::string::npos) << text;
  EXPECT_NE(text.find("   after:"), std::string::npos) << text;

  // The merged export carries the tokenizer: transformers' pipeline() loads the directory as it
  // is and answers the held-out question as fsdp-train did (greedy, fp32), and its AutoTokenizer
  // gives our ids on the shipped corpora.
  for (const char* f : {"merged/tokenizer.json", "merged/tokenizer_config.json",
                        "merged/generation_config.json", "adapter/tokenizer.json"})
    EXPECT_TRUE(fs::is_regular_file(dir / f)) << f;
  const auto py = transformers.finish("written");
  ASSERT_EQ(py.code, 0) << py.output;
  const auto ref = nlohmann::json::parse(fsdp::test::file_bytes(reference_json));
  const auto answer = ref["answer"].get<std::string>();
  EXPECT_NE(text.find("   after:     " + answer + "\n"), std::string::npos)
      << "transformers answered '" << answer << "'; answers.txt:\n"
      << text;
  const auto tok = fsdp_trainer::pretrained_tokenizer(cut);
  const auto theirs = ref["ids"];
  const auto corpus_text = fsdp::test::file_bytes(corpus);
  size_t pos = 0, lines = 0, same = 0;
  for (const auto& ids : theirs) {
    const size_t end = corpus_text.find('\n', pos);
    const auto line =
        corpus_text.substr(pos, end == std::string::npos ? std::string::npos : end - pos);
    same += tok.encode(line) == ids.get<std::vector<int64_t>>();
    ++lines;
    pos = end == std::string::npos ? corpus_text.size() : end + 1;
  }
  EXPECT_EQ(same, lines);
  std::printf(
      "transformers on the merged export: answer '%s'; %zu of %zu lines tokenized as ours\n",
      answer.c_str(), same, lines);
}

// On SmolLM2's first 2 blocks: what NF4 changes in a step's gathers, and what a resume restores,
// is the same in every block. The embedding (tied to the head) is gathered in fp32 by both
// methods, so on 2 blocks it is most of either's bytes, and the claim is on the difference.
TEST(TrainerRun, QloraGathersBlockWeightsIn4BitsAndResumesExactly) {
  const auto cut = smollm2_cut();
  ASSERT_FALSE(cut.empty());
  // No answers, no adapter written and 2 held-out conversations: this test is about the gathers
  // and the resume.
  std::string lora_out, qlora_out;
  const std::string lean = " --finetune.save_adapter=false --finetune.model=" + cut;
  const auto lora = finetune_run("ft-lora-1", "--training.steps=1" + lean, &lora_out, 2, 0);
  ASSERT_EQ(lora.size(), 1u) << lora_out;
  const auto ckpt = (fs::path(FSDP_TEST_WORK_DIR) / "ft-qlora-checkpoints").string();
  fs::remove_all(ckpt);
  const auto qlora = finetune_run(
      "ft-qlora",
      "--finetune.method=qlora --training.steps=2 --checkpoint.every=1 --checkpoint.dir=" + ckpt +
          lean,
      &qlora_out, 2, 0);
  ASSERT_EQ(qlora.size(), 2u) << qlora_out;
  // The blocks' Linear weights in fp32 (3,538,944 per block: q, k, v, o are 576 x (576 + 192 +
  // 192 + 576), w1, w2, w3 are 3 x 576 x 1536). Each block is gathered twice a step (forward,
  // and again for backward: blocks reshard after forward), so NF4 (4.127 bits) must save 87% of
  // twice their bytes; 80% is the bound (int8 would save 75%, bf16 50%, fp32 nothing).
  const auto cfg = fsdp_trainer::pretrained_config(cut);
  ASSERT_EQ(cfg.n_layers, 2);
  const int64_t kv_dim = cfg.dim / cfg.n_heads * cfg.n_kv_heads;
  const double blocks_fp32 =
      4.0 * static_cast<double>(cfg.n_layers) *
      static_cast<double>(cfg.dim * (2 * cfg.dim + 2 * kv_dim) + 3 * cfg.dim * cfg.ffn_hidden_dim);
  const double saved =
      static_cast<double>(lora.back().allgather_bytes - qlora.back().allgather_bytes);
  EXPECT_GT(saved, 0.8 * 2 * blocks_fp32)
      << qlora.back().allgather_bytes << " vs " << lora.back().allgather_bytes;
  std::printf(
      "all-gather bytes per step: LoRA %.1f MiB, QLoRA %.1f MiB; saved %.1f%% of the "
      "blocks' fp32 weights gathered twice\n",
      lora.back().allgather_bytes / 1048576.0, qlora.back().allgather_bytes / 1048576.0,
      100 * saved / (2 * blocks_fp32));
  // Resumed from step 1 (frozen NF4 base, adapters, their optimizer state, the data order), step
  // 2 is the same.
  std::string resumed_out;
  const auto resumed =
      finetune_run("ft-qlora-resumed",
                   "--finetune.method=qlora --training.steps=2 --checkpoint.dir=" + ckpt +
                       " --checkpoint.resume=" + ckpt + "/step-00000001" + lean,
                   &resumed_out, 2, 0);
  ASSERT_EQ(resumed.size(), 1u) << resumed_out;
  EXPECT_EQ(resumed[0].loss, qlora[1].loss);
}

// The same SmolLM2 as a Hugging Face directory (transformers' save_pretrained in three files,
// tests/python/check_hf_dir.py): LoRA and QLoRA fine-tuning from it give the GGUF path's
// losses bit for bit (the same float32 weights, tokenizer and template). Both are SmolLM2's
// first 2 blocks: bit-for-bit equality is a claim about the loading, the same in every block.
TEST(TrainerRun, FinetunesSmolLM2FromAHuggingFaceDirectoryAsFromItsGguf) {
  const auto py = run(std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR +
                      "/tests/python/check_hf_dir.py sharded smollm2:2");
  ASSERT_EQ(py.code, 0) << py.output;
  auto line = [&](const std::string& tag) {
    const auto at = py.output.find(tag + " ");
    return at == std::string::npos
               ? std::string()
               : py.output.substr(at + tag.size() + 1,
                                  py.output.find('\n', at) - at - tag.size() - 1);
  };
  const auto cut = line("FILE"), dir = line("DIR");
  ASSERT_FALSE(cut.empty() || dir.empty()) << py.output;
  const std::string lean = " --finetune.save_adapter=false";
  for (const std::string method : {"lora", "qlora"}) {
    SCOPED_TRACE(method);
    const std::string steps = method == "lora" ? " --training.steps=2" : " --training.steps=1";
    std::string gguf_out, dir_out;
    const auto gguf = finetune_run(
        "ft-gguf-" + method,
        "--finetune.method=" + method + steps + lean + " --finetune.model=" + cut, &gguf_out, 2, 0);
    // LoRA from the directory writes its adapter: with the directory's own tokenizer files.
    const std::string adapter = method == "lora" ? "" : lean;
    const auto hf =
        finetune_run("ft-hf-" + method,
                     "--finetune.method=" + method + steps + adapter + " --finetune.model=" + dir,
                     &dir_out, 2, 0);
    ASSERT_EQ(hf.size(), gguf.size()) << dir_out;
    ASSERT_FALSE(hf.empty());
    for (size_t i = 0; i < hf.size(); ++i)
      EXPECT_EQ(hf[i].loss, gguf[i].loss) << "step " << i + 1;
    EXPECT_NE(dir_out.find("fine-tuning " + dir), std::string::npos) << dir_out;
    if (method == "lora") {
      const auto written = fs::path(FSDP_TEST_WORK_DIR) / "run-ft-hf-lora" / "adapter";
      for (const char* f : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"})
        EXPECT_TRUE(file_bytes(written / f) == file_bytes(fs::path(dir) / f)) << f;
    }
    std::printf("%s from the directory: losses", method.c_str());
    for (const auto& m : hf)
      std::printf(" %.6f", m.loss);
    std::printf(" (GGUF: equal)\n");
  }
}

// The instruction set without its system messages (Mistral's template has no system role).
std::string without_system(const std::string& from, const std::string& name) {
  const auto path = fs::path(FSDP_TEST_WORK_DIR) / name;
  std::ifstream in(from);
  std::ofstream out(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty())
      continue;
    auto j = nlohmann::json::parse(line);
    auto& messages = j["messages"];
    messages.erase(std::remove_if(messages.begin(), messages.end(),
                                  [](const auto& m) { return m["role"] == "system"; }),
                   messages.end());
    out << j.dump() << "\n";
  }
  return path.string();
}

// A Hugging Face directory with a SentencePiece-style tokenizer (Llama 2 / Mistral family): our
// own pretraining export, which transformers' pipeline() continues greedily as fsdp-train
// generate does; then, given Mistral's chat template, fine-tuned with LoRA. The merged
// export carries the directory's tokenizer files byte for byte, and transformers' pipeline()
// answers the held-out question as fsdp-train did (greedy, fp32).
TEST(TrainerRun, FinetunesASentencePieceModelDirectoryWithMistralsTemplate) {
  const auto work = fs::path(FSDP_TEST_WORK_DIR);
  const auto pre = work / "sp-pretrain", model = work / "sp-mistral-model";
  fs::remove_all(pre);
  fs::remove_all(model);
  const auto data = fs::path(FSDP_SOURCE_DIR) / "data" / "instruct";
  const auto train = without_system((data / "kjv_train.jsonl").string(), "mistral_train.jsonl");
  const auto eval = without_system(small_eval_file(8), "mistral_eval.jsonl");
  // transformers' side of the fine-tuned export imports while fsdp-train runs, then waits for it.
  const auto dir = work / "run-ft-sp-mistral";
  fs::remove(work / "sp-mistral-transformers.json");
  fsdp::test::StartedCommand transformers_export(
      std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR + "/tests/python/check_export.py --wait " +
      (dir / "merged").string() + " " + eval + " 8 " + eval + " " +
      (work / "sp-mistral-transformers.json").string());
  const auto config = write_config("sp-pretrain", tiny_config(pre.string(), "llama", "llama-tiny"));
  auto trained = run(train_cmd() + " --nproc 2 " + config +
                     " --training.steps=2 --training.seq_len=128 --training.eval_every=0 "
                     "--checkpoint.export_hf=true --logging.plot=false --generate.tokens=0");
  ASSERT_EQ(trained.code, 0) << trained.output;
  // The pretraining export as it is: transformers' pipeline() continues a prompt greedily as
  // `fsdp-train generate --generate.top_k=1` does (a text cut inside a character shown with
  // U+FFFD in both). transformers runs while fsdp-train generates and fine-tunes.
  const std::string prompt = "In the beginning";
  const auto greedy = work / "sp-pretrain-greedy.json";
  fs::remove(greedy);
  fsdp::test::StartedCommand transformers_generate(
      std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR + "/tests/python/check_generate.py " +
      (pre / "hf").string() + " '" + prompt + "' 12 " + greedy.string());
  auto generated =
      run(train_cmd() + " generate --nproc 2 " + config + " --checkpoint " + (pre / "hf").string() +
          " --generate.top_k=1 --generate.tokens=12 '--generate.prompt=" + prompt + "'");
  ASSERT_EQ(generated.code, 0) << generated.output;
  fs::copy(pre / "hf", model);
  auto tokenizer_config = nlohmann::json::parse(file_bytes(model / "tokenizer_config.json"));
  tokenizer_config["chat_template"] = fsdp::test::mistral_template(" + ' ' ");
  std::ofstream(model / "tokenizer_config.json") << tokenizer_config.dump(2);

  std::string out;
  const auto steps = finetune_run("ft-sp-mistral",
                                  "--training.steps=3 --finetune.export_merged=true "
                                  "--finetune.model=" +
                                      model.string() + " --finetune.train_file=" + train +
                                      " --finetune.eval_file=" + eval,
                                  &out);
  ASSERT_EQ(steps.size(), 3u) << out;
  for (const auto& m : steps)
    EXPECT_TRUE(std::isfinite(m.loss)) << out;
  EXPECT_NE(out.find("fine-tuning " + model.string()), std::string::npos) << out;
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"})
    EXPECT_TRUE(file_bytes(dir / "merged" / f) == file_bytes(model / f)) << f;

  const auto py_generate = transformers_generate.finish();
  ASSERT_EQ(py_generate.code, 0) << py_generate.output;
  const auto theirs = nlohmann::json::parse(file_bytes(greedy))["text"].get<std::string>();
  EXPECT_NE(generated.output.find("top-k 1):\n" + theirs + "\n"), std::string::npos)
      << "transformers: '" << theirs << "'\n"
      << generated.output;
  const auto answers = file_bytes(dir / "answers.txt");
  const auto py = transformers_export.finish("written");
  ASSERT_EQ(py.code, 0) << py.output;
  const auto answer =
      nlohmann::json::parse(file_bytes(work / "sp-mistral-transformers.json"))["answer"]
          .get<std::string>();
  EXPECT_NE(answers.find("   after:     " + answer + "\n"), std::string::npos)
      << "transformers answered '" << answer << "'; answers.txt:\n"
      << answers;
  std::printf(
      "pretraining export: transformers' greedy text '%s' equals fsdp-train generate's\n"
      "with Mistral's template: losses %.5f %.5f %.5f; transformers' greedy answer '%s' equals "
      "ours\n",
      theirs.c_str(), steps[0].loss, steps[1].loss, steps[2].loss, answer.c_str());
}

TEST(TrainerRun, FinetuneBadInputIsOneLineAndExitCode2) {
  // A broken JSONL line, and a model file cut short.
  const auto bad = fs::path(FSDP_TEST_WORK_DIR) / "bad-instruct.jsonl";
  fs::create_directories(bad.parent_path());
  std::ofstream(bad)
      << R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})"
      << "\n{\"messages\": [\n";
  CommandResult r = run(train_cmd() + " finetune " + FSDP_SOURCE_DIR +
                        "/configs/smollm2-lora.toml --finetune.train_file=" + bad.string() +
                        " --finetune.eval_file=" +
                        (fs::path(FSDP_SOURCE_DIR) / "data/instruct/kjv_eval.jsonl").string());
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find(bad.string() + ":2: "), std::string::npos) << r.output;
  EXPECT_EQ(line_count(r.output.substr(r.output.find("config error"))), 1) << r.output;
  const auto cut = fs::path(FSDP_TEST_WORK_DIR) / "cut.gguf";
  {
    const auto real = fsdp_trainer::resolve_model_file("smollm2");
    std::ifstream in(real, std::ios::binary);
    std::string head(1 << 20, '\0');
    in.read(head.data(), static_cast<std::streamsize>(head.size()));
    std::ofstream(cut, std::ios::binary) << head;
  }
  r = run(train_cmd() + " finetune " + FSDP_SOURCE_DIR +
          "/configs/smollm2-lora.toml --finetune.model=" + cut.string() +
          " --finetune.train_file=" +
          (fs::path(FSDP_SOURCE_DIR) / "data/instruct/kjv_train.jsonl").string() +
          " --finetune.eval_file=" +
          (fs::path(FSDP_SOURCE_DIR) / "data/instruct/kjv_eval.jsonl").string());
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find(cut.string()), std::string::npos) << r.output;
}

}  // namespace

// Restart after a failure, as torchrun does it: a rank SIGKILLed mid-run makes the agent stop
// the job and start it again (--max-restarts=1), which resumes from its latest complete
// checkpoint (checkpoint.resume = auto) and ends with the same parameters and optimizer state,
// byte for byte, and the same losses as a job never interrupted.
TEST(TrainerRun, TorchrunRestartsAKilledJobFromItsLastCheckpoint) {
  const auto work = fs::path(FSDP_TEST_WORK_DIR);
  const auto killed = work / "restart-killed", whole = work / "restart-whole";
  for (const auto& d : {killed, whole})
    fs::remove_all(d);
  std::string output;
  ASSERT_EQ(torchrun_with_a_killed_rank("restart-killed", killed, 2, 1, 1, &output), 0) << output;
  EXPECT_NE(output.find("resumed from " + (killed / "checkpoints").string()), std::string::npos)
      << output;
  const auto config =
      write_config("restart-whole", tiny_config(whole.string(), "gpt", "gpt2-tiny") +
                                        "[checkpoint]\nevery = 5\nkeep = 3\n");
  auto r = run(train_cmd() + " --nproc 2 " + config + kRestartArgs);
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* f : {"rank-00000.safetensors", "rank-00001.safetensors"}) {
    const auto x = file_bytes(whole / "checkpoints" / "step-00000025" / f);
    EXPECT_FALSE(x.empty());
    EXPECT_TRUE(x == file_bytes(killed / "checkpoints" / "step-00000025" / f)) << f;
  }
  auto mk = fsdp_trainer::read_metrics((killed / "metrics.jsonl").string());
  auto mw = fsdp_trainer::read_metrics((whole / "metrics.jsonl").string());
  ASSERT_EQ(mk.size(), size_t{kRestartSteps});
  ASSERT_EQ(mw.size(), size_t{kRestartSteps});
  for (size_t i = 0; i < mw.size(); ++i)
    EXPECT_EQ(mk[i].loss, mw[i].loss) << "step " << i + 1;
}

// A 4-rank job that loses a rank and is started again on 3 (fewer machines left): it resumes
// through resharding from the checkpoint 4 ranks wrote and finishes.
TEST(TrainerRun, AJobKilledOnFourRanksResumesOnThree) {
  const auto dir = fs::path(FSDP_TEST_WORK_DIR) / "restart-4to3";
  fs::remove_all(dir);
  std::string output;
  EXPECT_NE(torchrun_with_a_killed_rank("restart-4to3", dir, 4, 0, 2, &output), 0) << output;
  const auto config = (fs::path(FSDP_TEST_WORK_DIR) / "restart-4to3.toml").string();
  auto r = run("OMP_NUM_THREADS=1 " + std::string(FSDP_TORCHRUN) +
               " --standalone --no-python --nproc-per-node 3 " + train_cmd() + " " + config +
               kRestartArgs);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("saved on 4 rank(s)"), std::string::npos) << r.output;
  auto m = fsdp_trainer::read_metrics((dir / "metrics.jsonl").string());
  ASSERT_EQ(m.size(), size_t{kRestartSteps});
  EXPECT_EQ(m.back().step, kRestartSteps);
  EXPECT_TRUE(std::isfinite(m.back().loss));
  EXPECT_TRUE(fs::exists(dir / "checkpoints" / "step-00000025" / "index.json"));
}

namespace {

// A fault-tolerant fsdp-train job of 1-rank replicas (hybrid_shard, timeout_s = 3, and
// `fsdp_extra` in [fsdp]) running in the background; its launcher names each rank's process, so
// that a test can stop or kill one.
struct FtJob {
  std::string name, config, args, command;
  int nproc = 0;
  fs::path run_dir;
  std::unique_ptr<BackgroundJob> job;

  // `base(run_dir)`: the config's sections but [fsdp] (tiny_config's by default), run as
  // `fsdp-train <command>`.
  FtJob(std::string job_name, const std::string& fsdp_extra, int ranks, std::string train_args,
        const std::function<std::string(const std::string&)>& base = nullptr,
        std::string subcommand = "")
      : name(std::move(job_name)),
        args(std::move(train_args)),
        command(std::move(subcommand)),
        nproc(ranks) {
    run_dir = fs::path(FSDP_TEST_WORK_DIR) / name;
    fs::remove_all(run_dir);
    config = write_config(name, (base ? base(run_dir.string()) : tiny_config(run_dir.string())) +
                                    "[fsdp]\nstrategy = \"hybrid_shard\"\nhybrid_shard_size = 1\n"
                                    "fault_tolerant = true\ntimeout_s = 3\n" +
                                    fsdp_extra);
    job = std::make_unique<BackgroundJob>(
        launch(), (fs::path(FSDP_TEST_WORK_DIR) / (name + ".log")).string());
  }
  std::string launch() const { return launch(args); }
  std::string launch(const std::string& with_args) const {
    return train_cmd() + " " + command + " " + config + " --nproc " + std::to_string(nproc) +
           with_args;
  }
  fs::path metrics() const { return run_dir / "metrics.jsonl"; }
  // Until `steps` steps are logged (at most 120 s): a fault then falls mid-run.
  void wait_for_steps(int steps) const {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (line_count(file_bytes(metrics())) < steps && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // The process of rank `rank` now: the last the launcher named for it (its ranks are forks of
  // the launcher, whose environment in /proc holds no RANK), or 0.
  pid_t rank_pid(int rank) const { return pid_named_by_launcher(job->output(), rank); }
  // Once `steps` steps are logged, SIGKILLs rank `rank`; false if its process was not found.
  bool kill_rank_after(int steps, int rank) const {
    wait_for_steps(steps);
    const pid_t victim = rank_pid(rank);
    return victim > 0 && ::kill(victim, SIGKILL) == 0;
  }
  // membership.jsonl: one object per change.
  std::vector<nlohmann::json> membership() const { return read_membership(run_dir); }
  static std::vector<nlohmann::json> read_membership(const fs::path& dir) {
    std::vector<nlohmann::json> changes;
    std::istringstream lines(file_bytes(dir / "membership.jsonl"));
    for (std::string line; std::getline(lines, line);)
      changes.push_back(nlohmann::json::parse(line));
    return changes;
  }
  // The same job without a fault, told `schedule` ("step:r,...;step:..."): every one of its
  // `steps` losses and held-out losses equals this run's, bit for bit; returns the held-out
  // losses' count and the reference's run directory.
  // `reference_args`: the reference's own (this job's args otherwise).
  std::pair<int, fs::path> expect_schedule_run_equal(
      const std::string& schedule, size_t steps,
      const std::optional<std::string>& reference_args = std::nullopt) const {
    const auto reference_dir = fs::path(FSDP_TEST_WORK_DIR) / (name + "-reference");
    fs::remove_all(reference_dir);
    std::string escaped;  // ';' reaches fsdp-train through the shell
    for (const char c : schedule) {
      if (c == ';')
        escaped.push_back('\\');
      escaped.push_back(c);
    }
    const auto reference =
        run(launch(reference_args.value_or(args)) + " --logging.run_dir=" + reference_dir.string() +
            " --fsdp.membership_schedule=" + escaped);
    EXPECT_EQ(reference.code, 0) << reference.output;
    const auto a = fsdp_trainer::read_metrics(metrics().string());
    const auto b = fsdp_trainer::read_metrics((reference_dir / "metrics.jsonl").string());
    EXPECT_EQ(a.size(), steps);
    EXPECT_EQ(b.size(), steps);
    int evals = 0;
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
      EXPECT_EQ(a[i].step, b[i].step);
      EXPECT_EQ(a[i].loss, b[i].loss) << "step " << a[i].step;
      EXPECT_EQ(a[i].eval_loss, b[i].eval_loss) << "step " << a[i].step;
      evals += a[i].eval_loss.has_value();
    }
    return {evals, reference_dir};
  }
};

}  // namespace

// fsdp.fault_tolerant with every replica killed at once (2 replicas of 1 rank): no process holds
// the training state, so the restarted ranks end the job at once with the reason (exit 69)
// instead of each waiting a vote timeout and a minute for an admission, over and over.
TEST(FaultTolerantTraining, EveryReplicaKilledEndsTheJobAtOnceWithTheReason) {
  FtJob ft("ft-lost", "", 2,
           " --training.steps=300 --training.seq_len=64 --training.eval_every=0 "
           "--generate.tokens=0 --logging.plot=false");
  ft.wait_for_steps(10);
  const pid_t rank0 = ft.rank_pid(0), rank1 = ft.rank_pid(1);
  ASSERT_GT(rank0, 0) << ft.job->output();
  ASSERT_GT(rank1, 0) << ft.job->output();
  const auto killed = std::chrono::steady_clock::now();
  ::kill(rank0, SIGKILL);
  ::kill(rank1, SIGKILL);
  const int code = ft.job->wait(120);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  const std::string output = ft.job->output();
  EXPECT_EQ(code, 69) << output;
  EXPECT_NE(output.find("restarts of replicas 0..1: 1, 1"), std::string::npos) << output;
  EXPECT_NE(output.find("no live replica holds the training state"), std::string::npos) << output;
  EXPECT_NE(output.find("without a checkpoint the job cannot go on"), std::string::npos) << output;
  std::printf("the job ended %.1f s after both replicas were killed\n", seconds);
  EXPECT_LT(seconds, 60.0) << output;
}

// fsdp.spare_replicas: 3 replicas of 1 rank, replica 2 a spare. Rank 1 is SIGKILLed mid-run
// (no restarts): replica 0 finishes the step alone, the next step admits the spare with replica
// 0's state, and the job trains on with 2 replicas, as many as before. A run told the same
// schedule (the spare added by it) logs the same loss at every step and the same held-out
// losses, bit for bit.
TEST(FaultTolerantTraining, ASpareTakesAKilledReplicasPlaceAndTheLossesEqualTheScheduleRun) {
  FtJob ft("ft-spare", "spare_replicas = 1\nmax_restarts = 0\n", 3,
           " --training.steps=60 --training.seq_len=64 --training.eval_every=30 "
           "--generate.tokens=0 --logging.plot=false");
  ASSERT_TRUE(ft.kill_rank_after(20, 1)) << ft.job->output();
  ASSERT_EQ(ft.job->wait(180), 0) << ft.job->output();
  const auto changes = ft.membership();
  ASSERT_EQ(changes.size(), 3u) << file_bytes(ft.run_dir / "membership.jsonl");
  EXPECT_EQ(changes[0]["live"], nlohmann::json::array({0, 1}));
  EXPECT_EQ(changes[1]["cause"], "fault");
  EXPECT_EQ(changes[1]["live"], nlohmann::json::array({0}));
  EXPECT_EQ(changes[2]["cause"], "admitted");
  EXPECT_EQ(changes[2]["live"], nlohmann::json::array({0, 2}));
  const int64_t dropped = changes[1]["step"], back = changes[2]["step"];
  EXPECT_GT(dropped, 20);
  EXPECT_EQ(back, dropped + 1);  // the spare was waiting: the next step admits it
  const auto [evals, reference_dir] = ft.expect_schedule_run_equal(
      std::to_string(dropped) + ":0;" + std::to_string(back) + ":0,2", 60);
  EXPECT_EQ(evals, 2);
  std::printf("replica 1 dropped at step %lld, the spare (replica 2) in from step %lld\n",
              static_cast<long long>(dropped), static_cast<long long>(back));
}

// fsdp.fault_tolerant (docs/multi-node.md): 3 replicas of 1 rank under fsdp-train --nproc 3.
// Rank 1 is SIGKILLed mid-run; the other two finish the step it was in among themselves and
// train on, the launcher starts rank 1 again, and it joins at a step boundary with the state of
// a replica that stayed; nothing restarts but rank 1, and no checkpoint exists. The run's
// membership.jsonl gives the schedule; a run told that schedule, without a fault, logs the same
// loss at every step and the same held-out losses, bit for bit. With dynamic loss scaling
// (fp32, where a power of two scales exactly; growing every 5 clean steps): the joining replica
// takes the others' loss scale too.
TEST(FaultTolerantTraining, AKilledReplicaRejoinsAndTheLossesEqualTheScheduleRun) {
  FtJob ft("ft-kill", "", 3,
           " --training.steps=60 --training.seq_len=64 --training.eval_every=20 "
           "--generate.tokens=0 --logging.plot=false --precision.loss_scaling=dynamic "
           "--precision.growth_interval=5");
  // Rank 1 dies within a step or two of step 20, far from the end (it is back within a few
  // steps: 1 on a 2-core EPYC).
  ASSERT_TRUE(ft.kill_rank_after(20, 1)) << ft.job->output();
  ASSERT_EQ(ft.job->wait(180), 0) << ft.job->output();
  const std::string output = ft.job->output();
  EXPECT_NE(output.find("restarts of replicas 0..2: 0, 1, 0"), std::string::npos) << output;

  // start, the fault, the admission: "S:0,2;J:0,1,2".
  const auto changes = ft.membership();
  ASSERT_EQ(changes.size(), 3u) << file_bytes(ft.run_dir / "membership.jsonl");
  EXPECT_EQ(changes[0]["cause"], "start");
  EXPECT_EQ(changes[1]["cause"], "fault");
  EXPECT_EQ(changes[1]["live"], nlohmann::json::array({0, 2}));
  EXPECT_EQ(changes[2]["cause"], "admitted");
  EXPECT_EQ(changes[2]["live"], nlohmann::json::array({0, 1, 2}));
  const int64_t dropped = changes[1]["step"], back = changes[2]["step"];
  EXPECT_GT(dropped, 20);
  EXPECT_GT(back, dropped);
  EXPECT_LT(back, 60);
  std::printf("replica 1 dropped at step %lld, back at step %lld\n",
              static_cast<long long>(dropped), static_cast<long long>(back));

  const auto [evals, reference_dir] = ft.expect_schedule_run_equal(
      std::to_string(dropped) + ":0,2;" + std::to_string(back) + ":0,1,2", 60);
  EXPECT_EQ(evals, 3);
  // The scale moved from its start before the replica came back: a joiner that kept its own
  // would have scaled its gradients differently from the others'.
  const auto steps = fsdp_trainer::read_metrics(ft.metrics().string());
  ASSERT_GE(steps.size(), static_cast<size_t>(back));
  ASSERT_TRUE(steps[static_cast<size_t>(back - 1)].loss_scale.has_value());
  EXPECT_NE(*steps[static_cast<size_t>(back - 1)].loss_scale, 65536.0);
  // The reference went through the same changes, told by the schedule.
  const auto reference_changes = FtJob::read_membership(reference_dir);
  ASSERT_EQ(reference_changes.size(), changes.size());
  for (size_t n = 0; n < changes.size(); ++n) {
    EXPECT_EQ(reference_changes[n]["step"], changes[n]["step"]) << n;
    EXPECT_EQ(reference_changes[n]["live"], changes[n]["live"]) << n;
    EXPECT_EQ(reference_changes[n]["cause"], n == 0 ? "start" : "schedule") << n;
  }
}

// A replica that fsdp.membership_schedule drops and takes back later dies while it waits (no
// restarts): at the step that takes it back, the others cannot make the new groups with it.
// That step fails and they reform without it, as after an admission that fails, and train to the
// end; membership.jsonl says so (the scheduled change at step 30 never happened; a fault there).
TEST(FaultTolerantTraining, AReplicaTheScheduleTakesBackThatDiedWhileWaitingIsDroppedAgain) {
  FtJob ft("ft-sched-dead", "membership_schedule = \"10:0,2;30:0,1,2\"\nmax_restarts = 0\n", 3,
           " --training.steps=40 --training.seq_len=64 --training.eval_every=0 "
           "--generate.tokens=0 --logging.plot=false");
  // Replica 1 left at step 10 and waits for step 30.
  ASSERT_TRUE(ft.kill_rank_after(15, 1)) << ft.job->output();
  ASSERT_EQ(ft.job->wait(180), 0) << ft.job->output();
  const std::string output = ft.job->output();
  EXPECT_NE(output.find("the change of fsdp.membership_schedule at step 30 failed"),
            std::string::npos)
      << output;
  const auto changes = ft.membership();
  ASSERT_EQ(changes.size(), 3u) << file_bytes(ft.run_dir / "membership.jsonl");
  EXPECT_EQ(changes[0]["cause"], "start");
  EXPECT_EQ(changes[1]["cause"], "schedule");
  EXPECT_EQ(changes[1]["step"], 10);
  EXPECT_EQ(changes[1]["live"], nlohmann::json::array({0, 2}));
  EXPECT_EQ(changes[2]["cause"], "fault");
  EXPECT_EQ(changes[2]["step"], 30);
  EXPECT_EQ(changes[2]["live"], nlohmann::json::array({0, 2}));
  const auto metrics = fsdp_trainer::read_metrics(ft.metrics().string());
  ASSERT_EQ(metrics.size(), 40u);
  EXPECT_TRUE(std::isfinite(metrics.back().loss));
}

// fsdp.fault_tolerant with logging.tensorboard: replica 0 (rank 0, the writer) out from step 10
// to step 30 by the schedule, so rank 1 writes steps 10-29 and rank 0 again from 30. Each new
// writer starts an event file named after the ones it continues (TensorBoard reads them in name
// order; their SessionLog START hides what an earlier file logged from there on, as for a resumed
// run), even within the same second: TensorBoard's own reader shows every step once, with
// metrics.jsonl's loss.
TEST(FaultTolerantTraining, TensorBoardShowsEveryStepOnceAcrossWriters) {
  FtJob ft("ft-tensorboard", "membership_schedule = \"10:1,2;30:0,1,2\"\n", 3,
           " --training.steps=40 --training.seq_len=64 --training.eval_every=0 "
           "--generate.tokens=0 --logging.plot=false --logging.tensorboard=true");
  ASSERT_EQ(ft.job->wait(180), 0) << ft.job->output();
  const auto metrics = fsdp_trainer::read_metrics(ft.metrics().string());
  ASSERT_EQ(metrics.size(), 40u);
  const auto tb =
      run(std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR + "/tests/python/check_tensorboard.py " +
          (ft.run_dir / "tensorboard").string());
  ASSERT_EQ(tb.code, 0) << tb.output;
  const auto seen = nlohmann::json::parse(tb.output);
  EXPECT_EQ(seen["files"].size(), 3u) << tb.output;  // rank 0, rank 1 from 10, rank 0 from 30
  const auto loss = seen["scalars"]["train/loss"];
  ASSERT_EQ(loss.size(), metrics.size()) << tb.output;
  for (size_t i = 0; i < metrics.size(); ++i) {
    EXPECT_EQ(loss[i][0], metrics[i].step);
    EXPECT_EQ(loss[i][1].get<double>(), static_cast<double>(static_cast<float>(metrics[i].loss)))
        << "step " << metrics[i].step;
  }
}

// fsdp.fault_tolerant with checkpoints: 3 replicas of 1 rank, replica 0 (rank 0, the writer)
// out from step 10 to step 30 by the membership schedule, an asynchronous checkpoint every 20
// steps. The one of step 20 is saved by the live replicas alone (rank 1 writes it and names
// ranks 1 and 2 in it). Resumed from it in the same run directory (synchronous saves, the rest
// of the schedule), the job logs the same losses as the first run at every step after it, its
// checkpoints of steps 40 and 60 hold the same bytes, and membership.jsonl keeps the changes
// before step 21 and no line of the abandoned steps after it.
TEST(FaultTolerantTraining, TheLiveReplicasCheckpointsResumeExactly) {
  const std::string args =
      " --training.steps=60 --training.seq_len=64 --training.eval_every=0 --generate.tokens=0 "
      "--logging.plot=false --checkpoint.every=20 --checkpoint.keep=5 ";
  FtJob ft("ft-ckpt", "membership_schedule = \"10:1,2;30:0,1,2\"\n", 3,
           args + "--checkpoint.async=true");
  ASSERT_EQ(ft.job->wait(180), 0) << ft.job->output();
  const fs::path ckpts = ft.run_dir / "checkpoints";
  const auto step_dir = [](int step) {
    char name[32];
    std::snprintf(name, sizeof name, "step-%08d", step);
    return std::string(name);
  };
  const auto live_ranks = [&](int step) {
    const auto index = nlohmann::json::parse(file_bytes(ckpts / step_dir(step) / "index.json"));
    return index["metadata"].value("live_ranks", std::string("(none)"));
  };
  EXPECT_EQ(live_ranks(20), "1,2");
  EXPECT_EQ(live_ranks(40), "0,1,2");
  const auto first_metrics = fsdp_trainer::read_metrics(ft.metrics().string());
  const std::string first_membership = file_bytes(ft.run_dir / "membership.jsonl");
  std::map<int, std::string> first_files;  // the checkpoints the resumed run replaces
  for (const int step : {40, 60})
    first_files[step] = file_bytes(ckpts / step_dir(step) / "rank-00000.safetensors");
  ASSERT_FALSE(first_files[60].empty());

  const auto resumed = run(train_cmd() + " " + ft.config + " --nproc 3" + args +
                           "--checkpoint.resume=" + (ckpts / step_dir(20)).string() +
                           " --fsdp.membership_schedule=21:1,2\\;30:0,1,2");
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("saved by ranks 1,2 of 3"), std::string::npos) << resumed.output;
  const auto metrics = fsdp_trainer::read_metrics(ft.metrics().string());
  ASSERT_EQ(metrics.size(), first_metrics.size());
  for (size_t i = 0; i < metrics.size(); ++i) {
    EXPECT_EQ(metrics[i].step, first_metrics[i].step);
    EXPECT_EQ(metrics[i].loss, first_metrics[i].loss) << "step " << metrics[i].step;
  }
  for (const auto& [step, bytes] : first_files) {
    EXPECT_TRUE(file_bytes(ckpts / step_dir(step) / "rank-00000.safetensors") == bytes)
        << "step " << step;
  }
  EXPECT_EQ(live_ranks(40), "0,1,2");
  // Start, out, back; then the resumed run's: resumed with all three, out again, back.
  const auto changes = FtJob::read_membership(ft.run_dir);
  std::vector<std::pair<int64_t, std::string>> seen;
  for (const auto& c : changes)
    seen.emplace_back(c["step"].get<int64_t>(), c["cause"].get<std::string>());
  const std::vector<std::pair<int64_t, std::string>> expected{
      {1, "start"}, {10, "schedule"}, {21, "resumed"}, {21, "schedule"}, {30, "schedule"}};
  EXPECT_EQ(seen, expected) << file_bytes(ft.run_dir / "membership.jsonl") << "\nfirst run's:\n"
                            << first_membership;
}

// checkpoint.export_hf and --plan in a fault-tolerant job: written at the end by the live
// replicas, here replicas 1 and 2 (replica 0 dropped by the schedule at step 5), rank 1 writing
// the file and comparing the plan. Its
// model.safetensors holds the same bytes as `fsdp-train export` of the job's last checkpoint on
// one process.
TEST(FaultTolerantTraining, TheLiveReplicasExportTheModel) {
  FtJob ft("ft-export", "", 3,
           " --training.steps=10 --training.seq_len=64 --training.eval_every=0 "
           "--generate.tokens=0 --logging.plot=false --checkpoint.every=10 "
           "--checkpoint.export_hf=true --fsdp.membership_schedule=5:1,2 --plan");
  ASSERT_EQ(ft.job->wait(120), 0) << ft.job->output();
  {
    // --plan: made at the start on every rank, compared at the end by the writer then (rank 1):
    // its measured peak within 5% of the prediction, as in check_plan_run.
    std::ifstream in(ft.run_dir / "plan.json");
    ASSERT_TRUE(in.good()) << "no plan.json: " << ft.job->output();
    const auto plan = nlohmann::json::parse(in);
    const double measured = plan["measured"]["peak"].get<double>();
    EXPECT_GE(measured, 0.95 * plan["predicted"]["peak_without_staging"].get<double>()) << plan;
    EXPECT_LE(measured, 1.05 * plan["predicted"]["peak"].get<double>()) << plan;
  }
  const fs::path hf = ft.run_dir / "hf", out = ft.run_dir / "hf-from-checkpoint";
  ASSERT_TRUE(fs::exists(hf / "model.safetensors")) << ft.job->output();
  const auto exported = run(train_cmd() + " export " + ft.config +
                            " --training.seq_len=64 --fsdp.fault_tolerant=false "
                            "--checkpoint latest --out " +
                            out.string());
  ASSERT_EQ(exported.code, 0) << exported.output;
  EXPECT_TRUE(file_bytes(out / "model.safetensors") == file_bytes(hf / "model.safetensors"));
  EXPECT_TRUE(file_bytes(out / "config.json") == file_bytes(hf / "config.json"));

  // model.init_from in a fault-tolerant job: every replica starts from the checkpoint's
  // parameters (lr 1e-30: a step moves no fp32 parameter by an ulp, so its checkpoint holds
  // them bit for bit).
  const fs::path from = ft.run_dir / "checkpoints" / "step-00000010";
  const fs::path again = fs::path(FSDP_TEST_WORK_DIR) / "ft-init-from";
  fs::remove_all(again);
  const auto started = run(train_cmd() + " " + ft.config + " --nproc 3 --training.steps=1 " +
                           "--training.seq_len=64 --training.eval_every=0 --generate.tokens=0 " +
                           "--logging.plot=false --training.lr=1e-30 --training.min_lr=0 "
                           "--training.warmup_steps=0 " +
                           "--checkpoint.every=1 --model.init_from=" + from.string() +
                           " --logging.run_dir=" + again.string());
  ASSERT_EQ(started.code, 0) << started.output;
  const fsdp::safetensors::Reader saved((from / "rank-00000.safetensors").string());
  const fsdp::safetensors::Reader after(
      (again / "checkpoints" / "step-00000001" / "rank-00000.safetensors").string());
  int compared = 0;
  for (const auto& t : saved.header().tensors) {
    if (t.name.rfind("model/", 0) != 0)
      continue;
    EXPECT_TRUE(torch::equal(saved.read(t.name), after.read(t.name))) << t.name;
    ++compared;
  }
  EXPECT_GT(compared, 4);
}

namespace {

// A fine-tuning job's inputs for fault-tolerance tests: a 2.6M-parameter Llama of our own
// (llama-tiny, one step of pretraining, exported) in `<name>-model` with Mistral's chat template,
// and the instruction set without its system messages; base(run_dir) gives the config's
// sections but [fsdp] (LoRA with dropout 0.1, `steps` steps of one conversation per rank,
// precision.param_dtype = auto).
struct TinyChatFinetune {
  fs::path model;
  std::string train, eval;
  int steps = 16;

  explicit TinyChatFinetune(const std::string& name) {
    const auto work = fs::path(FSDP_TEST_WORK_DIR);
    const auto pre = work / (name + "-pretrain");
    model = work / (name + "-model");
    fs::remove_all(pre);
    fs::remove_all(model);
    const auto config =
        write_config(name + "-pretrain", tiny_config(pre.string(), "llama", "llama-tiny"));
    const auto trained = run(train_cmd() + " " + config +
                             " --training.steps=1 --training.eval_every=0 --generate.tokens=0 "
                             "--checkpoint.export_hf=true --logging.plot=false");
    EXPECT_EQ(trained.code, 0) << trained.output;
    fs::copy(pre / "hf", model);
    auto tokenizer_config = nlohmann::json::parse(file_bytes(model / "tokenizer_config.json"));
    tokenizer_config["chat_template"] = fsdp::test::mistral_template(" + ' ' ");
    std::ofstream(model / "tokenizer_config.json") << tokenizer_config.dump(2);
    const auto data = fs::path(FSDP_SOURCE_DIR) / "data" / "instruct";
    train = without_system((data / "kjv_train.jsonl").string(), name + "-train.jsonl");
    eval = without_system(small_eval_file(4), name + "-eval.jsonl");
  }
  std::string base(const std::string& run_dir) const {
    return "[finetune]\nmodel = \"" + model.string() +
           "\"\nmethod = \"lora\"\ntargets = \"wq|wv|w2\"\nlora_rank = 4\nlora_dropout = 0.1\n"
           "train_file = \"" +
           train + "\"\neval_file = \"" + eval +
           "\"\nsamples = 2\nanswer_tokens = 4\n[training]\nsteps = " + std::to_string(steps) +
           "\nbatch_size = 1\nlr = 1e-3\neval_every = " + std::to_string(steps / 2) +
           "\n[precision]\nparam_dtype = \"auto\"\n"
           "[logging]\nrun_dir = \"" +
           run_dir + "\"\nprogress = \"lines\"\nlog_every = 1\nplot = false\n";
  }
};

}  // namespace

// Fine-tuning in a fault-tolerant job: LoRA (with dropout) on a 6-block Llama of our own,
// exported with Mistral's chat template, 3 replicas of 1 rank. Rank
// 0, the writer, is SIGKILLed mid-run, restarted, and joins with a live replica's state: the
// adapters and their optimizer state, the data position, and the answers given before training. A
// run told the membership schedule logs the same losses bit for bit, and writes the same PEFT
// adapter and answers.txt (its "before" answers, which the restarted writer never computed) byte
// for byte. First, a job whose ranks refuse their input is not restarted.
TEST(FaultTolerantTraining, FinetunesThroughAKilledWriterAndEqualsTheScheduleRun) {
  const TinyChatFinetune inputs("ft-chat");
  ASSERT_TRUE(fs::exists(inputs.model / "model.safetensors"));
  const auto base = [&](const std::string& run_dir) { return inputs.base(run_dir); };
  {
    // What a rank refuses (a conversation longer than finetune.max_tokens, found as the data is
    // read) it refuses again: each replica is started once more (a read error may pass), then
    // no more, and the job ends with exit 2 (not after fsdp.max_restarts, 3, runs of each).
    FtJob refused("ft-finetune-refused", "", 3, " --finetune.max_tokens=16", base, "finetune");
    EXPECT_EQ(refused.job->wait(60), 2) << refused.job->output();
    const auto output = refused.job->output();
    EXPECT_NE(output.find("restarts of replicas 0..2: 1, 1, 1"), std::string::npos) << output;
    EXPECT_NE(output.find("not restarted (its ranks refused their input twice in a row)"),
              std::string::npos)
        << output;
  }
  // training.memory_budget (not in the reference): the plan is made by the ranks that start
  // the job; the restarted writer goes without.
  FtJob ft("ft-finetune", "", 3, " --training.memory_budget=1GiB --precision.param_dtype=fp32",
           base, "finetune");
  // 11 steps left for the restarted rank to come back in (it was back within 2 on a 2-core
  // EPYC).
  ASSERT_TRUE(ft.kill_rank_after(5, 0)) << ft.job->output();
  ASSERT_EQ(ft.job->wait(180), 0) << ft.job->output();
  const std::string output = ft.job->output();
  EXPECT_NE(output.find("restarts of replicas 0..2: 1, 0, 0"), std::string::npos) << output;
  EXPECT_NE(output.find("[rank 0] no memory plan in a restarted replica"), std::string::npos)
      << output;
  const auto changes = ft.membership();
  ASSERT_EQ(changes.size(), 3u) << file_bytes(ft.run_dir / "membership.jsonl");
  EXPECT_EQ(changes[1]["live"], nlohmann::json::array({1, 2}));
  EXPECT_EQ(changes[2]["cause"], "rejoined");  // as the writer, back, records it
  EXPECT_EQ(changes[2]["live"], nlohmann::json::array({0, 1, 2}));
  const int64_t dropped = changes[1]["step"], back = changes[2]["step"];
  const auto [evals, reference_dir] = ft.expect_schedule_run_equal(
      std::to_string(dropped) + ":1,2;" + std::to_string(back) + ":0,1,2", 16,
      " --precision.param_dtype=fp32");
  EXPECT_EQ(evals, 2);
  for (const char* f :
       {"adapter/adapter_model.safetensors", "adapter/adapter_config.json", "answers.txt"}) {
    ASSERT_TRUE(fs::exists(ft.run_dir / f)) << f << "\n" << output;
    EXPECT_TRUE(file_bytes(ft.run_dir / f) == file_bytes(reference_dir / f)) << f;
  }
  const auto answers = file_bytes(ft.run_dir / "answers.txt");
  size_t questions = 0;
  for (size_t at = answers.find("\n   before: "); at != std::string::npos;
       at = answers.find("\n   before: ", at + 1))
    ++questions;
  EXPECT_EQ(questions, 2u) << answers;
  std::printf("replica 0 (the writer) dropped at step %lld, back at step %lld\n",
              static_cast<long long>(dropped), static_cast<long long>(back));
}

// A replica restarted after a kill (precision.param_dtype = "auto": it takes the job's choice)
// finds the model file changed (a weight's bytes altered while it was down): its frozen weights'
// checksums differ from the live replica's, so its state copy fails, it leaves with exit 75
// (fsdp-train's path for a joiner that survives a failed copy), and with fsdp.max_restarts = 1 it
// is not started again; replica 0 trains to the end alone.
TEST(FaultTolerantTraining, AJoinerWhoseModelFileChangedIsRefusedAndTheRestTrainOn) {
  TinyChatFinetune inputs("ft-changed");
  // The restarted rank was refused at step 5 in every run seen (killed after 3; its restart
  // overlaps the 1-2 s the live replica takes to drop it): 25 steps left are plenty.
  inputs.steps = 30;
  const auto base = [&](const std::string& run_dir) { return inputs.base(run_dir); };
  FtJob ft("ft-changed-file", "max_restarts = 1\nrestart_delay_s = 0.5\n", 2, "", base, "finetune");
  ASSERT_TRUE(ft.kill_rank_after(3, 1)) << ft.job->output();
  {
    // The last 4 bytes of the file: the last element of a frozen weight.
    const auto weights = inputs.model / "model.safetensors";
    std::fstream f(weights, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-4, std::ios::end);
    const float changed = 0.125f;
    f.write(reinterpret_cast<const char*>(&changed), sizeof changed);
  }
  const int code = ft.job->wait(180);
  const std::string output = ft.job->output();
  EXPECT_EQ(code, 0) << output;  // the job trained to its end
  EXPECT_NE(output.find("replica 1's state copy at step "), std::string::npos) << output;
  EXPECT_NE(output.find("held tensor"), std::string::npos) << output;
  EXPECT_NE(output.find("this rank leaves the job"), std::string::npos) << output;
  EXPECT_NE(output.find("rank 1 ended (exit 75)"), std::string::npos) << output;
  EXPECT_NE(output.find("restarts of replicas 0..1: 0, 1"), std::string::npos) << output;
  // precision.param_dtype = "auto", measured on every rank at the start: the restarted rank
  // takes that choice instead of measuring alone.
  EXPECT_NE(output.find("[rank 1] compute dtype "), std::string::npos) << output;
  EXPECT_NE(output.find(", as the job chose at its start"), std::string::npos) << output;
  const auto m = fsdp_trainer::read_metrics(ft.metrics().string());
  ASSERT_EQ(m.size(), 30u) << output;
  for (const auto& s : m) {
    EXPECT_TRUE(std::isfinite(s.loss)) << s.step;
    // A step whose groups were made anew counts the old groups' collectives and the new ones'
    // (it logged -2.19 KiB of all-reduce per step on average before).
    EXPECT_GE(s.allreduce_bytes, 0) << s.step;
    EXPECT_GE(s.allgather_bytes, 0) << s.step;
  }
  const auto changes = ft.membership();
  ASSERT_GE(changes.size(), 3u) << file_bytes(ft.run_dir / "membership.jsonl");
  EXPECT_EQ(changes[1]["live"], nlohmann::json::array({0}));
  EXPECT_EQ(changes.back()["live"], nlohmann::json::array({0}));
}
