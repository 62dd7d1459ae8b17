// Corpora from Debian packages or files, and the whole-file read helper.
//
// The KJV comes from running Debian's `bible` program rather than parsing its data files: those
// are compressed with the program's own scheme, and the program's output is what the rest of
// the project (scripts/run.sh's data/kjv.txt) already uses, so the two stay byte-identical.

#include "corpus.h"

#include <fsdp/core/file.h>

#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <vector>

extern char** environ;

namespace fsdp_trainer {
namespace {

namespace fs = std::filesystem;

constexpr const char* kBibleDataDir = "/usr/lib";
constexpr const char* kBibleRange = "Gen1:1-Rev22:21";
constexpr const char* kFortuneDir = "/usr/share/games/fortunes";

[[noreturn]] void fail(const std::string& message) {
  throw std::runtime_error(message);
}

void check_utf8(std::string_view text, const std::string& what) {
  const size_t bad = first_invalid_utf8(text);
  if (bad == std::string_view::npos)
    return;
  char byte[8];
  std::snprintf(byte, sizeof byte, "0x%02x", static_cast<unsigned char>(text[bad]));
  fail(what + ": not UTF-8 text: invalid byte " + byte + " at offset " + std::to_string(bad));
}

// ---- KJV --------------------------------------------------------------------------------------

std::string find_in_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "";
  dirs += ":/usr/bin:/usr/games";  // where Debian installs it, even if PATH is minimal
  size_t start = 0;
  while (start <= dirs.size()) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos)
      end = dirs.size();
    if (end > start) {
      std::string candidate = dirs.substr(start, end - start) + "/" + program;
      if (::access(candidate.c_str(), X_OK) == 0)
        return candidate;
    }
    start = end + 1;
  }
  return {};
}

// Runs `argv` without a shell (stdin from /dev/null) and returns its stdout and exit status.
std::string run_capture(const std::vector<std::string>& argv, int* status,
                        const std::string& what) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0)
    fail(what + ": pipe failed: " + fsdp::errno_text(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
  std::vector<char*> args;
  for (const auto& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int err = posix_spawn(&pid, argv[0].c_str(), &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  if (err != 0) {
    ::close(fds[0]);
    fail(what + ": cannot run " + argv[0] + ": " + fsdp::errno_text(err));
  }
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t got = ::read(fds[0], buf, sizeof buf);
    if (got > 0) {
      out.append(buf, static_cast<size_t>(got));
    } else if (got == 0 || errno != EINTR) {
      break;
    }
  }
  ::close(fds[0]);
  while (::waitpid(pid, status, 0) < 0 && errno == EINTR) {
  }
  return out;
}

std::string load_kjv() {
  const std::string what = "corpus 'kjv'";
  const std::string hint = "apt-get install bible-kjv bible-kjv-text";
  const std::string bible = find_in_path("bible");
  if (bible.empty())
    fail(what + " needs Debian's bible-kjv (no `bible` program): " + hint);
  const std::string data = std::string(kBibleDataDir) + "/bible.data";
  if (::access(data.c_str(), R_OK) != 0)
    fail(what + " needs Debian's bible-kjv-text (" + data + " is missing): " + hint);
  int status = 0;
  std::string text = run_capture({bible, "-p", kBibleDataDir, kBibleRange}, &status, what);
  // The whole Bible is ~4.3 MB; anything much shorter means a broken or foreign data file.
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || text.size() < 4'000'000)
    fail(what + ": `" + bible + " -p " + kBibleDataDir + " " + kBibleRange + "` printed " +
         std::to_string(text.size()) + " bytes (exit status " + std::to_string(status) +
         "), expected ~4.3 MB; reinstall with: apt-get install --reinstall bible-kjv "
         "bible-kjv-text");
  check_utf8(text, what);
  return text;
}

// ---- Fortunes ---------------------------------------------------------------------------------

// Appends each entry of one fortune file, followed by "\n%\n". Entries lose their leading and
// trailing blank lines (leading spaces of the first line stay: ASCII art depends on them).
void append_fortunes(const std::string& file_text, std::string& out) {
  size_t pos = 0;
  std::string entry;
  auto flush = [&] {
    const size_t first = entry.find_first_not_of("\r\n");
    const size_t last = entry.find_last_not_of(" \t\r\n");
    if (first != std::string::npos && last != std::string::npos && last >= first) {
      out.append(entry, first, last - first + 1);
      out += "\n%\n";
    }
    entry.clear();
  };
  while (pos < file_text.size()) {
    size_t end = file_text.find('\n', pos);
    if (end == std::string::npos)
      end = file_text.size();
    std::string_view line(file_text.data() + pos, end - pos);
    if (!line.empty() && line.back() == '\r')
      line.remove_suffix(1);
    if (line == "%") {
      flush();
    } else {
      entry.append(line);
      entry += '\n';
    }
    pos = end + 1;
  }
  flush();
}

std::string load_fortunes() {
  const std::string what = "corpus 'fortunes'";
  const std::string needs = what + " needs Debian's fortunes: apt-get install fortunes";
  std::error_code ec;
  if (!fs::is_directory(kFortuneDir, ec))
    fail(needs + " (" + kFortuneDir + " is missing)");
  // Sorted, so the corpus (and every token file built from it) is the same on every machine.
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(kFortuneDir, ec)) {
    const std::string name = e.path().filename().string();
    // *.dat are strfile indexes, *.u8 symlinks to the same text; subdirectories hold other
    // languages or the offensive set.
    if (name.empty() || name[0] == '.' || name.ends_with(".dat") || name.ends_with(".u8"))
      continue;
    if (e.is_symlink(ec) || !e.is_regular_file(ec))
      continue;
    files.push_back(e.path());
  }
  if (ec)
    fail(what + ": cannot list " + kFortuneDir + ": " + ec.message());
  std::sort(files.begin(), files.end());
  std::string out;
  for (const auto& f : files) {
    const std::string text = read_file(f.string());
    check_utf8(text, what + ": " + f.string());
    append_fortunes(text, out);
  }
  if (out.empty())
    fail(needs + " (no fortune files in " + kFortuneDir + ")");
  return out;
}

}  // namespace

