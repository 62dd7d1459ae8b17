// Example: a byte-level GPT trained with FULL_SHARD, one unit per block, on real text.
//
//   torchrun --no-python --nproc-per-node 2 build/examples/train_gpt --text data/kjv.txt
//
// Every rank samples its own batches; rank 0 prints the loss averaged over ranks, the time per
// step, and the peak tensor memory of this rank (tracking allocator). The whole FSDP-specific
// code is: init_process_group, parallelize_gpt, and fsdp::forward on the model.
#include <torch/torch.h>

#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <fstream>
#include <iterator>

#include <fsdp/fsdp.h>

#include "gpt.h"

namespace {

torch::Tensor load_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw std::runtime_error("cannot read text file '" + path + "'");
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
  if (bytes.size() < 10000)
    throw std::runtime_error("text file '" + path + "' is too short");
  return torch::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size())}, torch::kUInt8)
      .to(torch::kLong);
}

// (B, T+1) windows at random offsets of `data`.
torch::Tensor sample(const torch::Tensor& data, int64_t batch, int64_t t, at::Generator& gen) {
  auto starts = torch::randint(data.size(0) - t - 1, {batch}, gen, torch::kLong);
  auto offsets = torch::arange(t + 1, torch::kLong);
  return data.index({starts.unsqueeze(1) + offsets.unsqueeze(0)});
}

double mean_over_ranks(fsdp::ProcessGroup& pg, double v) {
  auto t = torch::tensor({v}, torch::kDouble);
  fsdp::all_reduce(pg, t, fsdp::ReduceOp::kAvg, "mean of a metric")->wait();
  return t.item<double>();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train a byte-level GPT with fsdp-cpp (FULL_SHARD)"};
  std::string text_path = "data/kjv.txt", preset = "gpt2-tiny";
  int steps = 200, eval_every = 50;
  int64_t batch = 8, seq = 128;
  double lr = 3e-3;
  app.add_option("--text", text_path, "training text (bytes are tokens)");
  app.add_option("--preset", preset, "model size preset");
  app.add_option("--steps", steps, "optimizer steps");
  app.add_option("--batch", batch, "sequences per rank per step");
  app.add_option("--seq", seq, "tokens per sequence");
  app.add_option("--lr", lr, "AdamW learning rate");
  app.add_option("--eval-every", eval_every, "steps between held-out evaluations");
  CLI11_PARSE(app, argc, argv);

  try {
    fsdp::memory::install_tracking_allocator();
    torch::set_num_threads(1);  // one core per rank
    auto pg = fsdp::init_process_group();
    const int rank = pg->rank();

    auto data = load_bytes(text_path);
    const int64_t split = data.size(0) * 95 / 100;
    auto train = data.narrow(0, 0, split), held_out = data.narrow(0, split, data.size(0) - split);

    auto cfg = fsdp_models::GPTConfig::preset(preset);
    cfg.vocab_size = 256;
    cfg.block_size = seq;
    torch::manual_seed(0);
    fsdp_models::GPT model(cfg);
    fsdp_models::parallelize_gpt(model, fsdp::FullyShardOptions(pg));
    torch::optim::AdamW opt(model->parameters(),
                            torch::optim::AdamWOptions(lr).weight_decay(0.1).betas({0.9, 0.95}));

    auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + rank);
    auto eval_gen = at::make_generator<at::CPUGeneratorImpl>(7 + rank);
    auto evaluate = [&] {
      torch::NoGradGuard no_grad;
      double total = 0;
      for (int i = 0; i < 4; ++i) {
        auto tok = sample(held_out, batch, seq, eval_gen);
        total +=
            fsdp_models::lm_loss(fsdp::forward(model, tok.narrow(1, 0, seq)), tok.narrow(1, 1, seq))
                .item<double>();
      }
      return mean_over_ranks(*pg, total / 4);
    };
    if (rank == 0) {
      fmt::print("fsdp-cpp example: {} ({:.2f}M params) on {} ranks, {} x {} tokens per rank\n",
                 preset, cfg.num_params() / 1e6, pg->size(), batch, seq);
    }
    const double initial_eval = evaluate();
    if (rank == 0)
      fmt::print("step    0 | eval loss {:.4f}\n", initial_eval);
    double last_eval = initial_eval;
    for (int step = 1; step <= steps; ++step) {
      auto t0 = std::chrono::steady_clock::now();
      auto tok = sample(train, batch, seq, gen);
      opt.zero_grad();
      auto loss =
          fsdp_models::lm_loss(fsdp::forward(model, tok.narrow(1, 0, seq)), tok.narrow(1, 1, seq));
      loss.backward();
      opt.step();
      const double dt =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double mean_loss = mean_over_ranks(*pg, loss.item<double>());
      if (rank == 0) {
        fmt::print("step {:4d} | loss {:.4f} | {:6.1f} ms | {:7.0f} tok/s | peak {}\n", step,
                   mean_loss, dt * 1e3, batch * seq * pg->size() / dt,
                   fsdp::memory::format_bytes(fsdp::memory::peak_bytes()));
      }
      if (step % eval_every == 0 || step == steps) {
        last_eval = evaluate();
        if (rank == 0)
          fmt::print("step {:4d} | eval loss {:.4f}\n", step, last_eval);
      }
    }
    if (rank == 0) {
      fmt::print("done: held-out loss {:.4f} -> {:.4f}\n", initial_eval, last_eval);
    }
    return last_eval < initial_eval ? 0 : 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "train_gpt: {}\n", e.what());
    return 1;
  }
}
