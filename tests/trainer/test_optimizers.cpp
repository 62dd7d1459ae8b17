// The trainer's optimizer part (trainer/train/optimizers.h): which parameters it steps and
// with what weight decay, the learning-rate schedule, and what of it a checkpoint keeps.
#include <gtest/gtest.h>

#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <map>
#include <string>

#include "train/checkpoint_meta.h"
#include "train/optimizers.h"

namespace {

using fsdp_trainer::Config;
using fsdp_trainer::learning_rate;
using fsdp_trainer::Optimizers;

TEST(Optimizers, LearningRateWarmsUpLinearlyThenDecaysAlongACosineToTheMinimum) {
  fsdp_trainer::TrainingConfig t;
  t.lr = 1.0;
  t.min_lr = 0.1;
  t.warmup_steps = 4;
  t.steps = 14;
  EXPECT_DOUBLE_EQ(learning_rate(t, 0), 0.0);
  EXPECT_DOUBLE_EQ(learning_rate(t, 1), 0.25);
  EXPECT_DOUBLE_EQ(learning_rate(t, 4), 1.0);
  // Halfway through the decay the cosine is at zero: the mean of lr and min_lr.
  EXPECT_NEAR(learning_rate(t, 9), 0.55, 1e-12);
  EXPECT_NEAR(learning_rate(t, 14), 0.1, 1e-12);
  EXPECT_NEAR(learning_rate(t, 40), 0.1, 1e-12);  // past the last step: stays at the minimum
  t.warmup_steps = 0;
  EXPECT_DOUBLE_EQ(learning_rate(t, 0), 0.0);
  EXPECT_NEAR(learning_rate(t, 1), 0.1 + 0.45 * (1 + std::cos(M_PI / 14)), 1e-12);
}

torch::nn::Sequential small_model() {
  torch::nn::Sequential m(torch::nn::Linear(4, 3),
                          torch::nn::LayerNorm(torch::nn::LayerNormOptions({3})),
                          torch::nn::Linear(3, 2));
  // A frozen matrix (as LoRA freezes the base weights): not the optimizer's.
  m[2]->named_parameters()["weight"].requires_grad_(false);
  return m;
}

TEST(Optimizers, StepsTheTrainableParametersAndDecaysMatricesOnly) {
  Config config;
  config.optimizer.name = "adamw";
  config.training.weight_decay = 0.25;
  config.training.warmup_steps = 10;
  auto model = small_model();
  Optimizers opt(config, *model, nullptr);
  // Linear(4,3) weight and bias, LayerNorm weight and bias, Linear(3,2) bias: not the frozen one.
  ASSERT_EQ(opt.params().size(), 5u);
  for (const auto& p : opt.params())
    EXPECT_TRUE(p.requires_grad());
  EXPECT_EQ(opt.scaler(), nullptr);
  const auto& groups = opt.optimizer().param_groups();
  ASSERT_EQ(groups.size(), 2u);
  ASSERT_EQ(groups[0].params().size(), 1u);  // the one trainable matrix
  EXPECT_EQ(groups[0].params()[0].dim(), 2);
  EXPECT_EQ(groups[1].params().size(), 4u);  // biases and the norm's weight
  auto decay = [&](size_t g) {
    return static_cast<const torch::optim::AdamWOptions&>(groups[g].options()).weight_decay();
  };
  EXPECT_EQ(decay(0), 0.25);
  EXPECT_EQ(decay(1), 0.0);
  EXPECT_EQ(opt.describe(), "torch::optim::AdamW");

  EXPECT_DOUBLE_EQ(opt.set_lr(5), 0.5 * config.training.lr);
  for (const auto& g : groups)
    EXPECT_DOUBLE_EQ(g.options().get_lr(), 0.5 * config.training.lr);
}

TEST(Optimizers, FusedOnesSayTheirKernelsAndMoments) {
  Config config;  // adamw_fused, fp32 moments in memory
  config.optimizer.moments_dtype = "bf16";
  auto model = small_model();
  const std::string text = Optimizers(config, *model, nullptr).describe();
  EXPECT_EQ(text.rfind("adamw_fused (", 0), 0u) << text;
  EXPECT_NE(text.find("kernels, bf16 moments)"), std::string::npos) << text;
}

TEST(Optimizers, ACheckpointKeepsThePreviousNormOnlyOnceThereIsOne) {
  Config config;
  auto model = small_model();
  Optimizers saved(config, *model, nullptr);
  std::map<std::string, std::string> meta;
  saved.save_meta(meta);
  EXPECT_TRUE(meta.empty());  // no norm yet (NaN), no loss scaler
  saved.previous_grad_norm() = 0.3125;
  saved.save_meta(meta);
  ASSERT_EQ(meta.count("clip.previous_norm"), 1u);

  Optimizers loaded(config, *model, nullptr);
  EXPECT_TRUE(std::isnan(loaded.previous_grad_norm()));
  loaded.load_meta(fsdp_trainer::CheckpointMeta(meta, "index.json"));
  EXPECT_EQ(loaded.previous_grad_norm(), 0.3125);  // 17 digits: the same double
  // A negative norm is no norm: refused, naming the key.
  meta["clip.previous_norm"] = "-1";
  try {
    loaded.load_meta(fsdp_trainer::CheckpointMeta(meta, "index.json"));
    ADD_FAILURE() << "a negative norm was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("clip.previous_norm"), std::string::npos) << e.what();
  }
}

}  // namespace
