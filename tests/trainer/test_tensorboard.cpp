// TensorBoard event files (logging.tensorboard): the CRC-32C against its published check
// values, and files written here read back by TensorBoard's own reader
// (tests/python/check_tensorboard.py), which checks every record's CRCs: tags, steps, wall
// times and values as written (floats to float32), a corrupted byte or a cut file refused, a
// resumed run's file hiding the steps it logs again, and errors that name the path.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "harness/command.h"
#include "harness/files.h"
#include "observe/crc32c.h"
#include "observe/metrics.h"
#include "observe/tensorboard.h"

namespace {

namespace fs = std::filesystem;
using fsdp_trainer::crc32c;
using fsdp_trainer::StepMetrics;
using fsdp_trainer::TensorBoardScalar;
using fsdp_trainer::TensorBoardWriter;
using Json = nlohmann::json;

// ---- CRC-32C -------------------------------------------------------------------------------

TEST(TensorBoardCrc32c, PublishedCheckValues) {
  // The standard check value of CRC-32C (the CRC catalogue's "check" for CRC-32/ISCSI).
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c(""), 0u);
  // RFC 3720 (iSCSI), appendix B.4: 32 bytes of zeros, of ones, ascending and descending.
  std::string zeros(32, '\0'), ones(32, '\xFF'), up(32, '\0'), down(32, '\0');
  for (int i = 0; i < 32; ++i) {
    up[i] = static_cast<char>(i);
    down[i] = static_cast<char>(31 - i);
  }
  EXPECT_EQ(crc32c(zeros), 0x8A9136AAu);
  EXPECT_EQ(crc32c(ones), 0x62A8AB43u);
  EXPECT_EQ(crc32c(up), 0x46DD794Eu);
  EXPECT_EQ(crc32c(down), 0x113FDB5Cu);
  // Continuing over pieces gives the checksum of the whole.
  EXPECT_EQ(crc32c("56789", crc32c("1234")), 0xE3069283u);
}

TEST(TensorBoardCrc32c, RecordFramingIsLengthCrcDataCrc) {
  const std::string data = "123456789";
  const std::string r = fsdp_trainer::tfrecord(data);
  ASSERT_EQ(r.size(), 8 + 4 + data.size() + 4);
  uint64_t length = 0;
  std::memcpy(&length, r.data(), 8);
  EXPECT_EQ(length, data.size());
  const auto masked = [](uint32_t c) { return ((c >> 15) | (c << 17)) + 0xa282ead8u; };
  uint32_t crc_len = 0, crc_data = 0;
  std::memcpy(&crc_len, r.data() + 8, 4);
  std::memcpy(&crc_data, r.data() + 12 + data.size(), 4);
  EXPECT_EQ(crc_len, masked(crc32c(r.substr(0, 8))));
  EXPECT_EQ(crc_data, masked(0xE3069283u));
  EXPECT_EQ(r.substr(12, data.size()), data);
}

// ---- Read back by TensorBoard --------------------------------------------------------------

fsdp::test::CommandResult check(const std::string& dir) {
  return fsdp::test::run_command(std::string(FSDP_PYTHON) + " " + FSDP_SOURCE_DIR +
                                 "/tests/python/check_tensorboard.py " + dir);
}

Json read_back(const std::string& dir) {
  const auto r = check(dir);
  EXPECT_EQ(r.code, 0) << r.output;
  if (r.code != 0)
    return Json::object();
  return Json::parse(r.output);
}

// The script writes non-finite floats as Python's repr ("nan", "inf", "-inf").
double number(const Json& v) {
  return v.is_string() ? std::stod(v.get<std::string>()) : v.get<double>();
}

// What a float32 field holds for `v`.
double f32(double v) {
  return static_cast<double>(static_cast<float>(v));
}

