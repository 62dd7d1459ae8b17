// Token files, the prepared data directory, and the samplers (see data.h for the contracts).
//
// Everything here is deterministic: the same options give byte-identical files on any machine,
// and a sampler's stream is a pure function of (seed, epoch, token count, seq_len) and its
// position, which is what makes resumption exact and concurrent preparers harmless.

#include "data.h"

#include <fsdp/core/file.h>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <fsdp/core/json_depth.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>
#include <utility>

#include "corpus.h"
#include "corpus_source.h"
#include "text/tokenizer.h"

static_assert(std::endian::native == std::endian::little,
              "token files are little-endian and read in place");

namespace fsdp_trainer {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr int kMetaVersion = 1;
constexpr const char* kTokenizerFile = "tokenizer.model";
constexpr const char* kTrainFile = "train.bin";
constexpr const char* kValFile = "val.bin";
constexpr const char* kMetaFile = "meta.json";

// Header field offsets (data.h has the table).
constexpr size_t kOffMagic = 0, kOffVersion = 8, kOffDtype = 12, kOffCount = 16, kOffChecksum = 24,
                 kOffVocab = 32, kOffHeaderChecksum = 56;

[[noreturn]] void fail(const std::string& message) {
  throw std::runtime_error(message);
}

std::string hex64(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}

uint64_t xxh64(const void* data, size_t n) {
  return XXH64(data, n, 0);
}

template <typename T>
T load(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename T>
void store(unsigned char* p, T v) {
  std::memcpy(p, &v, sizeof v);
}

// ---- Randomness -------------------------------------------------------------------------------
// std::mt19937_64 is specified bit for bit by the standard; the distributions are not, so the
// bounded draw is ours: the stream must not change with the standard library.

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in [0, n), n > 0, by rejection (no modulo bias).
uint64_t uniform_below(std::mt19937_64& gen, uint64_t n) {
  const uint64_t threshold = (0 - n) % n;  // 2^64 mod n
  for (;;) {
    const uint64_t r = gen();
    if (r >= threshold)
      return r % n;
  }
}

// ---- meta.json helpers ------------------------------------------------------------------------

std::string join(const std::string& dir, const char* name) {
  return (fs::path(dir) / name).string();
}

json options_json(const PrepareOptions& o) {
  return {{"corpus", o.corpus},
          {"vocab_size", o.vocab_size},
          {"held_out_fraction", o.held_out_fraction},
          {"seed", o.seed}};
}

void validate(const PrepareOptions& o) {
  if (o.out_dir.empty())
    fail("PrepareOptions.out_dir is empty: give the data directory");
  if (o.corpus.empty())
    fail("PrepareOptions.corpus is empty: 'kjv', 'fortunes', a file, a directory or a glob");
  if (o.vocab_size < 260 || o.vocab_size > (1 << 24))
    fail("PrepareOptions.vocab_size = " + std::to_string(o.vocab_size) +
         ": must be in [260, 16777216] (3 special ids and 256 byte pieces come first)");
  if (!(o.held_out_fraction >= 0.0 && o.held_out_fraction <= 0.5))
    fail("PrepareOptions.held_out_fraction = " + std::to_string(o.held_out_fraction) +
         ": must be in [0, 0.5]");
}

// Reads `key` (dotted path) from meta.json, failing with the file and key named.
const json& field(const json& meta, const std::string& meta_path, const std::string& key) {
  const json* node = &meta;
  size_t start = 0;
  while (start <= key.size()) {
    size_t end = key.find('.', start);
    if (end == std::string::npos)
      end = key.size();
    const std::string part = key.substr(start, end - start);
    if (!node->is_object() || !node->contains(part))
      fail(meta_path + ": missing key '" + key + "' (delete the directory to prepare again)");
    node = &(*node)[part];
    start = end + 1;
  }
  return *node;
}

template <typename T>
T get(const json& meta, const std::string& meta_path, const std::string& key) {
  const json& v = field(meta, meta_path, key);
  try {
    return v.get<T>();
  } catch (const json::exception&) {
    fail(meta_path + ": key '" + key + "' has the wrong type: " + v.dump());
  }
}

json read_meta(const std::string& meta_path) {
  std::error_code ec;
  if (!fs::exists(meta_path, ec))
    fail(meta_path +
         ": missing: the data directory is not prepared (prepare_data writes it; in "
         "a distributed job rank 0 does, did it fail?)");
  // A few hundred bytes when fsdp-train wrote it: anything of megabytes is not its meta.json.
  const std::string text = fsdp::read_small_file(meta_path, uint64_t{16} << 20);
  if (const auto deep = fsdp::json_too_deep(text); !deep.empty())
    fail(meta_path + ": " + deep + " (delete it to prepare again)");
  json meta = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (meta.is_discarded() || !meta.is_object())
    fail(meta_path + ": not valid JSON (delete it to prepare again)");
  return meta;
}

// meta.json checksums itself: a damaged byte that still parses (a digit of tokenizer.vocab_size
// or bos_id, a letter of a name) would otherwise be believed. The hash covers the compact dump
// of every other key (sorted, so the same text after a parse).
constexpr const char* kMetaChecksumKey = "meta_xxh64";

std::string meta_checksum(json meta) {
  meta.erase(kMetaChecksumKey);
  const std::string text = meta.dump();
  return hex64(xxh64(text.data(), text.size()));
}

// Checks a token file against its meta.json entry; returns its token count.
int64_t verify_split(const json& meta, const std::string& meta_path, const std::string& dir,
                     const std::string& split) {
  const std::string path = join(dir, get<std::string>(meta, meta_path, split + ".file").c_str());
  TokenFile file(path, /*verify_checksum=*/true);
  const auto tokens = get<int64_t>(meta, meta_path, split + ".tokens");
  const auto checksum = get<std::string>(meta, meta_path, split + ".xxh64");
  if (file.size() != tokens)
    fail(path + ": holds " + std::to_string(file.size()) + " tokens, " + meta_path + " says " +
         std::to_string(tokens));
  if (hex64(file.info().checksum) != checksum)
    fail(path + ": checksum " + hex64(file.info().checksum) + " differs from " + meta_path + "'s " +
         checksum + " (files from different preparations)");
  return tokens;
}

// The whole check of a prepared directory except the corpus (see open_prepared).
PreparedData verify_prepared(const PrepareOptions& options, json* meta_out) {
  PreparedData d;
  d.dir = options.out_dir;
  d.meta_path = join(options.out_dir, kMetaFile);
  const json meta = read_meta(d.meta_path);
  const auto meta_sum = get<std::string>(meta, d.meta_path, kMetaChecksumKey);
  if (meta_checksum(meta) != meta_sum)
    fail(d.meta_path + ": checksum " + meta_checksum(meta) + " differs from its " +
         kMetaChecksumKey + " " + meta_sum + " (damaged: delete it to prepare again)");
  if (get<int>(meta, d.meta_path, "version") != kMetaVersion)
    fail(d.meta_path + ": version " + field(meta, d.meta_path, "version").dump() +
         ", this build writes " + std::to_string(kMetaVersion) + " (delete it to prepare again)");
  const json want = options_json(options);
  for (const auto& [key, value] : want.items()) {
    const json& have = field(meta, d.meta_path, "options." + key);
    if (have != value)
      fail(d.meta_path + ": options." + key + " is " + have.dump() + ", requested " + value.dump());
  }
  d.tokenizer_path = join(options.out_dir, kTokenizerFile);
  const std::string model = read_file(d.tokenizer_path);
  const auto model_sum = get<std::string>(meta, d.meta_path, "tokenizer.xxh64");
  if (hex64(xxh64(model.data(), model.size())) != model_sum)
    fail(d.tokenizer_path + ": checksum " + hex64(xxh64(model.data(), model.size())) +
         " differs from " + d.meta_path + "'s " + model_sum);
  d.vocab_size = get<int>(meta, d.meta_path, "tokenizer.vocab_size");
  d.bos_id = get<int>(meta, d.meta_path, "tokenizer.bos_id");
  d.eos_id = get<int>(meta, d.meta_path, "tokenizer.eos_id");
  d.train_path = join(options.out_dir, kTrainFile);
  d.val_path = join(options.out_dir, kValFile);
  d.train_tokens = verify_split(meta, d.meta_path, options.out_dir, "train");
  d.val_tokens = verify_split(meta, d.meta_path, options.out_dir, "val");
  // (absent from directories prepared before corpora could have several documents: then one)
  d.documents = meta.value("/corpus/documents"_json_pointer, int64_t{1});
  d.files = meta.value("/corpus/files"_json_pointer, int64_t{0});
  d.reused = true;
  if (meta_out)
    *meta_out = meta;
  return d;
}

// What preparing needs to know of a corpus before the tokenizer exists (pass 1).
struct CorpusScan {
  uint64_t checksum = 0;  // XXH64 of the documents' bytes, a 0x1E byte between documents
  int64_t bytes = 0;      // of the documents' text
  int64_t documents = 0;
  std::string fingerprint;  // corpus_fingerprint, taken before the read ("" for most corpora)
  // The tokenizer's training text: all of it (documents joined at line ends) when the files
  // hold at most kTokenizerTrainingBytes, else lines drawn with the seed at the rate that
  // leaves about that much.
  std::string sample;
};

CorpusScan scan_corpus(const CorpusSource& source, uint64_t seed) {
  CorpusScan scan;
  XXH64_state_t* state = XXH64_createState();
  XXH64_reset(state, 0);
  const double keep =
      source.bytes() <= static_cast<int64_t>(kTokenizerTrainingBytes)
          ? 1.0
          : static_cast<double>(kTokenizerTrainingBytes) / static_cast<double>(source.bytes());
  uint64_t draw = seed ^ 0xC0FFEEull;
  bool document_starts = true;
  try {
    source.read([&](std::string_view text, bool ends) {
      if (document_starts && scan.documents > 0) {
        const char separator = 0x1E;
        XXH64_update(state, &separator, 1);
        if (keep >= 1.0 && !scan.sample.empty() && scan.sample.back() != '\n')
          scan.sample += '\n';
      }
      XXH64_update(state, text.data(), text.size());
      scan.bytes += static_cast<int64_t>(text.size());
      if (keep >= 1.0) {
        scan.sample.append(text);
      } else {
        for (size_t at = 0; at < text.size();) {
          const size_t nl = text.find('\n', at);
          const size_t end = nl == std::string_view::npos ? text.size() : nl + 1;
          draw = splitmix64(draw);
          if (static_cast<double>(draw >> 11) * 0x1.0p-53 < keep) {
            scan.sample.append(text.substr(at, end - at));
            if (scan.sample.back() != '\n')
              scan.sample += '\n';
          }
          at = end;
        }
      }
      document_starts = ends;
      scan.documents += ends;
    });
  } catch (...) {
    XXH64_freeState(state);
    throw;
  }
  scan.checksum = XXH64_digest(state);
  XXH64_freeState(state);
  if (scan.bytes == 0)
    fail("corpus '" + source.spec() + "': no text in it (every document is empty)");
  return scan;
}

// Exclusive lock on the directory itself (flock works on directory descriptors), so that no lock
// file is left behind; released when the descriptor closes.
class DirLock {
 public:
  explicit DirLock(const std::string& dir)
      : dir_(dir, O_RDONLY | O_DIRECTORY, 0, "open the data directory") {
    while (::flock(dir_.fd(), LOCK_EX) != 0) {
      if (errno != EINTR)
        fail(dir + ": cannot lock the data directory: " + fsdp::errno_text(errno));
    }
  }
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

 private:
  fsdp::File dir_;  // the lock lives as long as the descriptor
};

}  // namespace

// ---- Token files ------------------------------------------------------------------------------

TokenFileWriter::TokenFileWriter(std::string path, int64_t vocab_size) : path_(std::move(path)) {
  if (vocab_size <= 0 || vocab_size > UINT32_MAX)
    fail(path_ + ": vocab_size " + std::to_string(vocab_size) + " is out of range");
  info_.bytes_per_token = vocab_size <= 65535 ? 2 : 4;
  info_.vocab_size = vocab_size;
  static std::atomic<uint64_t> counter{0};
  const fs::path target(path_);
  // Hidden, unique per process and writer; data_dir_problem() knows these names as ours.
  std::string name(".");  // (built by appends: GCC 12 misreports "." + string as an overflow)
  name += target.filename().string();
  name += ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  tmp_ = (target.parent_path() / name).string();
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd_ < 0)
    fail(path_ + ": cannot write: " + tmp_ + ": " + std::strerror(errno));
  auto* state = XXH64_createState();
  XXH64_reset(state, 0);
  hash_ = state;
  pending_.assign(kTokenFileHeaderBytes, 0);  // the header, written last
}

