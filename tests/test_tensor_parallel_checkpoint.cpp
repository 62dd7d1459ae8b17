// Sharded checkpoints across meshes (fsdp/checkpoint/tensor_parallel_layout.h): a model and its
// AdamW state saved on a (dp, tp) = (2, 2) mesh load on (4, 1), (1, 2), (1, 4) and (1, 1)
// exactly: every rank's parameter and optimizer-state shards equal, bit for bit, its part of the
// whole tensors that one process reads from the same checkpoint. And training goes on from it
// alike on every mesh: the step after the save has the saving job's loss within 1e-5 (fp32, the
// meshes sum in other orders).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint_index.h"
#include "gpt.h"
#include "harness/files.h"
#include "harness/multiprocess.h"
#include "harness/sharding.h"
#include "harness/tp_configs.h"
#include "llama.h"
#include "tensor_parallel.h"

namespace {

using fsdp_models::GPT;
using fsdp_models::GPTConfig;
using fsdp_models::Llama;
using fsdp_models::LlamaConfig;

constexpr int kStepsBeforeSave = 3;
constexpr int64_t kBatch = 4, kSeq = 12;  // the global batch: kBatch / dp sequences per dp rank

// Heads, widths and words for tp 1, 2 and 4; 67 words and Llama's 120 hidden features over 4
// ranks keep the vocabulary uneven; Llama's two kv heads are split over 2 ranks and kept whole
// over 4.
GPTConfig gpt_config() {
  auto cfg = GPTConfig::preset("gpt2-test");
  cfg.n_head = 4, cfg.n_embd = 24, cfg.tie_embeddings = false;
  return cfg;
}
LlamaConfig llama_config() {
  return fsdp::test::tp_llama_config();
}

torch::Tensor batch_tokens(int step, int64_t vocab) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(900 + step);
  return torch::randint(vocab, {kBatch, kSeq + 1}, gen, torch::TensorOptions().dtype(torch::kLong));
}

torch::optim::AdamW adamw(std::vector<torch::Tensor> params) {
  return torch::optim::AdamW(std::move(params),
                             torch::optim::AdamWOptions(1e-2).weight_decay(0.1).eps(1e-6));
}

// This rank's part of a whole tensor, as `part` says (the whole itself for an unsplit one).
torch::Tensor local_part(const torch::Tensor& whole, const fsdp::TensorParallelLayout& layout,
                         const std::string& name) {
  const auto it = layout.parts.find(name);
  if (it == layout.parts.end())
    return whole;
  std::vector<torch::Tensor> pieces;
  for (const auto& [begin, size] : it->second.ranges)
    pieces.push_back(whole.narrow(it->second.dim, begin, size));
  return torch::cat(pieces, it->second.dim);
}

// Step `step`'s loss of this rank's sequences (fused, the vocabulary split when it is), its
// backward and the optimizer's step; returns the loss averaged over the dp group.
template <class Model>
double train_step(Model& model, torch::optim::AdamW& opt, const fsdp::DeviceMesh2D& mesh,
                  int64_t vocab, int step) {
  const auto tokens = batch_tokens(step, vocab);
  const int64_t per_rank = kBatch / mesh.dp->size();
  const auto mine = tokens.narrow(0, mesh.dp_rank() * per_rank, per_rank);
  fsdp_models::LossSpec spec;
  spec.targets = mine.narrow(1, 1, kSeq);
  spec.denominator = static_cast<double>(spec.targets.numel());
  spec.chunk = 7;
  opt.zero_grad();
  torch::Tensor loss = fsdp::forward(model, mine.narrow(1, 0, kSeq), spec);
  loss.backward();
  opt.step();
  torch::Tensor mean = loss.detach().reshape({1}).clone();
  fsdp::all_reduce(*mesh.dp, mean, fsdp::ReduceOp::kAvg)->wait();
  return mean.item<double>();
}