// Distinct values in every field, byte counts beyond float32's 24-bit mantissa among them.
StepMetrics synthetic(int64_t step) {
  StepMetrics m;
  m.step = step;
  m.loss = 10.0 / static_cast<double>(step) + 0.123456789;
  m.lr = 3e-4 * static_cast<double>(step);
  m.tokens = 2048 * step;
  m.tokens_per_second = 12345.678901 * static_cast<double>(step);
  m.mfu = 0.0123456789;
  m.step_time_s = 0.165898;
  m.time_forward_s = 0.05;
  m.time_backward_s = 0.09;
  m.time_allgather_wait_s = 0.0125;
  m.time_allgather_wait_forward_s = 0.006;
  m.time_reducescatter_wait_s = 0.0071;
  m.time_optimizer_s = 0.011;
  m.peak_bytes = (int64_t{77} << 30) + 12345;
  m.allgather_bytes = 1234567;
  m.reducescatter_bytes = 7654321;
  m.allreduce_bytes = 8;
  if (step % 2 == 0)
    m.eval_loss = 1.5 + static_cast<double>(step);
  if (step == 3) {
    m.grad_norm = 0.75;
    m.loss_scale = 65536;
    m.skipped_steps = 1;
    m.mem_params_bytes = 1, m.mem_grads_bytes = 2, m.mem_optimizer_bytes = 3;
    m.mem_gathered_bytes = 4, m.mem_activations_bytes = 5, m.mem_other_bytes = 6;
    m.grads_peak_bytes = 7, m.rss_bytes = 8, m.peak_rss_bytes = 9;
    m.peak_reserved_bytes = 12;
    m.tp_bytes = 13;
    m.offload_read_bytes = 10, m.offload_written_bytes = 11, m.time_offload_wait_s = 0.5;
  }
  return m;
}

TEST(TensorBoardScalars, EveryJsonFieldButTheStepHasOneTagInAGroup) {
  for (int64_t step : {1, 2, 3}) {
    const StepMetrics m = synthetic(step);
    const auto scalars = fsdp_trainer::tensorboard_scalars(m);
    const Json line = Json::parse(fsdp_trainer::to_json_line(m));
    EXPECT_EQ(scalars.size() + 1, line.size()) << "step " << step;
    std::set<std::string> tags;
    for (const auto& s : scalars) {
      EXPECT_TRUE(tags.insert(s.tag).second) << "duplicate tag " << s.tag;
      const std::string group = s.tag.substr(0, s.tag.find('/'));
      EXPECT_TRUE(
          (std::set<std::string>{"train", "eval", "throughput", "time", "memory", "comm", "offload"}
               .contains(group)))
          << s.tag;
    }
    EXPECT_EQ(tags.contains("eval/loss"), m.eval_loss.has_value());
    EXPECT_EQ(tags.contains("memory/rss_bytes"), m.rss_bytes.has_value());
  }
  // Step 3 sets every optional field but eval_loss: 33 values (35 fields less the step and
  // eval_loss).
  EXPECT_EQ(fsdp_trainer::tensorboard_scalars(synthetic(3)).size(), 33u);
}

