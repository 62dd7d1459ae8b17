// See finetune_data.h.
#include "finetune_data.h"

#include <torch/torch.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "config/config.h"

namespace fsdp_trainer {

InstructBatch make_instruct_batch(const std::vector<const InstructExample*>& examples,
                                  int64_t pad_id) {
  int64_t len = 1;
  for (const auto* e : examples)
    len = std::max<int64_t>(len, static_cast<int64_t>(e->ids.size()) - 1);
  const auto b = static_cast<int64_t>(examples.size());
  InstructBatch out;
  out.inputs = torch::full({b, len}, pad_id, torch::kLong);
  out.labels = torch::full({b, len}, pad_id, torch::kLong);
  out.mask = torch::zeros({b, len}, torch::kFloat32);
  auto in = out.inputs.accessor<int64_t, 2>();
  auto lab = out.labels.accessor<int64_t, 2>();
  auto m = out.mask.accessor<float, 2>();
  for (int64_t r = 0; r < b; ++r) {
    const auto& e = *examples[static_cast<size_t>(r)];
    for (size_t t = 0; t + 1 < e.ids.size(); ++t) {
      in[r][static_cast<int64_t>(t)] = e.ids[t];
      lab[r][static_cast<int64_t>(t)] = e.ids[t + 1];
      if (e.target[t + 1]) {
        m[r][static_cast<int64_t>(t)] = 1;
        ++out.targets;
      }
    }
  }
  return out;
}

InstructSampler::InstructSampler(const std::vector<InstructExample>& examples,
                                 int64_t batch_per_rank, int rank, int world_size, uint64_t seed,
                                 int64_t pad_id, const std::string& where)
    : examples_(examples),
      batch_(batch_per_rank),
      rank_(rank),
      world_(world_size),
      seed_(seed),
      pad_id_(pad_id) {
  const int64_t global = batch_ * world_;
  if (static_cast<int64_t>(examples.size()) < global) {
    throw ConfigError(where + ": " + std::to_string(examples.size()) +
                      " conversations, fewer than one global batch (training.batch_size " +
                      std::to_string(batch_) + " x " + std::to_string(world_) + " ranks)");
  }
  start_epoch(0);
}

void InstructSampler::start_epoch(int64_t epoch) {
  order_.resize(examples_.size());
  std::iota(order_.begin(), order_.end(), int64_t{0});
  std::mt19937_64 gen(seed_ * 0x9e3779b97f4a7c15ULL + static_cast<uint64_t>(epoch) * 2 + 1);
  for (size_t i = order_.size(); i > 1; --i)  // Fisher-Yates, independent of the library's
    std::swap(order_[i - 1], order_[std::uniform_int_distribution<size_t>(0, i - 1)(gen)]);
  epoch_ = epoch;
  position_ = 0;
}

int64_t InstructSampler::steps_in_epoch() const {
  return static_cast<int64_t>(examples_.size()) / (batch_ * world_);
}

InstructBatch InstructSampler::next() {
  if (position_ + batch_ * world_ > static_cast<int64_t>(order_.size()))
    start_epoch(epoch_ + 1);
  std::vector<const InstructExample*> picked;
  const int64_t first = position_ + rank_ * batch_;
  for (int64_t i = 0; i < batch_; ++i)
    picked.push_back(&examples_[static_cast<size_t>(order_[static_cast<size_t>(first + i)])]);
  position_ += batch_ * world_;
  return make_instruct_batch(picked, pad_id_);
}

void InstructSampler::load_state(const SamplerState& state) {
  TORCH_CHECK(state.epoch >= 0 && state.position >= 0 &&
                  state.position <= static_cast<int64_t>(examples_.size()),
              "InstructSampler::load_state: epoch ", state.epoch, " position ", state.position,
              " does not fit ", examples_.size(), " conversations (another data set?)");
  seed_ = state.seed;
  start_epoch(state.epoch);
  position_ = state.position;
}

std::vector<InstructBatch> instruct_eval_batches(const std::vector<InstructExample>& examples,
                                                 int64_t batch, int rank, int world_size,
                                                 int64_t pad_id) {
  std::vector<const InstructExample*> mine;
  for (size_t i = static_cast<size_t>(rank); i < examples.size();
       i += static_cast<size_t>(world_size))
    mine.push_back(&examples[i]);
  std::vector<InstructBatch> out;
  for (size_t i = 0; i < mine.size(); i += static_cast<size_t>(batch)) {
    const auto end = std::min(mine.size(), i + static_cast<size_t>(batch));
    out.push_back(make_instruct_batch({mine.begin() + static_cast<std::ptrdiff_t>(i),
                                       mine.begin() + static_cast<std::ptrdiff_t>(end)},
                                      pad_id));
  }
  // Every rank must run as many forwards as the others (each one gathers from all): ranks with
  // fewer examples run padding that counts for nothing.
  const auto per_rank =
      (examples.size() + static_cast<size_t>(world_size) - 1) / static_cast<size_t>(world_size);
  const auto batches = (per_rank + static_cast<size_t>(batch) - 1) / static_cast<size_t>(batch);
  while (out.size() < batches) {
    InstructBatch empty;
    empty.inputs = torch::full({1, 1}, pad_id, torch::kLong);
    empty.labels = empty.inputs.clone();
    empty.mask = torch::zeros({1, 1});
    out.push_back(empty);
  }
  return out;
}

FinetuneData::FinetuneData(const Config& config, const std::string& model_path, int rank,
                           int world_size) {
  const auto& f = config.finetune;
  tokenizer_ = std::make_unique<BpeTokenizer>(pretrained_tokenizer(model_path));
  try {
    auto text = [&](int64_t id) { return id >= 0 ? tokenizer_->token(id) : std::string(); };
    template_ =
        std::make_unique<ChatTemplate>(pretrained_chat_template(model_path), model_path,
                                       text(tokenizer_->bos_id()), text(tokenizer_->eos_id()));
  } catch (const ConfigError&) {
    throw;
  } catch (const std::runtime_error& e) {  // a template of no family we render
    throw ConfigError(std::string("'finetune.model': ") + e.what());
  }
  end_of_turn_ = tokenizer_->special_id(template_->end_of_turn());
  if (end_of_turn_ < 0)
    throw ConfigError("'finetune.model': " + model_path + " has no " + template_->end_of_turn() +
                      " token, which ends a turn in its " + template_->family_name() +
                      " chat template");
  train_ = load_instruct_jsonl(f.train_file, *tokenizer_, *template_, f.max_tokens);
  if (!f.eval_file.empty())
    eval_examples_ = load_instruct_jsonl(f.eval_file, *tokenizer_, *template_, f.max_tokens);
  const int64_t pad = tokenizer_->eos_id() >= 0 ? tokenizer_->eos_id() : end_of_turn_;
  sampler_ = std::make_unique<InstructSampler>(train_, config.training.batch_size, rank, world_size,
                                               static_cast<uint64_t>(config.training.seed), pad,
                                               f.train_file);
  eval_ = instruct_eval_batches(eval_examples_, config.training.batch_size, rank, world_size, pad);
}

std::vector<std::pair<std::vector<int64_t>, std::string>> FinetuneData::questions(int64_t n) const {
  std::vector<std::pair<std::vector<int64_t>, std::string>> out;
  for (const auto& e : eval_examples_) {
    if (static_cast<int64_t>(out.size()) >= n)
      break;
    // The last answer is the final run of targets (its end-of-turn token included).
    size_t end = e.target.size();
    while (end > 0 && !e.target[end - 1])
      --end;
    size_t begin = end;
    while (begin > 0 && e.target[begin - 1])
      --begin;
    std::vector<int64_t> answer(e.ids.begin() + static_cast<std::ptrdiff_t>(begin),
                                e.ids.begin() + static_cast<std::ptrdiff_t>(end));
    if (!answer.empty() && answer.back() == end_of_turn_)
      answer.pop_back();
    out.emplace_back(
        std::vector<int64_t>(e.ids.begin(), e.ids.begin() + static_cast<std::ptrdiff_t>(begin)),
        tokenizer_->decode(answer));
  }
  return out;
}

int64_t FinetuneData::longest_train_input() const {
  int64_t longest = 0;
  for (const auto& e : train_)
    longest = std::max<int64_t>(longest, static_cast<int64_t>(e.ids.size()) - 1);
  return longest;
}

int64_t FinetuneData::typical_batch_input(int64_t rows) const {
  if (train_.empty())
    return 1;
  std::mt19937_64 gen(12345);
  std::uniform_int_distribution<size_t> pick(0, train_.size() - 1);
  double sum = 0;
  constexpr int kDraws = 64;
  for (int d = 0; d < kDraws; ++d) {
    int64_t longest = 1;
    for (int64_t r = 0; r < rows; ++r)
      longest = std::max<int64_t>(longest, static_cast<int64_t>(train_[pick(gen)].ids.size()) - 1);
    sum += static_cast<double>(longest);
  }
  return std::llround(sum / kDraws);
}

}  // namespace fsdp_trainer
