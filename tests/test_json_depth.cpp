// JSON nesting, bounded before parsing (fsdp/core/json_depth.h): what counts as a level, and every
// reader of the library and its formats refusing a file of 100,000 nested arrays (200 KB, within
// every size bound) by its depth, naming the file, where it used to overflow the stack of the
// process that read it (SIGSEGV: nlohmann::json parses any depth, but printing, copying and
// comparing what it built recurse once per level).
#include <gtest/gtest.h>

#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <string>

#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/checkpoint/sharded_checkpoint.h>
#include <fsdp/core/json_depth.h>
#include <fsdp/distributed/flight_analysis.h>
#include <fsdp/distributed/process_group.h>
#include <fsdp/plan/machine_profile.h>

#include "harness/deep_json.h"
#include "harness/errors.h"
#include "harness/files.h"
#include "harness/multiprocess.h"
#include "hf_format.h"

namespace {

using fsdp::json_too_deep;
using fsdp::test::error_of;

std::string nested(int levels, const std::string& inside = "") {
  return std::string(static_cast<size_t>(levels), '[') + inside +
         std::string(static_cast<size_t>(levels), ']');
}

TEST(JsonDepth, CountsArraysAndObjectsOutsideStrings) {
  EXPECT_EQ(json_too_deep(nested(64)), "");
  EXPECT_EQ(json_too_deep(nested(65)), "JSON nested deeper than 64 levels (byte 64)");
  EXPECT_EQ(json_too_deep("{\"a\": {\"b\": [1, {\"c\": 2}]}}", 4), "");
  EXPECT_EQ(json_too_deep("{\"a\": {\"b\": [1, {\"c\": 2}]}}", 3),
            "JSON nested deeper than 3 levels (byte 16)");
  // Siblings do not add up: depth is the deepest path.
  EXPECT_EQ(json_too_deep("[[1], [2], [[3]]]", 3), "");
  // Brackets in strings, escaped quotes included, are text.
  EXPECT_EQ(json_too_deep("[\"[[[[{{{{\"]", 1), "");
  EXPECT_EQ(json_too_deep("[\"\\\"[[[[\", \"\\\\\"]", 1), "");
  EXPECT_NE(json_too_deep("[\"\\\\\", [[]]]", 2), "");  // the string ended at \\"
}

class JsonFiles : public fsdp::test::DeepJsonFiles {};

FSDP_WORKER(json_depth_save) {
  auto pg = fsdp::init_process_group();
  torch::nn::Linear model(2, 2);
  fsdp::save_sharded(ctx.env("DIR"), *model, nullptr, *pg);
  return 0;
}

TEST_F(JsonFiles, CheckpointIndex) {
  // A real index with a deep array added as another field: the reader gets as far as the
  // checksum, which hashes the index printed compactly (json::dump, recursing once per level).
  // Read without the bound, that killed the process with SIGSEGV.
  const auto dir = dir_.path() + "/ckpt";
  ASSERT_TRUE(
      fsdp::test::run_workers("json_depth_save", 1, fsdp::test::with_env({{"DIR", dir}})).ok());
  const auto path = dir + "/index.json";
  std::string index = fsdp::test::file_bytes(path);
  ASSERT_EQ(index.front(), '{');
  write("ckpt/index.json", "{\"junk\": " + deep_json() + ", " + index.substr(1));
  torch::nn::Linear model(2, 2);
  expect_refused(error_of([&] { fsdp::load_sharded(dir, *model); }), path);
}

TEST_F(JsonFiles, SafetensorsHeader) {
  const uint64_t length = deep_json().size();
  std::string file(reinterpret_cast<const char*>(&length), 8);  // little-endian, as the format
  const auto path = write("deep.safetensors", file + deep_json());
  expect_refused(error_of([&] { fsdp::safetensors::Reader reader(path); }), path);
}

TEST_F(JsonFiles, HuggingFaceConfigAndShardIndex) {
  const auto config = write("model/config.json", deep_json());
  expect_refused(error_of([&] { fsdp_models::read_llama_config(dir_.path() + "/model"); }), config);
  const auto index = write("sharded/model.safetensors.index.json", deep_json());
  expect_refused(error_of([&] { fsdp_models::hf_weight_files(dir_.path() + "/sharded"); }), index);
}

TEST_F(JsonFiles, MachineProfile) {
  const auto path = write("profile.json", deep_json());
  expect_refused(error_of([&] { fsdp::plan::load_machine_profile(path, "key"); }), path);
}

TEST_F(JsonFiles, FlightRecorderDump) {
  const auto path = write("flight/rank0.json", deep_json());
  expect_refused(error_of([&] { fsdp::analyze_flight_dumps(dir_.path() + "/flight"); }), path);
}

}  // namespace