TokenFileWriter::~TokenFileWriter() {
  XXH64_freeState(static_cast<XXH64_state_t*>(hash_));
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void TokenFileWriter::append(std::span<const int> tokens) {
  const int64_t vocab = info_.vocab_size;
  const size_t width = static_cast<size_t>(info_.bytes_per_token);
  const size_t at = pending_.size();
  pending_.resize(at + tokens.size() * width);
  unsigned char* out = pending_.data() + at;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int t = tokens[i];
    if (t < 0 || t >= vocab)
      fail(path_ + ": token " + std::to_string(t) + " at position " +
           std::to_string(info_.tokens + static_cast<int64_t>(i)) +
           " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    if (width == 2)
      store(out + 2 * i, static_cast<uint16_t>(t));
    else
      store(out + 4 * i, static_cast<uint32_t>(t));
  }
  XXH64_update(static_cast<XXH64_state_t*>(hash_), out, tokens.size() * width);
  info_.tokens += static_cast<int64_t>(tokens.size());
  if (pending_.size() >= (size_t{1} << 20))
    flush();
}

void TokenFileWriter::flush() {
  size_t done = 0;
  while (done < pending_.size()) {
    const ssize_t n = ::write(fd_, pending_.data() + done, pending_.size() - done);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      fail(path_ + ": cannot write: " + std::strerror(n < 0 ? errno : ENOSPC));
    done += static_cast<size_t>(n);
  }
  pending_.clear();
}

TokenFileInfo TokenFileWriter::finish() {
  flush();
  info_.checksum = XXH64_digest(static_cast<XXH64_state_t*>(hash_));
  unsigned char h[kTokenFileHeaderBytes] = {};
  std::memcpy(h + kOffMagic, kTokenFileMagic, 8);
  store(h + kOffVersion, kTokenFileVersion);
  store(h + kOffDtype, static_cast<uint32_t>(info_.bytes_per_token));
  store(h + kOffCount, static_cast<uint64_t>(info_.tokens));
  store(h + kOffChecksum, info_.checksum);
  store(h + kOffVocab, static_cast<uint32_t>(info_.vocab_size));
  store(h + kOffHeaderChecksum, xxh64(h, kOffHeaderChecksum));
  if (::pwrite(fd_, h, sizeof h, 0) != static_cast<ssize_t>(sizeof h) || ::fsync(fd_) != 0)
    fail(path_ + ": cannot write: " + std::strerror(errno));
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    ::unlink(tmp_.c_str());
    fail(path_ + ": cannot write: close: " + std::strerror(errno));
  }
  try {
    fsdp::rename_durably(tmp_, path_);
  } catch (...) {
    ::unlink(tmp_.c_str());
    throw;
  }
  return info_;
}

