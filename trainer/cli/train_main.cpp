// fsdp-train: train a GPT or Llama model with FSDP from one TOML file.
//
//   fsdp-train [--nproc N] [CONFIG.toml] [--section.key=value ...]
//   torchrun --no-python --nproc-per-node N fsdp-train CONFIG.toml   (the same run)
//   fsdp-train export [--nproc N] CONFIG.toml --checkpoint PATH --out DIR
//       writes a saved model (a sharded checkpoint, "latest", or a Hugging Face directory) as a
//       Hugging Face directory, on any number of ranks
//   fsdp-train generate [--nproc N] CONFIG.toml --checkpoint PATH
//       samples from a saved model (the [generate] options)
//   fsdp-train --version, fsdp-train --help (the commands, one line each)
//   fsdp-train fr-analyze DIR
//       reads a failed job's flight-recorder dumps (<run_dir>/flight_recorder) and names the
//       first collective the ranks disagree on and the rank(s) that never joined it
//   fsdp-train finetune [--nproc N] CONFIG.toml
//       fine-tunes a pretrained model (GGUF or Hugging Face directory) on an instruction set (the
//       [finetune] options: full, LoRA or QLoRA), answering held-out questions before and after
//
// Exit codes: 0 done, 2 bad input (config, override, corpus), 1 anything else.
//
// This file is the body of two programs' main() (train_main.h; main.cpp calls it). fsdp-train
// links no CUDA library (loading libtorch_cuda costs a CPU-only process about 480 MB of RSS,
// measured); with training.device = "cuda" it replaces itself (exec, same arguments, same pid
// under torchrun) with fsdp-train-cuda from its own directory, which is this file compiled with
// FSDP_TRAIN_CUDA and linked with fsdp::cuda.
#include <malloc.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <new>
#include <optional>
#include <string>
#include <vector>

#ifdef FSDP_TRAIN_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/cuda.h>

#include <fsdp/distributed/cuda.h>
#endif

#include <torch/version.h>

#include <fsdp/core/caching_allocator.h>
#include <fsdp/core/memory.h>
#include <fsdp/distributed/flight_analysis.h>
#include <fsdp/distributed/flight_recorder.h>
#include <fsdp/distributed/local_launch.h>
#include <fsdp/distributed/process_group.h>
#include <fsdp/distributed/replica_quorum.h>
#include <fsdp/fully_shard.h>

#include "config/config.h"
#include "core_binding.h"
#include "data/data.h"
#include "launcher.h"
#include "preflight.h"
#include "program_file.h"
#include "train/model_factory.h"
#include "train/replica_membership.h"
#include "train/trainer.h"
#include "train_main.h"

namespace {

std::string rank_prefix() {
  const char* rank = std::getenv("RANK");
  return rank ? std::string("[rank ") + rank + "] " : "";
}

std::string first_line(const std::string& s) {
  return s.substr(0, s.find('\n'));
}

#ifdef FSDP_TRAIN_CUDA
// Registers NCCL and checks that this rank has its GPU; the peak counters are the caching
// allocator's (device memory), not the CPU's.
void require_gpus(int ranks_per_node) {
  const int visible =
      torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
  if (visible == 0)
    throw fsdp_trainer::ConfigError("'training.device' = 'cuda' but no CUDA device is visible");
  if (visible < ranks_per_node) {
    throw fsdp_trainer::ConfigError(
        "'training.device' = 'cuda' needs one GPU per rank: " + std::to_string(ranks_per_node) +
        " ranks per node, " + std::to_string(visible) + " GPU(s) visible");
  }
}

fsdp_trainer::DeviceMemory prepare_cuda(int local_rank, int local_world_size) {
  require_gpus(std::max(local_rank + 1, local_world_size));
  fsdp::register_nccl_backend();
  const auto device = static_cast<c10::DeviceIndex>(local_rank);
  namespace alloc = c10::cuda::CUDACachingAllocator;
  fsdp_trainer::DeviceMemory memory;
  memory.reset_peak = [device] { alloc::resetPeakStats(device); };
  constexpr auto kAll = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  memory.peak_bytes = [device] { return alloc::getDeviceStats(device).allocated_bytes[kAll].peak; };
  memory.peak_reserved_bytes = [device] {
    return alloc::getDeviceStats(device).reserved_bytes[kAll].peak;
  };
  return memory;
}
#else
// Replaces this process with fsdp-train-cuda (see the top of the file); returns only if there
// is none.
std::filesystem::path cuda_trainer_path() {
  std::error_code ec;
  std::filesystem::path self = fsdp_trainer::program_file();
  if (self == "/proc/self/exe")
    self = std::filesystem::read_symlink(self, ec);
  return ec ? std::filesystem::path() : self.parent_path() / "fsdp-train-cuda";
}

bool access_cuda_trainer() {
  const auto p = cuda_trainer_path();
  return !p.empty() && std::filesystem::exists(p);
}

void exec_cuda_trainer(char** argv) {
  const auto cuda_trainer = cuda_trainer_path();
  if (access_cuda_trainer()) {
    ::execv(cuda_trainer.c_str(), argv);
    throw std::runtime_error("cannot start " + cuda_trainer.string() + ": " + std::strerror(errno));
  }
  throw fsdp_trainer::ConfigError(
      "'training.device' = 'cuda' but there is no fsdp-train-cuda next to fsdp-train (build its "
      "target; CMake defines it when it finds the CUDA toolkit and NCCL, FSDP_WITH_CUDA=ON)");
}
#endif

// One line: this program's version, the LibTorch it was built against, and its paths.
std::string version_text() {
  std::string text = std::string("fsdp-train ") + FSDP_VERSION + " (fsdp-cpp; LibTorch " +
                     std::to_string(TORCH_VERSION_MAJOR) + "." +
                     std::to_string(TORCH_VERSION_MINOR) + "." +
                     std::to_string(TORCH_VERSION_PATCH) + "; Gloo";
#ifdef FSDP_TRAIN_CUDA
  text += " and NCCL";
#else
  text += access_cuda_trainer() ? "; NCCL through fsdp-train-cuda" : "; no CUDA path in this build";
#endif
  return text + ")";
}

}  // namespace

