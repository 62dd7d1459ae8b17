#include "train_data.h"

#include <fmt/core.h>

#include <algorithm>
#include <cstdio>

#include "data/pretrained_model.h"

namespace fsdp_trainer {

TrainData::TrainData(const Config& config, int rank, int world, torch::Device device,
                     const std::function<void()>& barrier)
    : training_(config.training), device_(device), train_file_name_(config.finetune.train_file) {
  const auto& t = config.training;
  if (config.finetuning) {
    model_file_ = resolve_model_file(config.finetune.model);
    if (rank == 0)
      std::printf("fsdp-train: fine-tuning %s ...\n", model_file_.c_str());
    std::fflush(stdout);
    finetune_ = std::make_unique<FinetuneData>(config, model_file_, rank, world);
    return;
  }
  PrepareOptions prep;
  prep.corpus = config.data.corpus;
  prep.out_dir = config.data.dir;
  prep.vocab_size = static_cast<int>(config.data.vocab_size);
  prep.held_out_fraction = config.data.held_out_fraction;
  prep.seed = static_cast<uint64_t>(t.seed);
  if (rank == 0)
    std::printf("fsdp-train: preparing data in %s ...\n", prep.out_dir.c_str());
  std::fflush(stdout);
  prepared_ = prepare_data(prep, rank, barrier);
  tokenizer_.load(prepared_.tokenizer_path);
  export_files_ = tokenizer_export_files(tokenizer_, t.seq_len);
  train_file_ = std::make_unique<TokenFile>(prepared_.train_path);
  val_file_ = std::make_unique<TokenFile>(prepared_.val_path);
  sampler_ = std::make_unique<DistributedSampler>(*train_file_, t.batch_size, t.seq_len, rank,
                                                  world, static_cast<uint64_t>(t.seed));
  eval_set_ = eval_batches(*val_file_, t.batch_size, t.seq_len, rank, world, t.eval_batches);
  for (auto& batch : eval_set_)
    batch = batch.to(device);
}

TrainData::~TrainData() = default;

Batch TrainData::next() {
  Batch b;
  if (finetune_)
    b.conversations = finetune_->sampler().next();
  else
    b.tokens = sampler_->next().to(device_);
  return b;
}

int64_t TrainData::tokens_in(const Batch& batch) const {
  return finetune_ ? batch.conversations.inputs.numel() : training_.batch_size * training_.seq_len;
}

int64_t TrainData::length_of(const Batch& batch) const {
  return finetune_ ? batch.conversations.inputs.size(1) : training_.seq_len;
}

SamplerState TrainData::state() const {
  return finetune_ ? finetune_->sampler().state() : sampler_->state();
}

void TrainData::load_state(const SamplerState& state) {
  if (finetune_)
    finetune_->sampler().load_state(state);
  else
    sampler_->load_state(state);
}

std::string TrainData::describe(const std::string& model, int world) const {
  const auto& t = training_;
  if (finetune_) {
    return fmt::format(
        "fsdp-train finetune: {} on {} rank(s) | data: {} conversations ({}), {} held-out "
        "| {} conversations per rank per step, loss on the answers only",
        model, world, finetune_->train_size(), train_file_name_, finetune_->eval_examples().size(),
        t.batch_size);
  }
  const auto& d = prepared_;
  return fmt::format(
      "fsdp-train: {} on {} rank(s) | data: {} document(s){}, {} train / {} held-out "
      "tokens ({:.1f}%), vocab {} | {} x {} tokens per rank per step",
      model, world, d.documents,
      d.files > 0 ? fmt::format(" in {} file(s)", d.files) : std::string(), d.train_tokens,
      d.val_tokens, 100.0 * d.val_tokens / std::max<int64_t>(1, d.train_tokens + d.val_tokens),
      d.vocab_size, t.batch_size, t.seq_len);
}

}  // namespace fsdp_trainer
