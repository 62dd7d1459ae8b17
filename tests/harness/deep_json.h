// Files of JSON nested 100,000 levels deep (a few hundred KB, within every size bound), for the
// tests that every reader of outside JSON refuses them by their depth (fsdp/core/json_depth.h)
// with one line naming the file: tests/test_json_depth.cpp (the library's and formats' readers)
// and tests/trainer/test_json_readers.cpp (the trainer's).
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "harness/files.h"

namespace fsdp::test {

class DeepJsonFiles : public ::testing::Test {
 protected:
  /// 100,000 nested arrays.
  static const std::string& deep_json() {
    static const std::string text = std::string(100000, '[') + std::string(100000, ']');
    return text;
  }
  /// `text` as the file `name` (parent directories made) of the test's directory; its path.
  std::string write(const std::string& name, const std::string& text) {
    const auto path = dir_.path() + "/" + name;
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }
  /// The message names `file`, says why, and is one line.
  static void expect_refused(const std::string& error, const std::string& file) {
    EXPECT_NE(error.find(file), std::string::npos) << error;
    EXPECT_NE(error.find("JSON nested deeper than 64 levels"), std::string::npos) << error;
    EXPECT_EQ(error.find('\n'), std::string::npos) << "one line: " << error;
  }
  TempDir dir_{"deep-json"};
};

}  // namespace fsdp::test
