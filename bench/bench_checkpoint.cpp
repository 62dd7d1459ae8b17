// Checkpoint I/O on a real-sized model: the time, bytes and extra tensor memory of saving and
// loading a sharded checkpoint (parameters + AdamW state) and a Hugging Face export, per rank.
//
//   OMP_NUM_THREADS=1 torchrun --standalone --no-python --nproc-per-node 2
//       build/bench/bench_checkpoint --dir /some/disk/dir [--preset gpt2-124m]
//
// bench/checkpoint_io.py runs it beside the disk's own write speed and prints the table. The
// first operation, raw_write, is the baseline: as many bytes as a rank's checkpoint file,
// written from one tensor with pwrite and fsynced. Each rank prints nothing; rank 0 prints one
// JSON object per operation:
//   {"op", "seconds", "bytes" (on disk), "extra_peak" (per rank: the tensor high-water mark
//    during the operation above what was live before it), "state_bytes" (per rank: live tensor
//    bytes before, i.e. the sharded parameters and optimizer state)}
// and one {"model": ...} object first with the bounds' ingredients (largest unit, largest
// parameter, both unsharded). Every load is checked to give back the parameters it saved.
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <thread>

#include <fsdp/fsdp.h>

#include "gpt.h"
#include "hf_format.h"

namespace {

namespace fs = std::filesystem;

int64_t dir_bytes(const fs::path& dir) {
  int64_t n = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    n += e.is_regular_file() ? static_cast<int64_t>(e.file_size()) : 0;
  return n;
}

// One int64 per rank, on every rank.
std::vector<int64_t> all_ranks(fsdp::ProcessGroup& pg, int64_t v) {
  auto all = torch::empty({pg.size()}, torch::kLong);
  fsdp::all_gather(pg, {torch::tensor({v}, torch::kLong)}, {all})->wait();
  return std::vector<int64_t>(all.data_ptr<int64_t>(), all.data_ptr<int64_t>() + pg.size());
}

std::string json_list(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i)
    s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// A fingerprint of this rank's parameters: the sum of squares in float64.
double fingerprint(torch::nn::Module& model) {
  double s = 0;
  for (const auto& p : model.parameters())
    s += p.detach().to(torch::kDouble).pow(2).sum().item<double>();
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::memory::install_tracking_allocator();
  CLI::App app{"bench_checkpoint: checkpoint save/load time and memory"};
  std::string dir, preset = "gpt2-124m";
  int64_t seq = 64;
  app.add_option("--dir", dir, "Directory for the files (removed at the end)")->required();
  app.add_option("--preset", preset, "GPT preset");
  app.add_option("--seq", seq, "Tokens of the one training step that creates AdamW's state");
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(1);
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank();

  // Deferred initialisation, as fsdp-train does: no rank ever holds the whole model.
  auto cfg = fsdp_models::GPTConfig::preset(preset);
  fsdp_models::GPT model(cfg, fsdp_models::ModelInit().device(torch::kMeta).seed(1));
  fsdp_models::to_hollow(*model, torch::TensorOptions().dtype(torch::kFloat32));
  fsdp::FullyShardOptions options(pg);
  options.param_init(fsdp_models::shard_initializer(*model, fsdp_models::gpt_init_scheme(cfg), 1));
  fsdp_models::parallelize_gpt(model, options);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-4));
  {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
    auto ids = torch::randint(cfg.vocab_size, {1, seq + 1}, gen);
    auto loss =
        fsdp_models::lm_loss(fsdp::forward(model, ids.narrow(1, 0, seq)), ids.narrow(1, 1, seq));
    loss.backward();
    opt.step();
    opt.zero_grad(/*set_to_none=*/true);
  }

  // The bounds' ingredients: the largest unit (a block "h<i>", or the root: the rest) and the
  // largest parameter, unsharded, in bytes.
  std::map<std::string, int64_t> unit_bytes;
  int64_t largest_param = 0;
  for (const auto& s : fsdp::param_shards(*model)) {
    const int64_t bytes = c10::multiply_integers(s.global_shape) * 4;
    const auto dot = s.name.find('.');
    const std::string head = s.name.substr(0, dot);
    const bool block = head.size() > 1 && head[0] == 'h' && std::isdigit(head[1]);
    unit_bytes[block ? head : "root"] += bytes;
    largest_param = std::max(largest_param, bytes);
  }
  int64_t largest_unit = 0;
  for (const auto& [name, bytes] : unit_bytes)
    largest_unit = std::max(largest_unit, bytes);
  if (rank == 0) {
    std::printf(
        "{\"model\": \"%s\", \"params\": %lld, \"ranks\": %d, \"largest_unit\": %lld, "
        "\"root_unit\": %lld, \"block_unit\": %lld, \"largest_param\": %lld}\n",
        preset.c_str(), static_cast<long long>(cfg.num_params()), pg->size(),
        static_cast<long long>(largest_unit), static_cast<long long>(unit_bytes["root"]),
        static_cast<long long>(unit_bytes["h0"]), static_cast<long long>(largest_param));
    std::fflush(stdout);
  }

  const fs::path root(dir);
  if (rank == 0) {
    fs::remove_all(root);
    fs::create_directories(root);
  }
  pg->barrier();
  const double saved = fingerprint(*model);
  // A load must restore what was saved: the parameters are spoiled before each one.
  auto spoil = [&] {
    torch::NoGradGuard no_grad;
    for (auto& p : model->parameters())
      p.add_(1.0);
  };
  auto measure = [&](const std::string& op, const fs::path& out, const std::function<void()>& fn) {
    if (op.rfind("load", 0) == 0)
      spoil();
    // A virtual disk writes the previous operation's data back for seconds after its fsync and
    // slows the next one down: every operation starts on a quiet disk.
    ::sync();
    std::this_thread::sleep_for(std::chrono::seconds(2));
    pg->barrier();
    const int64_t before = fsdp::memory::current_bytes();
    fsdp::memory::reset_peak();
    const auto start = std::chrono::steady_clock::now();
    fn();
    pg->barrier();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const auto extra = all_ranks(*pg, fsdp::memory::peak_bytes() - before);
    const auto state = all_ranks(*pg, before);
    if (std::abs(fingerprint(*model) - saved) > 1e-9 * saved)
      throw std::runtime_error(op + ": the parameters changed");
    if (rank == 0) {
      std::printf(
          "{\"op\": \"%s\", \"seconds\": %.4f, \"bytes\": %lld, \"extra_peak\": %s, "
          "\"state_bytes\": %s}\n",
          op.c_str(), seconds, static_cast<long long>(dir_bytes(out)), json_list(extra).c_str(),
          json_list(state).c_str());
      std::fflush(stdout);
    }
  };
  const auto ckpt = root / "ckpt", hf = root / "hf";
  // The baseline in this process: as many bytes as this rank's checkpoint file, from a fresh
  // tensor, in one pwrite per 64 MiB, then fsync.
  const int64_t raw_bytes = fsdp::memory::current_bytes() / 4 * 4;
  auto raw = torch::full({raw_bytes / 4}, 0.5f);
  measure("raw_write", root / "raw", [&] {
    const int64_t bytes = raw_bytes;
    fs::create_directories(root / "raw");
    const auto path = root / "raw" / ("rank-" + std::to_string(rank));
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    const auto* p = static_cast<const char*>(raw.data_ptr());
    for (int64_t off = 0; off < bytes;) {
      const ssize_t put = ::pwrite(fd, p + off, std::min<int64_t>(64 << 20, bytes - off), off);
      if (put <= 0)
        throw std::runtime_error("raw write failed");
      off += put;
    }
    ::fsync(fd);
    ::close(fd);
  });
  raw = torch::Tensor();
  measure("save_sharded", ckpt, [&] { fsdp::save_sharded(ckpt.string(), *model, &opt, *pg); });
  measure("load_sharded", ckpt, [&] { fsdp::load_sharded(ckpt.string(), *model, &opt); });
  measure("save_hf", hf, [&] { fsdp_models::save_hf(hf.string(), model, *pg); });
  measure("load_hf", hf, [&] { fsdp_models::load_hf(hf.string(), model); });
  pg->barrier();
  if (rank == 0)
    fs::remove_all(root);
  return 0;
}