TokenFileInfo write_token_file(const std::string& path, std::span<const int> tokens,
                               int64_t vocab_size) {
  TokenFileWriter w(path, vocab_size);
  w.append(tokens);
  return w.finish();
}

TokenFile::~TokenFile() {
  close();
}

TokenFile::TokenFile(TokenFile&& other) noexcept {
  *this = std::move(other);
}

TokenFile& TokenFile::operator=(TokenFile&& other) noexcept {
  if (this != &other) {
    close();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    tokens_ = std::exchange(other.tokens_, nullptr);
    info_ = std::exchange(other.info_, {});
  }
  return *this;
}

void TokenFile::close() {
  if (map_)
    ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
  tokens_ = nullptr;
  info_ = {};
}

void TokenFile::open(const std::string& path, bool verify_checksum) {
  close();
  path_ = path;
  const fsdp::File f(path, O_RDONLY);  // "<path>: cannot open: <reason>"
  const auto file_bytes = static_cast<int64_t>(f.size());
  if (file_bytes < kTokenFileHeaderBytes) {
    fail(path + ": truncated: " + std::to_string(file_bytes) + " bytes, less than the " +
         std::to_string(kTokenFileHeaderBytes) + "-byte header");
  }
  // The mapping keeps the file when `f` closes it.
  void* map = ::mmap(nullptr, static_cast<size_t>(file_bytes), PROT_READ, MAP_SHARED, f.fd(), 0);
  if (map == MAP_FAILED)
    fail(path + ": cannot mmap: " + fsdp::errno_text(errno));
  map_ = map;
  map_bytes_ = static_cast<size_t>(file_bytes);
  const auto* p = static_cast<const unsigned char*>(map);

  // Any failure below must unmap: close() then rethrow.
  try {
    if (std::memcmp(p + kOffMagic, kTokenFileMagic, 8) != 0) {
      std::string magic(reinterpret_cast<const char*>(p), 8);
      for (char& c : magic)
        if (c < 32 || c > 126)
          c = '?';
      fail(path + ": not a token file: magic is \"" + magic + "\", expected \"" + kTokenFileMagic +
           "\"");
    }
    const auto version = load<uint32_t>(p + kOffVersion);
    if (version != kTokenFileVersion)
      fail(path + ": format version " + std::to_string(version) + ", this build reads version " +
           std::to_string(kTokenFileVersion));
    if (load<uint64_t>(p + kOffHeaderChecksum) != xxh64(p, kOffHeaderChecksum))
      fail(path +
           ": corrupt header: its checksum does not match (delete the file and prepare "
           "again)");
    const auto dtype = load<uint32_t>(p + kOffDtype);
    if (dtype != 2 && dtype != 4)
      fail(path + ": bad dtype code " + std::to_string(dtype) +
           " (expected 2 = uint16 or 4 = uint32)");
    const auto count = load<uint64_t>(p + kOffCount);
    const int64_t payload = file_bytes - kTokenFileHeaderBytes;
    const int64_t holds = payload / dtype;
    if (count > static_cast<uint64_t>(holds))
      fail(path + ": truncated: header says " + std::to_string(count) + " tokens, file holds " +
           std::to_string(holds));
    if (static_cast<uint64_t>(payload) != count * dtype)
      fail(path + ": " + std::to_string(payload - static_cast<int64_t>(count * dtype)) +
           " bytes after the " + std::to_string(count) +
           " tokens the header announces (damaged or appended to)");
    info_.tokens = static_cast<int64_t>(count);
    info_.bytes_per_token = static_cast<int>(dtype);
    info_.vocab_size = load<uint32_t>(p + kOffVocab);
    info_.checksum = load<uint64_t>(p + kOffChecksum);
    tokens_ = p + kTokenFileHeaderBytes;
    if (verify_checksum) {
      const uint64_t actual = xxh64(tokens_, static_cast<size_t>(payload));
      if (actual != info_.checksum)
        fail(path + ": checksum mismatch: the tokens hash to " + hex64(actual) +
             ", the header says " + hex64(info_.checksum) +
             " (file corrupt: delete it and prepare again)");
    }
  } catch (...) {
    close();
    throw;
  }
}