// glibc gives every thread that allocates its own arena (up to 8 per core), and memory freed
// in one stays there: Gloo's lane threads stage every collective in buffers of their own. Two
// arenas, set before any thread starts, cut the peak RSS of a gpt2-small rank by 10-30 MiB
// (of ~500) at no measured cost in speed; the user's MALLOC_ARENA_MAX, if set, wins. Debian's
// jemalloc (LD_PRELOAD) saves more, 86-101 MiB, for 5-8% of the speed: docs/trainer.md, "Resident
// memory".
static void bound_malloc_arenas() {
#ifdef __GLIBC__
  if (std::getenv("MALLOC_ARENA_MAX") == nullptr)
    mallopt(M_ARENA_MAX, 2);
#endif
}

namespace {

// fsdp-train fr-analyze DIR: reads files only (no config, no ranks).
int fr_analyze(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: fsdp-train fr-analyze DIR (a run's flight_recorder directory)\n");
    return 2;
  }
  try {
    std::fputs(fsdp::analyze_flight_dumps(argv[2]).text.c_str(), stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp-train fr-analyze: %s\n", first_line(e.what()).c_str());
    return 2;
  }
}

// What the command line asks for.
struct CommandLine {
  std::string command = "train";  // train, finetune, export, generate
  std::string config_path, checkpoint, out_dir;
  int nproc = 0;
  // Several nodes, one launcher each (--nproc per node): node 0's serves the store.
  int nnodes = 1, node_rank = 0, master_port = 0;
  std::string master_addr;
  bool print_config = false;
  std::vector<std::string> overrides;  // section.key=value
};

// The options a command does not take, or lacks: why, or nullptr.
const char* command_misuse(const CommandLine& cl) {
  const bool trains = cl.command == "train" || cl.command == "finetune";
  if (trains && (!cl.checkpoint.empty() || !cl.out_dir.empty()))
    return "--checkpoint and --out belong to the commands export and generate";
  if (!trains && cl.checkpoint.empty())
    return "this command needs --checkpoint PATH";
  if (cl.command == "export" && cl.out_dir.empty())
    return "export needs --out DIR";
  if (cl.command == "generate" && !cl.out_dir.empty())
    return "generate takes no --out";
  return nullptr;
}

// Parses the command line into `cl`; returns an exit code when there is nothing more to do
// (help, version, the option reference, or bad usage: one line, exit 2).
std::optional<int> parse_command_line(int argc, char** argv, CommandLine& cl) {
  // The command is the first argument, when it is one ("train" otherwise).
  int shift = 0;
  if (argc > 1 &&
      (std::strcmp(argv[1], "train") == 0 || std::strcmp(argv[1], "export") == 0 ||
       std::strcmp(argv[1], "generate") == 0 || std::strcmp(argv[1], "finetune") == 0)) {
    cl.command = argv[1];
    shift = 1;
  }
  CLI::App app{"fsdp-train: Fully Sharded Data Parallel training of GPT and Llama models"};
  app.allow_extras();
  bool print_reference = false, plan = false;
  app.add_option("--checkpoint", cl.checkpoint,
                 "export, generate: the saved model (a sharded checkpoint directory, 'latest', or "
                 "a Hugging Face directory)");
  app.add_option("--out", cl.out_dir,
                 "export: the Hugging Face directory to write (must not exist)");
  app.add_option("config", cl.config_path, "TOML configuration file (defaults apply without one)");
  app.add_option("--nproc", cl.nproc,
                 "Start this many local ranks (like torchrun --nproc-per-node)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--nnodes", cl.nnodes,
                 "With --nproc: nodes of the job, each with a launcher of its own (fault "
                 "tolerance across hosts; torchrun otherwise)")
      ->check(CLI::Range(1, 4096));
  app.add_option("--node-rank", cl.node_rank, "With --nnodes: this node's place (0: the store's)")
      ->check(CLI::Range(0, 4095));
  app.add_option("--master-addr", cl.master_addr,
                 "With --nnodes: node 0's address, where its launcher serves the store");
  app.add_option("--master-port", cl.master_port, "With --nnodes: the store's port")
      ->check(CLI::Range(1, 65535));
  app.add_flag("--print-config", cl.print_config, "Print the resolved configuration and exit");
  app.add_flag("--plan", plan,
               "Print the predicted per-rank peak memory before step 1 and predicted vs "
               "measured at the end (logging.plan)");
  app.add_flag("--config-reference", print_reference, "Print the option reference (Markdown)");
  app.set_version_flag("--version", version_text());
  app.footer(
      "Commands (the first argument; train when there is none):\n"
      "  train [CONFIG]                             pretrain a GPT or Llama model\n"
      "  finetune CONFIG                            LoRA, QLoRA or full fine-tuning of a GGUF file "
      "or a Hugging Face directory\n"
      "  export CONFIG --checkpoint PATH --out DIR  write a saved model as a Hugging Face "
      "directory\n"
      "  generate CONFIG --checkpoint PATH          sample text from a saved model\n"
      "  fr-analyze DIR                             name the rank a failed job waited for, from "
      "its "
      "flight-recorder dumps\n"
      "Any option can be overridden: --training.steps=200 --model.preset=gpt2-small\n"
      "Options and defaults: fsdp-train --config-reference, or docs/trainer.md");
  try {
    // CLI11 takes argv[0] as the program's name: with a command, the command is.
    app.parse(argc - shift, argv + shift);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "fsdp-train: %s\n", first_line(e.what()).c_str());
    return 2;
  }
  if (print_reference) {
    std::fputs(fsdp_trainer::reference_markdown().c_str(), stdout);
    return 0;
  }
  for (const auto& extra : app.remaining()) {
    if (extra.rfind("--", 0) != 0) {
      std::fprintf(stderr,
                   "fsdp-train: unexpected argument '%s' (overrides look like "
                   "--section.key=value)\n",
                   extra.c_str());
      return 2;
    }
    cl.overrides.push_back(extra.substr(2));
  }
  if (plan)
    cl.overrides.push_back("logging.plan=true");
  if (const char* misuse = command_misuse(cl)) {
    std::fprintf(stderr, "fsdp-train: %s\n", misuse);
    return 2;
  }
  return std::nullopt;
}

// A rank or the launcher refused its input (a ConfigError): a fault-tolerant job's launcher
// does not restart a replica that does so twice in a row.
constexpr int kRefusedInputExitCode = 2;

// Runs the launcher's or a rank's work; what a failure prints and the exit code it gives are
// the same in both, and whether the rank was started anew or forked from the launcher.
int report_failures(const std::function<int()>& work) {
  try {
    return work();
  } catch (const fsdp_trainer::ConfigError& e) {
    std::fprintf(stderr, "%sfsdp-train: config error: %s\n", rank_prefix().c_str(), e.what());
    return kRefusedInputExitCode;
  } catch (const fsdp_trainer::LeftTheJob& e) {
    // fsdp.fault_tolerant: the others train on; a launcher with restarts starts it again.
    std::fprintf(stderr, "%sfsdp-train: %s; this rank leaves the job\n", rank_prefix().c_str(),
                 e.what());
    return fsdp_trainer::LeftTheJob::kExitCode;
  } catch (const fsdp::ReplicaStateLost& e) {
    // fsdp.fault_tolerant: every replica lost a process; restarting one cannot bring the state
    // back, so the launcher ends the job (a checkpoint is what is left).
    std::fprintf(stderr, "%sfsdp-train: %s\n", rank_prefix().c_str(), e.what());
    return fsdp_trainer::kStateLostExitCode;
  } catch (const std::bad_alloc&) {
    // What the size check before building (check_model_fits) could not foresee.
    std::fprintf(stderr,
                 "%sfsdp-train: out of memory (std::bad_alloc): the model, batch or sequence "
                 "length does not fit this machine (fsdp-train --plan predicts the peak)\n",
                 rank_prefix().c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%sfsdp-train: %s\n", rank_prefix().c_str(), first_line(e.what()).c_str());
    // A failed step: what this rank's collectives were doing (a no-op before the trainer set
    // the flight recorder's directory).
    fsdp::FlightRecorder::global().dump("failed: " + first_line(e.what()));
    // Cut off from the store, a torchrun agent would wait on it for ever: told to end, it
    // stops this host's other ranks and exits too.
    if (const int agent = fsdp::cut_off_torchrun_agent()) {
      std::fprintf(stderr,
                   "%sfsdp-train: this host is cut off from the job's store: its torchrun agent "
                   "(pid %d) is told to end instead of waiting on the store for ever\n",
                   rank_prefix().c_str(), agent);
      std::fflush(stderr);
      fsdp::end_torchrun_agent(agent);
    }
    return 1;
  }
}

int run_rank(const fsdp_trainer::Config& config, const CommandLine& cl);

// Every way fsdp-train ends normally: stdio flushed, the at_quick_exit handlers run (the flight
// recorder's dump at exit), and no static destructor: LibTorch's deregister its thousands of
// operators and the heap is freed piece by piece, about 0.1 s of CPU per process that the
// operating system does at once. Nothing of ours waits for them: the trainer releases its
// models and closes its files itself (run_rank).
[[noreturn]] void end_process(int code) {
  std::fflush(nullptr);
  std::quick_exit(code);
}

// --nproc N without a launcher around: checks the job, then starts N ranks of this program with
// the same arguments less --nproc.
int launch_ranks(const fsdp_trainer::Config& config, const CommandLine& cl, int argc, char** argv) {
  if (cl.nnodes > 1 && (cl.master_addr.empty() || cl.master_port == 0 || cl.node_rank >= cl.nnodes))
    throw fsdp_trainer::ConfigError(
        "--nnodes " + std::to_string(cl.nnodes) +
        " needs --master-addr and --master-port (node 0's store) and a --node-rank below it");
  fsdp_trainer::preflight(config, cl.command, cl.nproc * cl.nnodes, cl.nproc);
#ifdef FSDP_TRAIN_CUDA
  if (config.training.device == "cuda")
    require_gpus(cl.nproc);
#endif
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    bool launcher_option = false;
    for (const char* o : {"--nproc", "--nnodes", "--node-rank", "--master-addr", "--master-port"}) {
      if (a == o)
        ++i;  // its value too
      launcher_option = launcher_option || a == o || a.rfind(std::string(o) + "=", 0) == 0;
    }
    if (!launcher_option)
      args.push_back(a);
  }
  std::function<int()> rank_main;
#ifndef FSDP_TRAIN_CUDA
  // A rank forked from this launcher (fsdp/distributed/local_launch.h) trains the config parsed
  // here, and ends as main() does. The CUDA trainer's ranks are always new processes (CUDA
  // does not survive a fork), and so are a fault-tolerant job's restarted ones (the launcher's
  // store runs threads by then); the launcher names every rank's pid of such a job.
  rank_main = [&config, &cl]() -> int {
    end_process(report_failures([&] { return run_rank(config, cl); }));
  };
#endif
  // fsdp.fault_tolerant: a failed rank ends only its replica, which starts again (not in a
  // schedule's reference run, whose membership is the schedule's alone).
  std::optional<fsdp::LocalLaunchOptions::ReplicaRestarts> restarts;
  const auto& f = config.fsdp;
  if (f.fault_tolerant) {
    restarts.emplace();
    restarts->ranks_per_replica = static_cast<int>(f.hybrid_shard_size);
    restarts->max_restarts = f.membership_schedule.empty() ? static_cast<int>(f.max_restarts) : 0;
    restarts->delay = std::chrono::milliseconds(std::llround(f.restart_delay_s * 1000));
    restarts->job_over_exit_code = fsdp_trainer::kStateLostExitCode;
    restarts->refused_input_exit_code = kRefusedInputExitCode;
    // A rank of a replica that lost one leaves once its collective fails and the others have
    // decided: within the timeout and the vote's.
    restarts->grace =
        std::chrono::milliseconds(std::llround(f.timeout_s * 1000)) + std::chrono::seconds(60);
  }
  fsdp_trainer::Nodes nodes{cl.nnodes, cl.node_rank, cl.master_addr, cl.master_port};
  return fsdp_trainer::launch_local(cl.nproc, args, static_cast<int>(config.training.threads),
                                    rank_main, restarts, nodes);
}

// One rank of the job (started by a launcher, or alone): checks the job's shape before joining
// it (every rank fails the same way; rank 0 says why), then runs the command.
int run_rank(const fsdp_trainer::Config& config, const CommandLine& cl) {
  const fsdp::LaunchEnv env = fsdp::launch_env_from_environment();
  try {
    fsdp_trainer::preflight(config, cl.command, env.world_size, env.local_world_size);
  } catch (const fsdp_trainer::ConfigError&) {
    if (env.rank != 0)
      return 2;
    throw;
  }
  if (config.training.bind_cores) {
    // Before the process group and LibTorch's thread pools start their threads: they inherit it.
    std::vector<int> share;
    const std::string bound =
        fsdp_trainer::bind_to_cores(env.local_rank, env.local_world_size, &share);
    if (env.rank == 0)
      std::printf("fsdp-train: training.bind_cores: rank 0 %s\n", bound.c_str());
    if (env.rank == 0 && !share.empty() &&
        config.training.threads > static_cast<int64_t>(share.size()))
      std::printf(
          "fsdp-train: warning: training.threads = %lld on %zu CPUs per rank: its "
          "threads share them\n",
          static_cast<long long>(config.training.threads), share.size());
  }
  // Declared before the trainer, so it runs after the trainer is gone, on every way out: the
  // model's units (and through them its NCCL groups) otherwise live in fsdp's registry until
  // static destruction, after the CUDA runtime's, and NCCL's teardown then aborts the process
  // (fsdp::release_dead_models).
  struct ReleaseModels {
    ~ReleaseModels() { fsdp::release_dead_models(); }
  } release_models;
  fsdp_trainer::DeviceMemory device_memory;
#ifdef FSDP_TRAIN_CUDA
  if (config.training.device == "cuda")
    device_memory = prepare_cuda(env.local_rank, env.local_world_size);
#endif
  if (cl.command == "train" || cl.command == "finetune") {
    fsdp_trainer::Trainer trainer(config, std::move(device_memory));
    trainer.train();
    if (cl.command == "train")
      trainer.generate();  // finetune answers its held-out questions inside train()
    return 0;
  }
  fsdp_trainer::Trainer trainer(config, std::move(device_memory), fsdp_trainer::Purpose::kUseSaved);
  const auto from = trainer.load_weights(cl.checkpoint);
  if (trainer.rank() == 0)
    std::printf("fsdp-train %s: parameters from %s\n", cl.command.c_str(), from.c_str());
  if (cl.command == "export")
    trainer.export_hf(cl.out_dir, /*replace=*/false);
  else
    trainer.generate();
  return 0;
}

}  // namespace

