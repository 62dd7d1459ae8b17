// Replays saved inputs through a fuzz target without libFuzzer, so that the normal build (any
// compiler, no sanitizers) runs every corpus and every input that ever crashed a target as an
// ordinary test (Fuzz.Replay.<target>, tests/CMakeLists.txt):
//
//   fuzz_replay_<target> DIR...
//
// Calls LLVMFuzzerInitialize (if the target has one), then LLVMFuzzerTestOneInput on each regular
// file of each directory, in name order. A directory that does not exist is skipped (a target
// with no crashers has no crashers/ directory), but at least one input must be found, so that a
// misplaced corpus fails instead of passing on nothing. A target's invariant failing traps (the
// test fails on the signal); the file being replayed is printed first, to name the culprit.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" __attribute__((weak)) int LLVMFuzzerInitialize(int* argc, char*** argv);

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s DIR...\n", argv[0]);
    return 2;
  }
  if (LLVMFuzzerInitialize)
    LLVMFuzzerInitialize(&argc, &argv);
  const auto start = std::chrono::steady_clock::now();
  size_t replayed = 0;
  for (int a = 1; a < argc; ++a) {
    std::error_code ec;
    if (!fs::is_directory(argv[a], ec))
      continue;
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(argv[a]))
      if (e.is_regular_file())
        files.push_back(e.path());
    std::sort(files.begin(), files.end());
    for (const auto& f : files) {
      std::ifstream in(f, std::ios::binary);
      const std::vector<char> bytes{std::istreambuf_iterator<char>(in), {}};
      if (!in.good() && !in.eof()) {
        std::fprintf(stderr, "%s: cannot read\n", f.c_str());
        return 1;
      }
      std::fprintf(stderr, "replaying %s\n", f.c_str());
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
      ++replayed;
    }
  }
  if (replayed == 0) {
    std::fprintf(stderr, "%s: no inputs found in the directories given\n", argv[0]);
    return 1;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("replayed %zu inputs in %.2f s, none failed\n", replayed, s);
  return 0;
}