void TokenFile::check_range(int64_t offset, int64_t len) const {
  if (!is_open())
    fail("TokenFile: used before open()");
  if (offset < 0 || len < 0 || offset > info_.tokens - len)
    fail(path_ + ": window [" + std::to_string(offset) + ", " + std::to_string(offset + len) +
         ") is outside the " + std::to_string(info_.tokens) + " tokens");
}

int64_t TokenFile::at(int64_t i) const {
  check_range(i, 1);
  return info_.bytes_per_token == 2 ? load<uint16_t>(tokens_ + 2 * i)
                                    : load<uint32_t>(tokens_ + 4 * i);
}

void TokenFile::read(int64_t offset, int64_t len, int64_t* out) const {
  check_range(offset, len);
  if (info_.bytes_per_token == 2) {
    const unsigned char* src = tokens_ + 2 * offset;
    for (int64_t i = 0; i < len; ++i)
      out[i] = load<uint16_t>(src + 2 * i);
  } else {
    const unsigned char* src = tokens_ + 4 * offset;
    for (int64_t i = 0; i < len; ++i)
      out[i] = load<uint32_t>(src + 4 * i);
  }
}

torch::Tensor TokenFile::window(int64_t offset, int64_t len) const {
  check_range(offset, len);
  auto out = torch::empty({len}, torch::kLong);
  read(offset, len, out.data_ptr<int64_t>());
  return out;
}