// ---- Public -----------------------------------------------------------------------------------

std::string corpus_fingerprint(const std::string& spec) {
  if (spec != "kjv")
    return {};
  const std::string bible = find_in_path("bible");
  if (bible.empty())
    return {};
  // How the text is made (load_kjv's command: a change of it makes every fingerprint new), then
  // each file's identity and times: the change time too, which no user program can set back.
  std::string print = std::string("kjv1 -p ") + kBibleDataDir + ' ' + kBibleRange + ';';
  for (const std::string& path : {bible, std::string(kBibleDataDir) + "/bible.data",
                                  std::string(kBibleDataDir) + "/bible.data.conc"}) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0)
      return {};
    print += path + ' ' + std::to_string(st.st_dev) + ' ' + std::to_string(st.st_ino) + ' ' +
             std::to_string(st.st_size) + ' ' + std::to_string(st.st_mtim.tv_sec) + '.' +
             std::to_string(st.st_mtim.tv_nsec) + ' ' + std::to_string(st.st_ctim.tv_sec) + '.' +
             std::to_string(st.st_ctim.tv_nsec) + ';';
  }
  return print;
}

size_t first_invalid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    int len;
    unsigned lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0)
        lo = 0xA0;  // overlong
      if (c == 0xED)
        hi = 0x9F;  // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0)
        lo = 0x90;  // overlong
      if (c == 0xF4)
        hi = 0x8F;  // above U+10FFFF
    } else {
      return i;
    }
    if (i + len > n || p[i + 1] < lo || p[i + 1] > hi)
      return i;
    for (int k = 2; k < len; ++k)
      if ((p[i + k] & 0xC0) != 0x80)
        return i;
    i += len;
  }
  return std::string_view::npos;
}

std::string load_corpus(const std::string& spec) {
  if (spec == "kjv")
    return load_kjv();
  if (spec == "fortunes")
    return load_fortunes();
  const std::string what = "corpus '" + spec + "'";
  const std::string kinds = " (a corpus is 'kjv', 'fortunes' or a path to a UTF-8 text file)";
  if (::access(spec.c_str(), R_OK) != 0)
    fail(what + ": cannot read: " + fsdp::errno_text(errno) + kinds);
  std::error_code ec;
  if (fs::is_directory(spec, ec))
    fail(what + ": is a directory" + kinds);
  const std::string text = read_file(spec);
  if (text.empty())
    fail(what + ": the file is empty");
  check_utf8(text, what);
  return text;
}

}  // namespace fsdp_trainer
