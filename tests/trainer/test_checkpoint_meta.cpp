// The trainer's checkpoint metadata reader (trainer/train/checkpoint_meta.h): what it accepts,
// and the one-line error naming the index and the key for what it does not.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <string>

#include "train/checkpoint_meta.h"

namespace {

using fsdp_trainer::CheckpointMeta;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const fsdp::safetensors::FormatError& e) {
    return e.what();
  }
  return "";
}

TEST(CheckpointMeta, ReadsWhatTheTrainerSavedAndNamesTheKeyOfWhatItCannot) {
  const CheckpointMeta meta({{"step", "12"},
                             {"world_size", "2"},
                             {"rng.0", "ab"},
                             {"rng.1", "cd"},
                             {"neg", "-3"},
                             {"word", "12x"},
                             {"scale", "65536.5"},
                             {"zero", "0"},
                             {"inf", "inf"}},
                            "/ckpt/step-12/index.json");
  EXPECT_EQ(meta.count("step"), 12);
  EXPECT_EQ(meta.rng_state(1), "cd");
  EXPECT_EQ(meta.rng_state(2), std::nullopt);
  EXPECT_NO_THROW(meta.check_random_states(2));
  EXPECT_EQ(*meta.positive("scale"), 65536.5);
  EXPECT_EQ(*meta.non_negative("zero"), 0.0);
  EXPECT_EQ(meta.positive("absent"), std::nullopt);

  EXPECT_EQ(error_of([&] { meta.count("missing"); }),
            "/ckpt/step-12/index.json: metadata 'missing' is missing");
  EXPECT_EQ(error_of([&] { meta.count("neg"); }),
            "/ckpt/step-12/index.json: metadata 'neg' is negative (-3)");
  EXPECT_EQ(error_of([&] { meta.count("word"); }),
            "/ckpt/step-12/index.json: metadata 'word' is not an integer");
  EXPECT_EQ(error_of([&] { meta.positive("zero"); }),
            "/ckpt/step-12/index.json: metadata 'zero' is not a positive finite number");
  EXPECT_EQ(error_of([&] { meta.non_negative("inf"); }),
            "/ckpt/step-12/index.json: metadata 'inf' is not a finite number >= 0");
  // Saved by 3 ranks, but rank 2's state is absent; saved by 1, but rank 1's is there.
  EXPECT_EQ(error_of([&] { meta.check_random_states(3); }),
            "/ckpt/step-12/index.json: metadata 'rng.2' is missing (world_size is 3)");
  EXPECT_EQ(error_of([&] { meta.check_random_states(1); }),
            "/ckpt/step-12/index.json: metadata 'rng.1' names no rank of the 1 that saved it");
}

// A fault-tolerant job's checkpoint, saved while replica 1 of 3 (1 rank each) was out: the
// random states of ranks 0 and 2, and the list of the ranks that saved it.
TEST(CheckpointMeta, AFaultTolerantJobsCheckpointHasTheStatesOfItsLiveRanks) {
  auto with = [](const std::string& live, std::map<std::string, std::string> rngs) {
    rngs["live_ranks"] = live;
    return CheckpointMeta(std::move(rngs), "/ckpt/step-30/index.json");
  };
  EXPECT_NO_THROW(with("0,2", {{"rng.0", "a"}, {"rng.2", "c"}}).check_random_states(3));
  EXPECT_NO_THROW(with("1", {{"rng.1", "b"}}).check_random_states(3));
  EXPECT_EQ(error_of([&] {
              with("0,2", {{"rng.0", "a"}}).check_random_states(3);
            }),
            "/ckpt/step-30/index.json: metadata 'rng.2' is missing (world_size is 3)");
  EXPECT_EQ(error_of([&] {
              with("0,2", {{"rng.0", "a"}, {"rng.1", "b"}, {"rng.2", "c"}}).check_random_states(3);
            }),
            "/ckpt/step-30/index.json: metadata 'rng.1' names no rank of the 2 that saved it");
  for (const std::string bad : {"2,0", "0,0", "0,3", "-1", "0,,2", "0,2,", "x", "0;2"}) {
    EXPECT_EQ(error_of([&] {
                with(bad, {{"rng.0", "a"}}).check_random_states(3);
              }),
              "/ckpt/step-30/index.json: metadata 'live_ranks' is not a list of ascending ranks "
              "below world_size (3): '" +
                  bad + "'")
        << bad;
  }
  EXPECT_EQ(error_of([&] { with("", {}).check_random_states(3); }),
            "/ckpt/step-30/index.json: metadata 'live_ranks' is empty");
  // A hand-edited world_size of 10^12: refused at once, not after counting to it.
  const CheckpointMeta huge({{"rng.0", "a"}}, "/ckpt/step-30/index.json");
  EXPECT_EQ(error_of([&] { huge.check_random_states(1000000000000); }),
            "/ckpt/step-30/index.json: metadata 'rng.1' is missing (world_size is 1000000000000)");
}

}  // namespace