// ---- Preparing --------------------------------------------------------------------------------

PreparedData open_prepared(const PrepareOptions& options) {
  validate(options);
  return verify_prepared(options, nullptr);
}

std::string data_dir_problem(const std::string& dir) {
  std::error_code ec;
  const auto status = fs::symlink_status(dir, ec);
  if (ec || status.type() == fs::file_type::not_found)
    return "";  // prepare_data creates it
  if (status.type() != fs::file_type::directory)
    return "'" + dir + "' exists and is not a directory";
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    std::string name = entry.path().filename().string();
    if (name.size() > 1 && name[0] == '.')
      name.erase(0, 1);  // an interrupted atomic write's temporary (.train.bin.tmp.<pid>.<n>)
    bool ours = false;
    for (const char* prefix : {kMetaFile, kTrainFile, kValFile, "tokenizer."})
      ours |= name.rfind(prefix, 0) == 0;
    if (!ours || !entry.is_regular_file(ec)) {
      return "'" + dir + "' holds '" + entry.path().filename().string() +
             "', which fsdp-train did not write: prepared data goes only into a new or empty "
             "directory, or one it prepared before";
    }
  }
  if (ec)
    return "'" + dir + "' cannot be listed: " + ec.message();
  return "";
}

namespace {

// What an interrupted preparation left in `dir` (atomic writes' hidden temporaries, the
// whole-stream token file): ours (data_dir_problem), and no other preparer runs while the caller
// holds the directory's lock.
void remove_leftovers(const std::string& dir) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const auto name = entry.path().filename().string();
    if ((name.size() > 1 && name[0] == '.' && name.find(".tmp.") != std::string::npos) ||
        name == std::string(kTrainFile) + ".all")
      fs::remove(entry.path(), ec);
  }
}

