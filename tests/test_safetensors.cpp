// The safetensors reader and writer (include/fsdp/checkpoint/safetensors.h): round trips of every
// dtype the checkpoints use, rows written in pieces and out of order, reads of row ranges; and a
// corpus of hostile files (bad lengths, overlapping or out-of-range offsets, unknown dtypes,
// shape/size mismatches, holes, duplicates, huge header lengths, truncation) each refused with
// an error naming the problem, plus random byte flips of a valid header that must either
// parse or be refused, never crash.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/stat.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>

#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/core/file.h>
#include <fsdp/core/sequential_file.h>

namespace {

namespace st = fsdp::safetensors;
namespace fs = std::filesystem;

fs::path temp_dir() {
  auto dir =
      fs::temp_directory_path() / ("fsdp-safetensors-" + std::to_string(::getpid()) + "-" +
                                   ::testing::UnitTest::GetInstance()->current_test_info()->name());
  fs::create_directories(dir);
  return dir;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void spit(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A file made of a header text and `data` bytes, the length prefix computed from the text.
std::string file_of(const std::string& header, const std::string& data,
                    std::optional<uint64_t> length = std::nullopt) {
  const uint64_t len = length.value_or(header.size());
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i)
    out[i] = static_cast<char>(len >> (8 * i));
  return out + header + data;
}

std::string expect_refused(const fs::path& p) {
  try {
    st::Reader r(p.string());
  } catch (const st::FormatError& e) {
    return e.what();
  }
  ADD_FAILURE() << "accepted " << p;
  return "";
}

TEST(Safetensors, RoundTripsDtypesShapesAndPieces) {
  auto dir = temp_dir();
  torch::manual_seed(0);
  auto a = torch::randn({7, 5});
  auto b = torch::randn({3, 4}).to(torch::kBFloat16);
  auto c = torch::arange(10, torch::kLong);
  auto scalar = torch::tensor(2.5);
  auto empty = torch::empty({0, 3});
  auto half = torch::randn({2, 2, 2}).to(torch::kHalf);
  const auto path = (dir / "x.safetensors").string();
  {
    st::Writer w(path,
                 {{"a", torch::kFloat, {7, 5}},
                  {"b.weight", torch::kBFloat16, {3, 4}},
                  {"c", torch::kLong, {10}},
                  {"scalar", torch::kFloat, {}},
                  {"empty", torch::kFloat, {0, 3}},
                  {"half", torch::kHalf, {2, 2, 2}}},
                 {{"format", "pt"}, {"step", "12"}});
    // Rows in pieces and out of order, one of them from a non-contiguous view.
    w.write_rows("a", 4, a.narrow(0, 4, 3));
    w.write_rows("a", 0, a.t().contiguous().t().narrow(0, 0, 4));
    w.write("b.weight", b);
    w.write("c", c);
    w.write("scalar", scalar);
    w.write("empty", empty);
    w.write("half", half);
    w.finish();
  }
  st::Reader r(path);
  EXPECT_EQ(r.header().metadata.at("step"), "12");
  EXPECT_EQ(r.header().tensors.size(), 6u);
  EXPECT_TRUE(torch::equal(r.read("a"), a));
  EXPECT_TRUE(torch::equal(r.read("b.weight"), b));
  EXPECT_TRUE(torch::equal(r.read("c"), c));
  EXPECT_TRUE(torch::equal(r.read("scalar"), scalar));
  EXPECT_EQ(r.read("scalar").dim(), 0);
  EXPECT_EQ(r.read("empty").sizes(), empty.sizes());
  EXPECT_TRUE(torch::equal(r.read("half"), half));
  EXPECT_TRUE(torch::equal(r.read_rows("a", 2, 3), a.narrow(0, 2, 3)));
  EXPECT_EQ(r.read_rows("a", 7, 0).size(0), 0);
  EXPECT_THROW(r.read_rows("a", 5, 3), st::FormatError);
  EXPECT_THROW(r.entry("nope"), st::FormatError);
  // The data starts 8-byte aligned.
  const auto bytes = slurp(path);
  uint64_t len = 0;
  for (int i = 7; i >= 0; --i)
    len = (len << 8) | static_cast<unsigned char>(bytes[i]);
  EXPECT_EQ((8 + len) % 8, 0u);
  fs::remove_all(dir);
}

// SequentialFile (the safetensors writer's file): writes in the file's order go through its
// aligned buffer with O_DIRECT where the filesystem allows it, anything else plainly; either
// way the file holds exactly the bytes given, its size the furthest one. Pieces of odd sizes
// around the 4 KiB blocks and the buffer's edge, then a write out of order; in the temporary
// directory and on tmpfs (which refused O_DIRECT before Linux 6.6: then every write is plain).
TEST(SequentialFile, HoldsTheBytesGivenInOrderOrNot) {
  std::mt19937 rng(5);
  std::string expected;
  std::vector<std::pair<uint64_t, std::string>> pieces;
  for (uint64_t size : {8u, 1u, 4095u, 4096u, 4097u, 20000u, 8191u, 3u, 70000u, 123u}) {
    std::string bytes(size, '\0');
    for (auto& c : bytes)
      c = static_cast<char>(rng());
    pieces.emplace_back(expected.size(), bytes);
    expected += bytes;
  }
  std::vector<fs::path> dirs{temp_dir()};
  if (fs::is_directory("/dev/shm"))
    dirs.push_back(fs::path("/dev/shm"));
  for (const auto& dir : dirs) {
    for (bool in_order : {true, false}) {
      const auto path = dir / ("sequential-" + std::to_string(::getpid()) + (in_order ? "a" : "b"));
      {
        fsdp::SequentialFile f(path.string(), /*buffer_bytes=*/8192);
        const bool direct_at_start = f.direct();
        for (size_t i = 0; i < pieces.size(); ++i) {
          // Out of order: the third piece last.
          const size_t k = in_order ? i : (i < 2 ? i : (i + 1) % pieces.size() == 0 ? 2 : i + 1);
          f.pwrite(pieces[k].second.data(), pieces[k].second.size(), pieces[k].first);
        }
        if (in_order)
          EXPECT_EQ(f.direct(), direct_at_start) << path;
        else
          EXPECT_FALSE(f.direct()) << path;
        f.finish();
        std::printf("%s, %s: %s\n", dir.c_str(), in_order ? "in order" : "out of order",
                    direct_at_start ? "O_DIRECT at first" : "plain writes (no O_DIRECT here)");
      }
      EXPECT_EQ(fs::file_size(path), expected.size()) << path;
      EXPECT_TRUE(slurp(path) == expected) << path;
      fs::remove(path);
    }
  }
}

// Image (an asynchronous checkpoint's snapshot): filled in place and written from its aligned
// memory, it is the file Writer writes from the same tensors, byte for byte, and reads back.
// Odd sizes: a bf16 tensor of odd length puts the next float32 tensor's slot at an address that
// is not a multiple of 4; the data pass several 4 KiB blocks and ends inside one.
TEST(Safetensors, AnImageIsTheWritersFileByteForByte) {
  auto dir = temp_dir();
  const std::vector<st::TensorSpec> specs{{"w", torch::kFloat, {37, 29}},
                                          {"odd", torch::kBFloat16, {3, 7}},
                                          {"b", torch::kFloat, {1001}},
                                          {"step", torch::kLong, {}}};
  std::vector<torch::Tensor> values{torch::randn({37, 29}),
                                    torch::randn({3, 7}).to(torch::kBFloat16), torch::randn({1001}),
                                    torch::tensor(int64_t{12345})};
  {
    st::Writer w((dir / "writer.safetensors").string(), specs);
    for (size_t i = 0; i < specs.size(); ++i)
      w.write(specs[i].name, values[i]);
    w.finish();
  }
  st::Image image(specs);
  EXPECT_TRUE(image.holds(specs));
  auto other = specs;
  other[1].shape = {7, 3};
  EXPECT_FALSE(image.holds(other));
  other.pop_back();
  EXPECT_FALSE(image.holds(other));
  for (size_t i = 0; i < specs.size(); ++i)
    image.slot(specs[i].name).copy_(values[i]);
  EXPECT_THROW(image.slot("missing"), c10::Error);
  image.write((dir / "image.safetensors").string());
  EXPECT_EQ(image.size(), fs::file_size(dir / "writer.safetensors"));
  EXPECT_TRUE(slurp(dir / "image.safetensors") == slurp(dir / "writer.safetensors"));
  st::Reader r((dir / "image.safetensors").string());
  for (size_t i = 0; i < specs.size(); ++i)
    EXPECT_TRUE(torch::equal(r.read(specs[i].name), values[i])) << specs[i].name;
  // Written again (as the next checkpoint's snapshot is), it still holds what was put in it.
  image.slot("b").fill_(2.5);
  image.write((dir / "again.safetensors").string());
  EXPECT_TRUE(torch::equal(st::Reader((dir / "again.safetensors").string()).read("b"),
                           torch::full({1001}, 2.5)));
  fs::remove_all(dir);
}

// A file system that takes the O_DIRECT open but refuses the writes (EINVAL): CTest runs this
// test alone with tests/harness/refuse_direct_writes.cpp preloaded (FSDP_TEST_DIRECT_REFUSED
// set), and the suite's own run leaves it out. The bytes still arrive, plainly: through the
// buffer, straight from aligned memory (an Image), and once out of order.
TEST(DirectWritesRefused, SequentialFileAndImageWritePlainly) {
  if (!std::getenv("FSDP_TEST_DIRECT_REFUSED"))
    GTEST_SKIP() << "run by CTest with the refusing pwrite preloaded";
  // A directory whose file system takes the O_DIRECT open: the temporary one, else the build's.
  fs::path dir;
  for (const auto& base : {temp_dir(), fs::current_path() / "direct-writes-refused"}) {
    fs::create_directories(base);
    if (fsdp::SequentialFile(base / "probe").direct()) {
      dir = base;
      break;
    }
    fs::remove_all(base);
  }
  if (dir.empty())
    GTEST_SKIP() << "no directory here takes an O_DIRECT open";
  std::mt19937 rng(7);
  std::string expected(3 * 8192 + 123, '\0');
  for (auto& c : expected)
    c = static_cast<char>(rng());
  for (bool in_order : {true, false}) {
    const auto path = dir / (in_order ? "a" : "b");
    fsdp::SequentialFile f(path.string(), /*buffer_bytes=*/8192);
    ASSERT_TRUE(f.direct()) << "the open is not refused, only the writes";
    const size_t half = expected.size() / 2;
    if (in_order) {
      f.pwrite(expected.data(), half, 0);
      f.pwrite(expected.data() + half, expected.size() - half, half);
    } else {
      f.pwrite(expected.data() + half, expected.size() - half, half);
      f.pwrite(expected.data(), half, 0);
    }
    EXPECT_FALSE(f.direct());
    f.finish();
    EXPECT_TRUE(slurp(path) == expected) << path;
  }
  const std::vector<st::TensorSpec> specs{{"w", torch::kFloat, {300, 7}}};
  const auto w = torch::randn({300, 7});
  st::Image image(specs);
  image.slot("w").copy_(w);
  image.write((dir / "image.safetensors").string());
  EXPECT_TRUE(torch::equal(st::Reader((dir / "image.safetensors").string()).read("w"), w));
  fs::remove_all(dir);
}

TEST(Safetensors, WriterRefusesAnIncompleteFile) {
  auto dir = temp_dir();
  st::Writer w((dir / "y.safetensors").string(), {{"a", torch::kFloat, {4, 2}}});
  w.write_rows("a", 0, torch::zeros({3, 2}));
  EXPECT_THROW(w.finish(), c10::Error);
  EXPECT_THROW(w.write_rows("a", 3, torch::zeros({2, 2})), c10::Error);  // past the end
  EXPECT_THROW(w.write_rows("a", 3, torch::zeros({1, 2}, torch::kDouble)), c10::Error);
  fs::remove_all(dir);
}

TEST(Safetensors, HostileFilesAreRefusedWithTheReason) {
  auto dir = temp_dir();
  const std::string ok_header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                R"("b":{"dtype":"I8","shape":[3],"data_offsets":[8,11]}})";
  const std::string data(11, '\1');
  spit(dir / "ok", file_of(ok_header, data));
  EXPECT_NO_THROW(st::Reader((dir / "ok").string()));

  struct Case {
    const char* name;
    std::string bytes;
    const char* reason;
  };
  auto header_case = [&](const char* name, const std::string& header, const char* reason,
                         const std::string& d = std::string(11, '\1')) {
    return Case{name, file_of(header, d), reason};
  };
  std::vector<Case> cases = {
      {"short", std::string(5, '\0'), "too short"},
      {"huge length", file_of(ok_header, data, uint64_t{1} << 62), "exceeds the"},
      {"length past the end", file_of(ok_header, data, ok_header.size() + 100),
       "runs past the end"},
      header_case("not json", "{\"a\": [1, 2", "not valid JSON"),
      header_case("array", "[1, 2, 3]", "not a JSON object"),
      header_case("unknown dtype",
                  R"({"a":{"dtype":"F33","shape":[2],"data_offsets":[0,8]},)"
                  R"("b":{"dtype":"I8","shape":[3],"data_offsets":[8,11]}})",
                  "unknown dtype 'F33'"),
      header_case("negative dim", R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})",
                  "non-negative integer"),
      header_case("size mismatch",
                  R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]},)"
                  R"("b":{"dtype":"I8","shape":[3],"data_offsets":[8,11]}})",
                  "needs 12 bytes"),
      header_case("end before begin", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})",
                  "end before they begin"),
      header_case("past the data",
                  R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("b":{"dtype":"I8","shape":[4],"data_offsets":[8,12]}})",
                  "run past the end of the data"),
      header_case("overlap",
                  R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("b":{"dtype":"I8","shape":[4],"data_offsets":[7,11]}})",
                  "overlaps"),
      header_case("hole",
                  R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                  R"("b":{"dtype":"I8","shape":[3],"data_offsets":[8,11]}})",
                  "belong to no tensor"),
      header_case("trailing bytes", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                  "tensors cover 8"),
      header_case("duplicate",
                  R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("a":{"dtype":"I8","shape":[3],"data_offsets":[8,11]}})",
                  "names tensor 'a' twice"),
      header_case("metadata value",
                  R"({"__metadata__":{"k":1},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("b":{"dtype":"I8","shape":[3],"data_offsets":[8,11]}})",
                  "is not a string"),
      header_case("unknown field",
                  R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1},)"
                  R"("b":{"dtype":"I8","shape":[3],"data_offsets":[8,11]}})",
                  "unknown field 'x'"),
      header_case("offsets arity", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})",
                  "two offsets"),
      header_case("overflowing shape",
                  R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})",
                  "too large"),
      header_case("float offset", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8.5]}})",
                  "non-negative integer"),
  };
  // Truncating the valid file anywhere after the header length is refused too.
  const auto good = file_of(ok_header, data);
  for (size_t cut : {good.size() - 1, good.size() - 5, size_t{20}, size_t{9}})
    cases.push_back({"truncated", good.substr(0, cut), ""});
  for (const auto& c : cases) {
    auto p = dir / "bad";
    spit(p, c.bytes);
    const auto msg = expect_refused(p);
    EXPECT_NE(msg.find(p.string()), std::string::npos) << c.name << ": " << msg;
    EXPECT_NE(msg.find(c.reason), std::string::npos) << c.name << ": " << msg;
  }
  fs::remove_all(dir);
}