// Every shard of `model` (parameters and AdamW state) against this rank's part of the whole
// tensors one process reads from `dir`: bitwise. Returns how many tensors were compared.
template <class Model, class Config>
int check_against_whole(const fsdp::test::WorkerContext& ctx, Model& model,
                        torch::optim::AdamW& opt, const fsdp::TensorParallelLayout& layout,
                        const Config& cfg, const std::string& dir, bool& ok) {
  torch::manual_seed(1);
  Model whole(cfg);
  auto whole_opt = adamw(whole->parameters());
  fsdp::load_sharded(dir, *whole, &whole_opt);
  const auto whole_params = whole->named_parameters();
  const auto params = model->named_parameters();
  int compared = 0;
  auto same = [&](const torch::Tensor& held, const torch::Tensor& whole_tensor,
                  const fsdp::ParamShard& s, const std::string& what) {
    const auto want = fsdp::test::rows_held(local_part(whole_tensor, layout, s.name), s);
    const bool equal = held.sizes() == want.sizes() && torch::equal(held, want);
    if (!equal) {
      ok = false;
      std::fprintf(stderr, "rank %d: %s of %s: held %s, expected %s, not bitwise equal\n", ctx.rank,
                   what.c_str(), s.name.c_str(), c10::str(held.sizes()).c_str(),
                   c10::str(want.sizes()).c_str());
    }
    ++compared;
  };
  for (const auto& s : fsdp::param_shards(*model)) {
    same(s.shard, whole_params[s.name], s, "the parameter");
    const auto mine = opt.state().find(params[s.name].unsafeGetTensorImpl());
    const auto theirs = whole_opt.state().find(whole_params[s.name].unsafeGetTensorImpl());
    if (mine == opt.state().end() || theirs == whole_opt.state().end()) {
      ok = false;
      std::fprintf(stderr, "rank %d: %s has no AdamW state\n", ctx.rank, s.name.c_str());
      continue;
    }
    auto& a = static_cast<torch::optim::AdamWParamState&>(*mine->second);
    auto& b = static_cast<torch::optim::AdamWParamState&>(*theirs->second);
    same(a.exp_avg(), b.exp_avg(), s, "exp_avg");
    same(a.exp_avg_sq(), b.exp_avg_sq(), s, "exp_avg_sq");
    if (a.step() != kStepsBeforeSave || b.step() != kStepsBeforeSave) {
      ok = false;
      std::fprintf(stderr, "rank %d: %s: steps %lld and %lld, expected %d\n", ctx.rank,
                   s.name.c_str(), static_cast<long long>(a.step()),
                   static_cast<long long>(b.step()), kStepsBeforeSave);
    }
  }
  return compared;
}

// FSDP_MODE=save: trains kStepsBeforeSave steps on the mesh (FSDP_TP ranks per tp group),
// saves, and writes the next step's loss (next_loss.txt); FSDP_MODE=load: loads the checkpoint
// on this mesh and checks the next step's loss against it. Both compare every shard with the
// whole tensors.
template <class Model, class Config, class Split, class Shard>
int save_or_load(const fsdp::test::WorkerContext& ctx, const Config& cfg, Split split,
                 Shard shard) {
  auto pg = fsdp::init_process_group();
  const int tp = static_cast<int>(ctx.env_int("FSDP_TP", 1));
  const auto mesh = fsdp::make_device_mesh(*pg, tp);
  const std::string dir = ctx.env("FSDP_CKPT");
  const bool saving = ctx.env("FSDP_MODE") == "save";
  torch::manual_seed(saving ? 11 : 12);  // a loading job starts from other weights
  Model model(cfg);
  fsdp::TensorParallelLayout layout;
  if (tp > 1)
    layout = split(model, mesh.tp);
  if (mesh.dp->size() > 1)
    shard(model, fsdp::FullyShardOptions(mesh.dp));
  auto opt = adamw(model->parameters());
  if (saving) {
    for (int step = 0; step < kStepsBeforeSave; ++step)
      train_step(model, opt, mesh, cfg.vocab_size, step);
    fsdp::save_sharded(dir, *model, &opt, *pg, {{"step", std::to_string(kStepsBeforeSave)}},
                       layout);
  } else {
    const auto meta = fsdp::load_sharded(dir, *model, &opt, layout);
    WORKER_CHECK(meta.at("step") == std::to_string(kStepsBeforeSave));
  }
  bool ok = true;
  const int compared = check_against_whole(ctx, model, opt, layout, cfg, dir, ok);
  WORKER_CHECK(ok) << "shards differ from the whole tensors (see above)";
  const double next = train_step(model, opt, mesh, cfg.vocab_size, kStepsBeforeSave);
  const std::string loss_file = dir + "/../next_loss.txt";
  if (saving) {
    pg->barrier();
    if (ctx.rank == 0)
      std::ofstream(loss_file) << std::setprecision(12) << next << "\n";
  } else {
    double saved = 0;
    std::ifstream(loss_file) >> saved;
    WORKER_CHECK(saved != 0 && std::abs(next - saved) <= 1e-5)
        << "step " << kStepsBeforeSave + 1 << "'s loss " << next << ", the saving job's " << saved;
  }
  std::printf(
      "rank %d (dp %d of %d, tp %d of %d): TP CHECKPOINT OK: %s, %d shards bitwise equal, next "
      "loss %.9g\n",
      ctx.rank, mesh.dp_rank(), mesh.dp->size(), mesh.tp_rank(), tp, saving ? "saved" : "loaded",
      compared, next);
  return 0;
}

void shard_gpt(GPT& m, const fsdp::FullyShardOptions& o) {
  fsdp_models::parallelize_gpt(m, o);
}
void shard_llama(Llama& m, const fsdp::FullyShardOptions& o) {
  fsdp_models::parallelize_llama(m, o);
}

FSDP_WORKER(tp_ckpt_gpt) {
  return save_or_load<GPT>(ctx, gpt_config(), &fsdp_models::tensor_parallelize_gpt, &shard_gpt);
}
FSDP_WORKER(tp_ckpt_llama) {
  return save_or_load<Llama>(ctx, llama_config(), &fsdp_models::tensor_parallelize_llama,
                             &shard_llama);
}