// Pass 2 encodes block by block into one token file of the whole stream, which is then cut
// into train.bin and its last held_out_fraction, val.bin: memory stays at a few blocks and a
// copy buffer whatever the corpus's size. Documents are separated by eos, so that the model
// sees where one ends (one document, as the built-in corpora, gets none). Sets d's token
// counts; returns the two files' descriptions.
std::pair<TokenFileInfo, TokenFileInfo> write_token_files(const PrepareOptions& options,
                                                          const CorpusSource& source,
                                                          const Tokenizer& tok, PreparedData& d) {
  const std::string all_path = d.train_path + ".all";  // a name data_dir_problem() knows
  // Removed on every way out: it is the size of the token files, and a failure after it is
  // complete (no space left for train.bin) must not leave it behind.
  struct RemoveOnExit {
    const std::string& path;
    ~RemoveOnExit() { ::unlink(path.c_str()); }
  } remove_all_file{all_path};
  {
    TokenFileWriter all(all_path, d.vocab_size);
    bool document_starts = true;
    int64_t documents = 0;
    const std::vector<int> eos{d.eos_id};
    source.read([&](std::string_view text, bool ends) {
      if (document_starts && documents > 0)
        all.append(eos);
      all.append(tok.encode(text));
      document_starts = ends;
      documents += ends;
    });
    all.finish();
  }
  const TokenFile all(all_path);
  const int64_t n = all.size();
  d.val_tokens =
      static_cast<int64_t>(std::llround(static_cast<double>(n) * options.held_out_fraction));
  d.train_tokens = n - d.val_tokens;
  auto copy = [&](const std::string& path, int64_t from, int64_t count) {
    TokenFileWriter out(path, d.vocab_size);
    std::vector<int64_t> wide;
    std::vector<int> ids;
    for (int64_t at = from; at < from + count;) {
      const int64_t len = std::min<int64_t>(int64_t{1} << 20, from + count - at);
      wide.resize(static_cast<size_t>(len));
      all.read(at, len, wide.data());
      ids.assign(wide.begin(), wide.end());
      out.append(ids);
      at += len;
    }
    return out.finish();
  };
  TokenFileInfo train = copy(d.train_path, 0, d.train_tokens);
  TokenFileInfo val = copy(d.val_path, d.train_tokens, d.val_tokens);
  return {train, val};
}

// meta.json's content (without its checksum) for what was just prepared.
json prepared_meta(const PrepareOptions& options, const CorpusScan& scan, const PreparedData& d,
                   const Tokenizer& tok, const std::string& model, const TokenFileInfo& train,
                   const TokenFileInfo& val) {
  auto split_json = [](const TokenFileInfo& info, const char* file) {
    return json{{"file", file},
                {"tokens", info.tokens},
                {"dtype", info.bytes_per_token == 2 ? "uint16" : "uint32"},
                {"bytes", kTokenFileHeaderBytes + info.tokens * info.bytes_per_token},
                {"xxh64", hex64(info.checksum)}};
  };
  return {
      {"format", "fsdp-cpp token data"},
      {"version", kMetaVersion},
      {"options", options_json(options)},
      {"corpus",
       {{"bytes", scan.bytes},
        {"xxh64", hex64(scan.checksum)},
        {"documents", scan.documents},
        {"files", d.files},
        {"fingerprint", scan.fingerprint}}},
      {"tokenizer",
       {{"file", kTokenizerFile},
        {"type", "sentencepiece-bpe-byte-fallback"},
        {"vocab_size", d.vocab_size},
        {"unk_id", tok.unk_id()},
        {"bos_id", d.bos_id},
        {"eos_id", d.eos_id},
        {"bytes", model.size()},
        {"xxh64", hex64(xxh64(model.data(), model.size()))}}},
      {"train", split_json(train, kTrainFile)},
      {"val", split_json(val, kValFile)},
  };
}

// Prepares `options.out_dir` from a corpus readable here (scanned: `scan`): the tokenizer, the
// token files, and meta.json last.
PreparedData prepare_anew(const PrepareOptions& options, const CorpusSource& source,
                          const CorpusScan& scan) {
  const std::string meta_path = join(options.out_dir, kMetaFile);
  // meta.json goes first and comes back last: until then the directory is visibly incomplete.
  if (::unlink(meta_path.c_str()) != 0 && errno != ENOENT)
    fail(meta_path + ": cannot remove the stale file: " + std::strerror(errno));

  PreparedData d;
  d.dir = options.out_dir;
  d.meta_path = meta_path;
  d.tokenizer_path = join(options.out_dir, kTokenizerFile);
  d.train_path = join(options.out_dir, kTrainFile);
  d.val_path = join(options.out_dir, kValFile);
  d.documents = scan.documents;
  d.files = static_cast<int64_t>(source.files().size());

  const std::string prefix = (fs::path(options.out_dir) / "tokenizer").string();
  Tokenizer tok = train_tokenizer(scan.sample, options.vocab_size, prefix, options.seed);
  const std::string model = read_file(d.tokenizer_path);
  d.vocab_size = tok.vocab_size();
  d.bos_id = tok.bos_id();
  d.eos_id = tok.eos_id();
  const auto [train, val] = write_token_files(options, source, tok, d);
  json meta = prepared_meta(options, scan, d, tok, model, train, val);
  meta[kMetaChecksumKey] = meta_checksum(meta);
  write_file_atomic(meta_path, meta.dump(2) + "\n");
  d.reused = false;
  return d;
}

}  // namespace