// What is not a regular file is refused at once by name, by the reader and by the one helper
// every metadata file goes through (fsdp::read_small_file): a FIFO would block the open
// forever, /dev/zero would never end, a directory reads as an error without a name.
TEST(Safetensors, OnlyRegularFilesAreRead) {
  auto dir = temp_dir();
  const auto fifo = dir / "fifo", zero = dir / "zero", sub = dir / "sub", big = dir / "big";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  fs::create_symlink("/dev/zero", zero);
  fs::create_directory(sub);
  const std::vector<std::pair<fs::path, std::string>> cases = {
      {fifo, "a FIFO"}, {zero, "a character device"}, {sub, "a directory"}};
  for (const auto& [p, kind] : cases) {
    const auto start = std::chrono::steady_clock::now();
    const auto msg = expect_refused(p);
    EXPECT_EQ(msg, p.string() + ": not a regular file (" + kind + ")");
    try {
      fsdp::read_small_file(p.string());
      ADD_FAILURE() << p << " was read";
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), p.string() + ": not a regular file (" + kind + ")");
    }
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 2.0);
  }
  // A size cap, checked before reading: a sparse file of 20 GB costs nothing to refuse.
  spit(big, "");
  fs::resize_file(big, uint64_t{20} << 30);
  try {
    fsdp::read_small_file(big.string(), 1 << 20);
    ADD_FAILURE() << "read";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()),
              big.string() + ": 21474836480 bytes, more than the 1048576 this file may have");
  }
  spit(big, "{}");
  EXPECT_EQ(fsdp::read_small_file(big.string(), 2), "{}");
  fs::remove_all(dir);
}

TEST(Safetensors, RandomHeaderCorruptionNeverCrashes) {
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
      R"("b":{"dtype":"BF16","shape":[5],"data_offsets":[24,34]}})";
  std::mt19937 gen(7);
  int refused = 0, parsed = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string h = header;
    const int flips = 1 + static_cast<int>(gen() % 3);
    for (int f = 0; f < flips; ++f)
      h[gen() % h.size()] = static_cast<char>(gen() % 256);
    try {
      auto parsed_header = st::parse_header(h, 34);
      // Whatever parses must describe tensors inside the data.
      for (const auto& t : parsed_header.tensors)
        ASSERT_LE(t.end, 34u);
      ++parsed;
    } catch (const st::FormatError&) {
      ++refused;
    }
  }
  EXPECT_GT(refused, 2000);
  std::printf("random corruptions: %d refused, %d still valid\n", refused, parsed);
}

}  // namespace
