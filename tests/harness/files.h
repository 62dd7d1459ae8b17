// Files for tests: a fresh temporary directory, a whole file's bytes.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace fsdp::test {

/// An empty directory under the system's temporary one, unique to this process and `name`.
inline std::filesystem::path fresh_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("fsdp-test-" + std::to_string(::getpid()) + "-" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

/// fresh_dir() removed again when the object goes.
class TempDir {
 public:
  explicit TempDir(const std::string& name = "tmp")
      : path_(fresh_dir(name + std::to_string(counter()++))) {}
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string path() const { return path_.string(); }

 private:
  static int& counter() {
    static int n = 0;
    return n;
  }
  std::filesystem::path path_;
};

/// The file's bytes ("" if it cannot be read).
inline std::string file_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

/// The lines of `text` (split at '\n'; the last one may be empty), without their '\n'.
inline std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  for (size_t a = 0;;) {
    const size_t e = text.find('\n', a);
    lines.push_back(text.substr(a, e == std::string::npos ? std::string::npos : e - a));
    if (e == std::string::npos)
      return lines;
    a = e + 1;
  }
}

/// The first `n` lines of `text`, each ending with '\n'.
inline std::string first_lines(const std::string& text, size_t n) {
  std::string out;
  size_t at = 0;
  for (size_t k = 0; k < n && at < text.size(); ++k) {
    const size_t end = text.find('\n', at);
    out += text.substr(at, end == std::string::npos ? std::string::npos : end - at) + "\n";
    at = end == std::string::npos ? text.size() : end + 1;
  }
  return out;
}

}  // namespace fsdp::test