PreparedData prepare_data(const PrepareOptions& options) {
  validate(options);
  if (const std::string problem = data_dir_problem(options.out_dir); !problem.empty())
    fail("data.dir " + problem);
  std::error_code ec;
  fs::create_directories(options.out_dir, ec);
  if (ec)
    fail(options.out_dir + ": cannot create the data directory: " + ec.message());
  DirLock lock(options.out_dir);
  remove_leftovers(options.out_dir);

  // The directory as it stands, checked against its own files (nothing, if missing, stale or
  // damaged: then it is prepared anew below).
  std::optional<std::pair<PreparedData, json>> prepared;
  try {
    json meta;
    PreparedData d = verify_prepared(options, &meta);
    prepared.emplace(std::move(d), std::move(meta));
  } catch (const std::exception&) {
  }
  // A field of meta.json, or `fallback` where absent or of another type (then nothing matches).
  const auto field_or = [&](const char* pointer, auto fallback) {
    try {
      return prepared->second.value(json::json_pointer(pointer), fallback);
    } catch (const std::exception&) {
      return fallback;
    }
  };
  // A built-in corpus printed by a program (the KJV) is known by its files' fingerprint: the same
  // as when the directory was prepared, the directory is reused without printing it again.
  const std::string fingerprint = corpus_fingerprint(options.corpus);
  if (prepared && !fingerprint.empty() &&
      field_or("/corpus/fingerprint", std::string()) == fingerprint)
    return prepared->first;
  // Pass 1 reads the corpus once for its checksum (reuse needs the same bytes: a file may have
  // changed under the same path), its document count and the tokenizer's training sample.
  // A directory prepared elsewhere and copied here (a GPU machine without Debian's bible-kjv,
  // say) is used as it is when its corpus cannot be read on this machine: it still passes every
  // check of its own files; only the comparison with the corpus's bytes is impossible.
  std::optional<CorpusSource> readable;
  try {
    readable.emplace(options.corpus);
  } catch (const std::exception& unreadable) {
    if (!prepared)
      throw;  // nothing prepared either: the corpus's own error
    std::printf(
        "fsdp-train: %s: using the prepared data as it is (its corpus cannot be read "
        "here: %s)\n",
        options.out_dir.c_str(), unreadable.what());
    return prepared->first;
  }
  const CorpusSource& source = *readable;
  CorpusScan scan = scan_corpus(source, options.seed);
  scan.fingerprint = fingerprint;
  if (prepared) {
    auto& [d, meta] = *prepared;
    if (field_or("/corpus/xxh64", std::string()) == hex64(scan.checksum) &&
        field_or("/corpus/bytes", int64_t{-1}) == scan.bytes) {
      if (field_or("/corpus/fingerprint", std::string()) != fingerprint) {
        // The same bytes from files that changed (a reinstalled package) or a directory from
        // before fingerprints: recorded, so that the next start skips the read. Best effort:
        // a directory this user cannot write (or a full disk) is still used as it is.
        meta["corpus"]["fingerprint"] = fingerprint;
        meta[kMetaChecksumKey] = meta_checksum(meta);
        try {
          write_file_atomic(join(options.out_dir, kMetaFile), meta.dump(2) + "\n");
        } catch (const std::exception& e) {
          std::printf("fsdp-train: %s: the corpus's fingerprint not recorded (%s)\n",
                      options.out_dir.c_str(), e.what());
        }
      }
      return d;
    }
  }
  return prepare_anew(options, source, scan);
}

PreparedData prepare_data(const PrepareOptions& options, int rank,
                          const std::function<void()>& barrier) {
  if (rank != 0) {
    barrier();
    try {
      return open_prepared(options);
    } catch (const std::exception& e) {
      fail("[rank " + std::to_string(rank) + "] " + e.what());
    }
  }
  PreparedData d;
  try {
    d = prepare_data(options);
  } catch (...) {
    barrier();  // release the other ranks: they fail on the missing meta.json
    throw;
  }
  barrier();
  return d;
}

// ---- Sampling ---------------------------------------------------------------------------------

DistributedSampler::DistributedSampler(const TokenFile& data, int64_t batch_per_rank,
                                       int64_t seq_len, int rank, int world_size, uint64_t seed)
    : data_(data),
      batch_(batch_per_rank),
      seq_len_(seq_len),
      rank_(rank),
      world_(world_size),
      seed_(seed) {
  if (!data.is_open())
    fail("DistributedSampler: the TokenFile is not open");
  if (batch_per_rank < 1)
    fail("DistributedSampler: batch_per_rank must be >= 1");
  if (seq_len < 1)
    fail("DistributedSampler: seq_len must be >= 1");
  if (world_size < 1 || rank < 0 || rank >= world_size)
    fail("DistributedSampler: rank " + std::to_string(rank) + " is outside world_size " +
         std::to_string(world_size));
  // The fewest windows any epoch has: the phase can be as large as seq_len.
  const int64_t w = seq_len + 1;
  const int64_t fewest = data.size() >= seq_len ? (data.size() - seq_len) / w : 0;
  if (fewest < global_batch())
    fail(data.path() + ": " + std::to_string(data.size()) + " tokens make " +
         std::to_string(fewest) + " windows of " + std::to_string(w) +
         " tokens, fewer than one global batch of " + std::to_string(global_batch()) +
         " (world_size " + std::to_string(world_size) + " x batch " +
         std::to_string(batch_per_rank) + "): use a smaller batch or seq_len, or more data");
  start_epoch(0);
}