namespace fsdp_trainer {

int train_main(int argc, char** argv) {
  bound_malloc_arenas();
  fsdp::die_with_launcher();
  // Under the tracker, which then counts the bytes requested; training.cpu_cache turns the
  // caching off once the config is read (Trainer).
  fsdp::memory::install_caching_allocator();
  fsdp::memory::install_tracking_allocator();

  if (argc > 1 && std::strcmp(argv[1], "fr-analyze") == 0)
    return fr_analyze(argc, argv);
  CommandLine cl;
  if (const auto done = parse_command_line(argc, argv, cl))
    return *done;
  end_process(report_failures([&] {
    // Validate before starting any rank: a bad config fails once, immediately.
    const auto config =
        fsdp_trainer::load_config(cl.config_path, cl.overrides, cl.command == "finetune");
    if (cl.print_config) {
      std::fputs(fsdp_trainer::to_toml(config).c_str(), stdout);
      return 0;
    }
#ifndef FSDP_TRAIN_CUDA
    if (config.training.device == "cuda")
      exec_cuda_trainer(argv);
#endif
    if (cl.nproc > 0 && std::getenv("RANK") == nullptr)
      return launch_ranks(config, cl, argc, argv);
    return run_rank(config, cl);
  }));
}

}  // namespace fsdp_trainer
