// What `fsdp-train finetune` feeds the model: batches of tokenized conversations (see
// instruct_data.h) padded to their longest, with the mask that limits the loss to the answers.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "data.h"
#include "instruct_data.h"
#include "pretrained_model.h"
#include "text/bpe_tokenizer.h"
#include "text/chat_template.h"

namespace fsdp_trainer {

/// Conversations as model inputs. Position t of row b predicts labels[b][t]; mask[b][t] is 1
/// where that label is a target (an answer token) and 0 elsewhere, padding included.
struct InstructBatch {
  torch::Tensor inputs;  // (B, L) int64: ids[0 .. n-1), padded
  torch::Tensor labels;  // (B, L) int64: ids[1 .. n), padded
  torch::Tensor mask;    // (B, L) float32
  int64_t targets = 0;   // mask.sum()
};

/// Pads `examples` to the longest (minus one) with `pad_id`.
InstructBatch make_instruct_batch(const std::vector<const InstructExample*>& examples,
                                  int64_t pad_id);

/// The training stream of one rank, as DistributedSampler for token files: each epoch is a
/// permutation of the examples (by seed and epoch); a global batch is batch_per_rank examples
/// per rank, rank r taking the r-th slice; an epoch ends when a whole global batch no longer
/// fits, and the next one is a new permutation. Its state round-trips through checkpoints.
class InstructSampler {
 public:
  /// ConfigError (naming `where`) if there are fewer examples than one global batch.
  InstructSampler(const std::vector<InstructExample>& examples, int64_t batch_per_rank, int rank,
                  int world_size, uint64_t seed, int64_t pad_id, const std::string& where);
  InstructBatch next();
  SamplerState state() const { return {epoch_, position_, seed_}; }
  /// Throws if the position is beyond the epoch (a state saved for another data set).
  void load_state(const SamplerState& state);
  int64_t steps_in_epoch() const;

 private:
  void start_epoch(int64_t epoch);

  const std::vector<InstructExample>& examples_;
  int64_t batch_;
  int rank_, world_;
  uint64_t seed_;
  int64_t pad_id_;
  std::vector<int64_t> order_;
  int64_t epoch_ = 0, position_ = 0;
};

/// Every rank's share of the held-out examples (example i goes to rank i % world), in batches of
/// at most `batch` examples; every rank gets the same number of batches (padded with batches
/// whose mask is zero).
std::vector<InstructBatch> instruct_eval_batches(const std::vector<InstructExample>& examples,
                                                 int64_t batch, int rank, int world_size,
                                                 int64_t pad_id);

struct Config;

/// Everything `fsdp-train finetune` reads besides the weights: the model file's tokenizer and
/// chat template, the training and held-out conversations, this rank's sampler and held-out
/// batches.
class FinetuneData {
 public:
  /// ConfigError for a model file without a byte-level BPE tokenizer or a ChatML template, and
  /// for bad JSONL (file:line).
  FinetuneData(const Config& config, const std::string& model_path, int rank, int world_size);

  InstructSampler& sampler() { return *sampler_; }
  const std::vector<InstructBatch>& eval_batches() const { return eval_; }
  const std::vector<InstructExample>& eval_examples() const { return eval_examples_; }
  const BpeTokenizer& tokenizer() const { return *tokenizer_; }
  const ChatTemplate& chat_template() const { return *template_; }
  /// The first `n` held-out conversations up to (without) their last answer, i.e. the tokens
  /// ending with the assistant's opener that generation continues from, and that answer's text.
  std::vector<std::pair<std::vector<int64_t>, std::string>> questions(int64_t n) const;
  int64_t train_size() const { return static_cast<int64_t>(train_.size()); }
  /// The longest model input of a training conversation (its tokens minus one): the widest a
  /// padded training batch gets.
  int64_t longest_train_input() const;
  /// The padded length of a typical training batch of `rows` conversations: the mean, over 64
  /// batches drawn with a fixed seed, of their longest input.
  int64_t typical_batch_input(int64_t rows) const;
  int64_t end_of_turn_id() const { return end_of_turn_; }

 private:
  std::unique_ptr<BpeTokenizer> tokenizer_;
  std::unique_ptr<ChatTemplate> template_;
  std::vector<InstructExample> train_, eval_examples_;
  std::unique_ptr<InstructSampler> sampler_;
  std::vector<InstructBatch> eval_;
  int64_t end_of_turn_ = -1;  // the template's end_of_turn() (<|im_end|> for ChatML)
};

}  // namespace fsdp_trainer