// Saves at (2, 2), then loads at (4, 1), (1, 2), (1, 4) and (1, 1).
void save_and_load_everywhere(const char* worker) {
  const fsdp::test::TempDir root(worker);
  const std::string dir = root.path() + "/ckpt";
  struct Mesh {
    int world, tp;
    const char* mode;
  };
  for (const Mesh m : {Mesh{4, 2, "save"}, Mesh{4, 1, "load"}, Mesh{2, 2, "load"},
                       Mesh{4, 4, "load"}, Mesh{1, 1, "load"}}) {
    auto r = fsdp::test::run_workers(
        worker, m.world,
        fsdp::test::with_env(
            {{"FSDP_TP", std::to_string(m.tp)}, {"FSDP_MODE", m.mode}, {"FSDP_CKPT", dir}}));
    ASSERT_TRUE(r.ok()) << "(dp, tp) = (" << m.world / m.tp << ", " << m.tp << "), " << m.mode
                        << ":\n"
                        << r.describe();
    std::printf("%s", r.evidence().c_str());
  }
}

TEST(TensorParallelCheckpoint, GptSavedOnATwoByTwoMeshLoadsExactlyOnFourOthers) {
  save_and_load_everywhere("tp_ckpt_gpt");
}

TEST(TensorParallelCheckpoint, LlamaSavedOnATwoByTwoMeshLoadsExactlyOnFourOthers) {
  save_and_load_everywhere("tp_ckpt_llama");
}

// A checkpoint of tp 2 whose index is edited (and its checksum made right again, so that the
// edit itself is what is caught): pieces that overlap or leave a gap in the columns, a piece
// past its file tensor's rows, columns of a 1-d tensor. Each is refused naming the problem.
TEST(TensorParallelCheckpoint, AnIndexWhosePiecesDoNotTileTheWholeIsRefused) {
  const fsdp::test::TempDir root("tp-ckpt-index");
  const std::string dir = root.path() + "/ckpt";
  auto r = fsdp::test::run_workers(
      "tp_ckpt_gpt", 2,
      fsdp::test::with_env({{"FSDP_TP", "2"}, {"FSDP_MODE", "save"}, {"FSDP_CKPT", dir}}));
  ASSERT_TRUE(r.ok()) << r.describe();
  using Json = nlohmann::json;
  auto piece_of = [](Json& j, const std::string& key, const std::string& file, int64_t row) {
    for (auto& p : j["tensors"][key]["pieces"])
      if (p["file"] == file && p["rows"][0] == row)
        return &p;
    ADD_FAILURE() << key << " has no piece of " << file << " from row " << row;
    static Json none;
    return &none;
  };
  struct Edit {
    const char* what;
    std::function<void(Json&)> apply;
    const char* refusal;
  };
  const std::string proj = "model/h0.attn.c_proj.weight", attn = "model/h0.attn.c_attn.weight";
  const std::vector<Edit> edits{
      {"overlapping columns",
       [&](Json& j) {
         (*piece_of(j, proj, "rank-00001.safetensors", 0))["cols"] = {11, 24};
       },
       "its pieces overlap in columns [11, 12)"},
      {"a gap in the columns",
       [&](Json& j) {
         (*piece_of(j, proj, "rank-00000.safetensors", 0))["cols"] = {0, 11};
       },
       "do not cover columns [11, 12)"},
      {"a piece past its file's rows",
       [&](Json& j) { (*piece_of(j, attn, "rank-00000.safetensors", 48))["at"] = 30; },
       "has another dtype or shape than the index says"},
      {"columns of a 1-d tensor",
       [&](Json& j) {
         (*piece_of(j, "model/h0.attn.c_attn.bias", "rank-00000.safetensors", 0))["cols"] = {0, 2};
       },
       "columns given for a tensor of under two dimensions"},
  };
  for (const auto& edit : edits) {
    const std::string copy = root.path() + "/edited";
    std::filesystem::remove_all(copy);
    std::filesystem::copy(dir, copy);
    Json j = Json::parse(fsdp::test::file_bytes(copy + "/index.json"));
    edit.apply(j);
    j.erase(fsdp::detail::kIndexChecksumKey);
    j[fsdp::detail::kIndexChecksumKey] = fsdp::detail::index_checksum(j.dump());
    std::ofstream(copy + "/index.json", std::ios::trunc) << j.dump(1);
    GPT model(gpt_config());
    std::string message;
    try {
      fsdp::load_sharded(copy, *model);
    } catch (const fsdp::safetensors::FormatError& e) {
      message = e.what();
    }
    std::printf("%s: %s\n", edit.what, message.c_str());
    EXPECT_NE(message.find(edit.refusal), std::string::npos) << edit.what << ": " << message;
    EXPECT_NE(message.find(copy), std::string::npos) << edit.what << ": " << message;
  }
}

}  // namespace
