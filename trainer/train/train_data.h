// What a job trains on, as one part (torchtitan's data loader): for pretraining, the corpus
// prepared once into a tokenizer and token files (rank 0 writes, the others wait and verify),
// this rank's sampler over the training file and its held-out batches; for fine-tuning, the
// pretrained model file's tokenizer and chat template with the conversations (FinetuneData).
// Its position round-trips through checkpoints.
#pragma once

#include <torch/types.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "data/data.h"
#include "data/finetune_data.h"
#include "text/tokenizer.h"

namespace fsdp_trainer {

/// One step's input on this rank: pretraining's token windows, or fine-tuning's conversations.
struct Batch {
  torch::Tensor tokens;         // (batch_size, seq_len + 1) int64 on the job's device
  InstructBatch conversations;  // padded, on the host
};

class TrainData {
 public:
  /// Prepares (rank 0; `barrier` must block until every rank has called it) or opens the data
  /// of `config` for this `rank` of `world`. Fine-tuning reads data.finetune's model file and
  /// conversations instead. Held-out token batches go to `device` once.
  TrainData(const Config& config, int rank, int world, torch::Device device,
            const std::function<void()>& barrier);
  ~TrainData();

  /// Fine-tuning's data (nullptr when pretraining).
  FinetuneData* finetune() { return finetune_.get(); }
  const FinetuneData* finetune() const { return finetune_.get(); }
  /// Fine-tuning: the pretrained model's file; pretraining: "".
  const std::string& model_file() const { return model_file_; }

  /// The next step's batch.
  Batch next();
  /// The tokens `batch` holds on this rank (padding included), for the job's throughput.
  int64_t tokens_in(const Batch& batch) const;
  /// The sequence length the model computes on for `batch`.
  int64_t length_of(const Batch& batch) const;

  SamplerState state() const;
  /// Throws if `state` is beyond its epoch (a state saved for other data).
  void load_state(const SamplerState& state);

  /// Pretraining: this rank's held-out batches, on the device.
  const std::vector<torch::Tensor>& eval_set() const { return eval_set_; }
  /// Pretraining: what was prepared, and its tokenizer.
  const PreparedData& prepared() const { return prepared_; }
  const Tokenizer& tokenizer() const { return tokenizer_; }
  /// What a pretraining run's exports carry besides the weights (tokenizer_export_files): made
  /// when the tokenizer loads, so that one that cannot be written fails before training.
  const std::map<std::string, std::string>& export_files() const { return export_files_; }

  /// The "data:" part of the run's first line, for a `model` on `world` ranks.
  std::string describe(const std::string& model, int world) const;

 private:
  TrainingConfig training_;
  torch::Device device_ = torch::kCPU;
  std::string train_file_name_;  // finetune.train_file, for describe()
  std::string model_file_;
  PreparedData prepared_;
  Tokenizer tokenizer_;
  std::map<std::string, std::string> export_files_;
  std::unique_ptr<TokenFile> train_file_, val_file_;
  std::unique_ptr<DistributedSampler> sampler_;
  std::vector<torch::Tensor> eval_set_;
  std::unique_ptr<FinetuneData> finetune_;
};

}  // namespace fsdp_trainer