TEST(TensorBoardWriter, TensorBoardReadsEveryScalarAsWritten) {
  fsdp::test::TempDir tmp("tensorboard");
  const std::string dir = (fs::path(tmp.path()) / "tensorboard").string();  // created by the writer
  std::vector<StepMetrics> steps{synthetic(1), synthetic(2), synthetic(3)};
  steps[1].loss = std::numeric_limits<double>::quiet_NaN();  // a diverged loss is kept
  std::string path;
  {
    TensorBoardWriter w(dir, 1);
    path = w.path();
    for (const auto& m : steps)
      w.write_scalars(m.step, fsdp_trainer::tensorboard_scalars(m),
                      1.7e9 + 0.25 * static_cast<double>(m.step));
  }
  char host[256] = {};
  ASSERT_EQ(::gethostname(host, sizeof(host) - 1), 0);
  const std::string name = fs::path(path).filename().string();
  EXPECT_TRUE(name.starts_with("events.out.tfevents.")) << name;
  EXPECT_TRUE(name.ends_with(std::string(".") + host + "." + std::to_string(::getpid()))) << name;
  // No temporary file left beside it.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);

  const Json out = read_back(dir);
  ASSERT_TRUE(out.contains("records")) << out.dump();
  EXPECT_EQ(out["file_version"], "brain.Event:2");
  const Json& records = out["records"];
  ASSERT_EQ(records.size(), 2 + steps.size()) << records.dump();
  EXPECT_EQ(records[0]["kind"], "file_version");
  EXPECT_EQ(records[1]["kind"], "session_start");
  EXPECT_EQ(records[1]["step"], 1);
  for (size_t i = 0; i < steps.size(); ++i) {
    const Json& r = records[2 + i];
    const auto expected = fsdp_trainer::tensorboard_scalars(steps[i]);
    EXPECT_EQ(r["kind"], "scalars");
    EXPECT_EQ(r["step"], steps[i].step);
    EXPECT_EQ(r["wall_time"].get<double>(), 1.7e9 + 0.25 * static_cast<double>(steps[i].step));
    ASSERT_EQ(r["values"].size(), expected.size()) << r.dump();
    for (const TensorBoardScalar& s : expected) {
      ASSERT_TRUE(r["values"].contains(s.tag)) << s.tag;
      const double got = number(r["values"][s.tag]);
      if (std::isnan(s.value))
        EXPECT_TRUE(std::isnan(got)) << s.tag;
      else
        EXPECT_EQ(got, f32(s.value)) << s.tag << " at step " << steps[i].step;
    }
  }
  // TensorBoard's EventAccumulator, as the UI would chart them.
  const Json& scalars = out["scalars"];
  ASSERT_TRUE(scalars.contains("train/lr"));
  ASSERT_EQ(scalars["train/lr"].size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(scalars["train/lr"][i][0], steps[i].step);
    EXPECT_EQ(number(scalars["train/lr"][i][1]), f32(steps[i].lr));
  }
  ASSERT_EQ(scalars["eval/loss"].size(), 1u);  // step 2 only
  EXPECT_EQ(scalars["eval/loss"][0][0], 2);
  EXPECT_EQ(number(scalars["eval/loss"][0][1]), f32(*steps[1].eval_loss));
  EXPECT_EQ(number(scalars["memory/peak_bytes"][2][1]),
            f32(static_cast<double>(steps[2].peak_bytes)));
  ASSERT_EQ(scalars["memory/rss_bytes"].size(), 1u);  // step 3 only
  std::printf("event file for %zu steps: %ju bytes (%zu tags)\n", steps.size(),
              static_cast<uintmax_t>(fs::file_size(path)), scalars.size());
}

// Writes a file of three steps and returns its path.
std::string three_steps(const std::string& dir) {
  TensorBoardWriter w(dir, 1);
  for (int64_t step = 1; step <= 3; ++step)
    w.write_scalars(step, fsdp_trainer::tensorboard_scalars(synthetic(step)));
  return w.path();
}

TEST(TensorBoardWriter, TheReaderRefusesACorruptedByteOrACutFile) {
  fsdp::test::TempDir tmp("tensorboard-corrupt");
  const std::string path = three_steps(tmp.path());
  const std::string good = fsdp::test::file_bytes(path);
  ASSERT_EQ(check(tmp.path()).code, 0);
  const auto with = [&](const std::string& bytes) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
    return check(tmp.path());
  };
  // One bit of a value in the last record's data (its data CRC no longer matches).
  std::string bad = good;
  bad[bad.size() - 20] ^= 0x01;
  auto r = with(bad);
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("failed event crc32 check"), std::string::npos) << r.output;
  // A length byte of the first record (its length CRC no longer matches).
  bad = good;
  bad[0] ^= 0x04;
  r = with(bad);
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("failed header crc32 check"), std::string::npos) << r.output;
  // A file cut inside its last record.
  r = with(good.substr(0, good.size() - 3));
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("truncated record"), std::string::npos) << r.output;
  EXPECT_EQ(with(good).code, 0);
}

