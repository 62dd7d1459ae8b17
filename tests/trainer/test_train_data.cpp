// The trainer's data part (trainer/train/train_data.h): what it prepares, the batches it hands
// each rank, and its position across a checkpoint.
#include <gtest/gtest.h>

#include <ATen/ops/equal.h>

#include <fstream>
#include <memory>
#include <string>

#include "corpus_samples.h"
#include "harness/files.h"
#include "train/train_data.h"

namespace {

using fsdp_trainer::TrainData;

class TrainDataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::ofstream(dir_.path() + "/corpus.txt") << fsdp::test::generated_corpus(3000);
    config_.data.corpus = dir_.path() + "/corpus.txt";
    config_.data.dir = dir_.path() + "/data";
    config_.data.vocab_size = 320;
    config_.data.held_out_fraction = 0.1;
    config_.training.batch_size = 2;
    config_.training.seq_len = 8;
    config_.training.eval_batches = 3;
    config_.training.seed = 5;
  }
  std::unique_ptr<TrainData> data(int rank, int world) {
    return std::make_unique<TrainData>(config_, rank, world, torch::kCPU, [] {});
  }

  fsdp::test::TempDir dir_{"train-data"};
  fsdp_trainer::Config config_;
};

TEST_F(TrainDataTest, PreparesTheCorpusAndHandsEachRankItsOwnWindows) {
  auto rank0 = data(0, 2);  // prepares (rank 0), then rank 1 opens what it wrote
  auto rank1 = data(1, 2);
  EXPECT_EQ(rank0->finetune(), nullptr);
  EXPECT_EQ(rank0->model_file(), "");
  EXPECT_EQ(rank0->prepared().vocab_size, 320);
  EXPECT_FALSE(rank0->prepared().reused);
  EXPECT_TRUE(rank1->prepared().reused);
  EXPECT_EQ(rank0->tokenizer().vocab_size(), 320);

  // The same stream as the sampler of the token file: (batch, seq_len + 1) windows, the ranks'
  // disjoint within a step.
  fsdp_trainer::TokenFile train(rank0->prepared().train_path);
  fsdp_trainer::DistributedSampler sampler(train, 2, 8, /*rank=*/0, /*world=*/2, /*seed=*/5);
  for (int step = 0; step < 3; ++step) {
    const auto a = rank0->next(), b = rank1->next();
    ASSERT_EQ(a.tokens.sizes(), (std::vector<int64_t>{2, 9}));
    EXPECT_TRUE(at::equal(a.tokens, sampler.next())) << "step " << step;
    EXPECT_FALSE(at::equal(a.tokens, b.tokens)) << "step " << step;
    EXPECT_EQ(rank0->tokens_in(a), 16);
    EXPECT_EQ(rank0->length_of(a), 8);
  }
  ASSERT_EQ(rank0->eval_set().size(), 3u);
  EXPECT_EQ(rank0->eval_set()[0].sizes(), (std::vector<int64_t>{2, 9}));
  EXPECT_FALSE(at::equal(rank0->eval_set()[0], rank1->eval_set()[0]));

  const std::string line = rank0->describe("a GPT", 2);
  EXPECT_NE(line.find("a GPT on 2 rank(s)"), std::string::npos) << line;
  EXPECT_NE(line.find("vocab 320 | 2 x 8 tokens per rank per step"), std::string::npos) << line;
}

TEST_F(TrainDataTest, ResumesWhereTheSavedStateWasAndRefusesAStateBeyondItsData) {
  auto first = data(0, 1);
  first->next();
  const auto saved = first->state();
  const auto expected = first->next().tokens;
  first->next();

  auto resumed = data(0, 1);  // a new process: the data is reused, the stream starts over
  resumed->load_state(saved);
  EXPECT_TRUE(at::equal(resumed->next().tokens, expected));

  auto beyond = saved;
  beyond.position = int64_t{1} << 40;
  EXPECT_THROW(resumed->load_state(beyond), std::exception);
}

}  // namespace