void DistributedSampler::start_epoch(int64_t epoch) {
  const int64_t w = seq_len_ + 1;
  std::mt19937_64 gen(splitmix64(seed_) ^ splitmix64(static_cast<uint64_t>(epoch) * 2 + 1));
  phase_ = static_cast<int64_t>(uniform_below(gen, static_cast<uint64_t>(w)));
  order_.resize(static_cast<size_t>((data_.size() - phase_) / w));
  std::iota(order_.begin(), order_.end(), int64_t{0});
  for (size_t i = order_.size(); i > 1; --i)  // Fisher-Yates
    std::swap(order_[i - 1], order_[uniform_below(gen, i)]);
  epoch_ = epoch;
  position_ = 0;
}

void DistributedSampler::roll_over_if_done() {
  if (position_ + global_batch() > windows_in_epoch())
    start_epoch(epoch_ + 1);
}

std::vector<int64_t> DistributedSampler::peek_offsets() {
  roll_over_if_done();
  std::vector<int64_t> offsets(static_cast<size_t>(batch_));
  const int64_t first = position_ + rank_ * batch_;
  for (int64_t b = 0; b < batch_; ++b)
    offsets[b] = phase_ + order_[static_cast<size_t>(first + b)] * (seq_len_ + 1);
  return offsets;
}

torch::Tensor DistributedSampler::next() {
  const std::vector<int64_t> offsets = peek_offsets();
  const int64_t w = seq_len_ + 1;
  auto out = torch::empty({batch_, w}, torch::kLong);  // (B, T+1)
  int64_t* dst = out.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch_; ++b)
    data_.read(offsets[b], w, dst + b * w);
  position_ += global_batch();
  return out;
}

void DistributedSampler::load_state(const SamplerState& state) {
  if (state.epoch < 0 || state.position < 0)
    fail("DistributedSampler::load_state: epoch " + std::to_string(state.epoch) + " and position " +
         std::to_string(state.position) + " must be >= 0");
  seed_ = state.seed;
  start_epoch(state.epoch);
  if (state.position > windows_in_epoch())
    fail("DistributedSampler::load_state: position " + std::to_string(state.position) +
         " is beyond the " + std::to_string(windows_in_epoch()) + " windows of epoch " +
         std::to_string(state.epoch) + " in " + data_.path() +
         " (a state saved for another data file or seq_len?)");
  position_ = state.position;
}

std::vector<torch::Tensor> eval_batches(const TokenFile& data, int64_t batch, int64_t seq_len,
                                        int rank, int world_size, int64_t max_batches) {
  if (!data.is_open())
    fail("eval_batches: the TokenFile is not open");
  if (batch < 1 || seq_len < 1)
    fail("eval_batches: batch and seq_len must be >= 1");
  if (world_size < 1 || rank < 0 || rank >= world_size)
    fail("eval_batches: rank " + std::to_string(rank) + " is outside world_size " +
         std::to_string(world_size));
  const int64_t w = seq_len + 1;
  const int64_t windows = data.size() / w;
  int64_t per_rank = batch, batches = windows / (batch * world_size);
  if (batches == 0) {  // too little held-out data for one full batch: one smaller batch
    per_rank = windows / world_size;
    batches = 1;
    if (per_rank == 0)
      fail(data.path() + ": " + std::to_string(data.size()) + " tokens make " +
           std::to_string(windows) + " windows of " + std::to_string(w) +
           " tokens, fewer than one per rank (world_size " + std::to_string(world_size) +
           "): use a smaller seq_len or a larger held_out_fraction");
  }
  if (max_batches > 0)
    batches = std::min(batches, max_batches);
  std::vector<torch::Tensor> out;
  out.reserve(static_cast<size_t>(batches));
  for (int64_t i = 0; i < batches; ++i) {
    auto t = torch::empty({per_rank, w}, torch::kLong);  // (B, T+1)
    int64_t* dst = t.data_ptr<int64_t>();
    const int64_t first = (i * world_size + rank) * per_rank;
    for (int64_t b = 0; b < per_rank; ++b)
      data.read((first + b) * w, w, dst + b * w);
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace fsdp_trainer