// A resumed run writes a new file whose SessionLog START makes TensorBoard drop the steps the
// earlier file holds from that step on, so each step is charted once, from the newer run. The
// new file sorts after the ones it continues (TensorBoard reads them in name order) even when it
// starts within the same second (a fault-tolerant job's next writer, in this process here) or
// after a file named by a clock ahead of this one (another host's).
TEST(TensorBoardWriter, AResumedRunsFileReplacesTheStepsItLogsAgain) {
  namespace fs = std::filesystem;
  fsdp::test::TempDir tmp("tensorboard-resume");
  three_steps(tmp.path());
  auto continue_at = [&](int64_t first, int64_t last, double base) {
    TensorBoardWriter w(tmp.path(), first);
    for (int64_t step = first; step <= last; ++step)
      w.write_scalars(step, {{"train/loss", base + static_cast<double>(step)}});
  };
  auto names = [&] {
    std::vector<std::string> v;
    for (const auto& entry : fs::directory_iterator(tmp.path()))
      v.push_back(entry.path().filename().string());
    std::sort(v.begin(), v.end());
    return v;
  };
  continue_at(2, 4, 100.0);
  // The second file as if another host, its clock 100 s ahead, had written it.
  auto v = names();
  ASSERT_EQ(v.size(), 2u);
  const std::string second = v[1];
  const auto dot = second.find('.', std::strlen("events.out.tfevents."));
  const long long t = std::stoll(second.substr(std::strlen("events.out.tfevents."), dot));
  const std::string ahead =
      fmt::format("events.out.tfevents.{:010d}{}", t + 100, second.substr(dot));
  fs::rename(fs::path(tmp.path()) / second, fs::path(tmp.path()) / ahead);
  continue_at(3, 5, 200.0);
  v = names();
  ASSERT_EQ(v.size(), 3u);
  EXPECT_EQ(v[1], ahead);
  EXPECT_TRUE(v[2].starts_with(fmt::format("events.out.tfevents.{:010d}.", t + 101))) << v[2];
  const Json out = read_back(tmp.path());
  ASSERT_EQ(out["files"].size(), 3u);
  const Json& loss = out["scalars"]["train/loss"];
  ASSERT_EQ(loss.size(), 5u) << loss.dump();
  EXPECT_EQ(loss[0][0], 1);
  EXPECT_EQ(number(loss[0][1]), f32(synthetic(1).loss));
  EXPECT_EQ(loss[1][0], 2);
  EXPECT_EQ(number(loss[1][1]), 102.0);
  for (int64_t step = 3; step <= 5; ++step) {
    EXPECT_EQ(loss[step - 1][0], step);
    EXPECT_EQ(number(loss[step - 1][1]), 200.0 + static_cast<double>(step));
  }
}

TEST(TensorBoardWriter, ErrorsAreOneLineNamingThePath) {
  fsdp::test::TempDir tmp("tensorboard-errors");
  // The directory cannot be made: a file is in the way.
  const std::string blocker = (fs::path(tmp.path()) / "file").string();
  std::ofstream(blocker) << "x";
  try {
    TensorBoardWriter w(blocker + "/tensorboard", 1);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_TRUE(what.starts_with(blocker + "/tensorboard: cannot create directory")) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
  // Event files named by this second and the next few exist already (another writer's, say
  // with its clock ahead): never overwritten, and the new file is named after the latest of
  // them, so that TensorBoard reads it last.
  char host[256] = {};
  ASSERT_EQ(::gethostname(host, sizeof(host) - 1), 0);
  const auto now = static_cast<long long>(std::time(nullptr));
  std::set<std::string> kept;
  for (long long t = now; t < now + 5; ++t) {
    char name[400];
    std::snprintf(name, sizeof(name), "events.out.tfevents.%010lld.%s.%d", t, host,
                  static_cast<int>(::getpid()));
    std::ofstream(fs::path(tmp.path()) / name) << "keep";
    kept.insert(name);
  }
  { TensorBoardWriter w(tmp.path(), 1); }
  int created = 0;
  for (const auto& entry : fs::directory_iterator(tmp.path())) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_regular_file() || name == "file")
      continue;
    if (kept.count(name)) {
      EXPECT_EQ(fsdp::test::file_bytes(entry.path()), "keep") << name;
    } else {
      ++created;
      char expected[64];
      std::snprintf(expected, sizeof(expected), "events.out.tfevents.%010lld.", now + 5);
      EXPECT_TRUE(name.starts_with(expected)) << name << " (and no temporary left)";
    }
  }
  EXPECT_EQ(created, 1);
}

}  // namespace
