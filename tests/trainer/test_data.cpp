// fsdp-train's data pipeline: corpora, tokenizer, token files, prepare_data, samplers.
//
// Small generated corpora keep the tokenizer tests to well under a second; one test prepares the
// real KJV end to end (~5 s). Sampler tests use a token file whose token i is i, so every window
// names its own offset and disjointness is checked on positions, not on (repetitive) text.

#include <gtest/gtest.h>

#include <barrier>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <xxhash.h>
#include <nlohmann/json.hpp>

#include "corpus_samples.h"
#include "data/corpus.h"
#include "data/corpus_source.h"
#include "data/data.h"
#include "harness/errors.h"
#include "text/tokenizer.h"

namespace fs = std::filesystem;
using namespace fsdp_trainer;
using fsdp::test::error_of;
using fsdp::test::generated_corpus;

namespace {

// ---- Helpers ----------------------------------------------------------------------------------

// A fresh directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    std::string templ = (fs::temp_directory_path() / "fsdp_test_data.XXXXXX").string();
    if (!::mkdtemp(templ.data()))
      throw std::runtime_error("mkdtemp failed");
    path_ = templ;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

#define EXPECT_CONTAINS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "in: " << (haystack)

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

std::vector<std::string> dir_listing(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

bool have_bible() {
  return fs::exists("/usr/lib/bible.data") &&
         (fs::exists("/usr/bin/bible") || fs::exists("/usr/games/bible"));
}

// A token file whose token i is i (uint32: the vocabulary is larger than any position).
std::string write_positions(const TempDir& dir, int64_t n) {
  std::vector<int> tokens(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    tokens[i] = static_cast<int>(i);
  const std::string path = dir / "positions.bin";
  write_token_file(path, tokens, n + 1);
  return path;
}

// ---- Corpus -----------------------------------------------------------------------------------

TEST(Corpus, KjvIsTheWholeBible) {
  if (!have_bible())
    GTEST_FAIL() << "bible-kjv is not installed (scripts/setup.sh installs it)";
  const auto t0 = std::chrono::steady_clock::now();
  const std::string text = load_corpus("kjv");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("KJV: %zu bytes in %.2f s\n", text.size(), s);
  EXPECT_GT(text.size(), 4'200'000u);
  EXPECT_LT(text.size(), 4'500'000u);
  EXPECT_EQ(text.rfind("Genesis 1", 16), 1u);  // the output opens "\nGenesis 1"
  EXPECT_CONTAINS(text, "1 In the beginning God created the heaven and the earth.");
  EXPECT_CONTAINS(text, "Revelation 22");
  EXPECT_CONTAINS(text.substr(text.size() - 200), "Amen.");
  EXPECT_EQ(load_corpus("kjv"), text);  // deterministic
}

TEST(Corpus, FortunesAreEntriesSeparatedByPercentLines) {
  if (!fs::exists("/usr/share/games/fortunes/fortunes"))
    GTEST_FAIL() << "fortunes is not installed (scripts/setup.sh installs it)";
  const std::string text = load_corpus("fortunes");
  std::printf("fortunes: %zu bytes\n", text.size());
  EXPECT_GT(text.size(), 1'000'000u);
  EXPECT_CONTAINS(text, "\n%\n");
  EXPECT_EQ(text.substr(text.size() - 3), "\n%\n");
  EXPECT_EQ(text.find("\n%\n%\n"), std::string::npos);  // empty entries are dropped
  EXPECT_EQ(text.find('\r'), std::string::npos);
}

TEST(Corpus, TextFileIsReturnedVerbatim) {
  TempDir dir;
  const std::string text = "  indented line\n\ttab, ünïcödé, 日本語\r\nlast line without newline";
  write_text(dir / "a.txt", text);
  EXPECT_EQ(load_corpus(dir / "a.txt"), text);
}

TEST(Corpus, ErrorsNameTheCorpus) {
  TempDir dir;
  const std::string missing = dir / "no_such_file.txt";
  std::string msg = error_of([&] { load_corpus(missing); });
  EXPECT_CONTAINS(msg, "corpus '" + missing + "'");
  EXPECT_CONTAINS(msg, "No such file or directory");
  EXPECT_CONTAINS(msg, "'kjv', 'fortunes' or a path");

  write_text(dir / "latin1.txt", std::string("caf\xe9 au lait\n"));
  msg = error_of([&] { load_corpus(dir / "latin1.txt"); });
  EXPECT_CONTAINS(msg, dir / "latin1.txt");
  EXPECT_CONTAINS(msg, "not UTF-8 text: invalid byte 0xe9 at offset 3");

  write_text(dir / "empty.txt", "");
  EXPECT_CONTAINS(error_of([&] { load_corpus(dir / "empty.txt"); }), "the file is empty");
  EXPECT_CONTAINS(error_of([&] { load_corpus(dir.path().string()); }), "is a directory");
}

// ---- CorpusSource: files, directories, globs, JSONL
// ----------------------------------------------

// Everything CorpusSource hands on, as (document, blocks) pairs.
std::vector<std::pair<std::string, int>> documents_of(const CorpusSource& source) {
  std::vector<std::pair<std::string, int>> docs;
  bool starts = true;
  source.read([&](std::string_view text, bool ends) {
    if (starts)
      docs.emplace_back("", 0);
    docs.back().first.append(text);
    docs.back().second += 1;
    starts = ends;
  });
  EXPECT_TRUE(starts) << "the last document never ended";
  return docs;
}

TEST(CorpusSource, DirectoriesGlobsAndJsonlAreDocumentsInPathOrder) {
  TempDir dir;
  fs::create_directories(dir / "books/sub");
  fs::create_directories(dir / "books/.git");
  write_text(dir / "books/b.txt", "second book\nwith two lines\n");
  write_text(dir / "books/a.txt", "first book");  // no final line end
  write_text(dir / "books/sub/c.jsonl",
             "{\"text\": \"third\\nline\", \"id\": 7}\n\n   \n{\"text\": \"fourth\"}\n"
             "{\"text\": \"\"}\n");
  write_text(dir / "books/empty.txt", "");
  write_text(dir / "books/notes.md", "not a corpus file");
  write_text(dir / "books/.git/x.txt", "hidden");
  // A dangling link is skipped (it used to end the listing); a link to a folder is not followed.
  fs::create_symlink(dir / "nowhere.txt", dir / "books/dangling.txt");
  fs::create_directories(dir / "elsewhere");
  write_text(dir / "elsewhere/e.txt", "linked folder");
  fs::create_directory_symlink(dir / "elsewhere", dir / "books/linked");
  const CorpusSource all(dir / "books");
  EXPECT_EQ(all.files(),
            (std::vector<std::string>{dir / "books/a.txt", dir / "books/b.txt",
                                      dir / "books/empty.txt", dir / "books/sub/c.jsonl"}));
  const auto docs = documents_of(all);
  std::vector<std::string> texts;
  for (const auto& d : docs)
    texts.push_back(d.first);
  EXPECT_EQ(texts, (std::vector<std::string>{"first book", "second book\nwith two lines\n",
                                             "third\nline", "fourth"}));

  const CorpusSource glob(dir / "books/*.txt");
  EXPECT_EQ(glob.files().size(), 3u);
  EXPECT_EQ(documents_of(glob).size(), 2u);
  const CorpusSource one(dir / "books/sub/c.jsonl");
  EXPECT_EQ(documents_of(one).size(), 2u);

  // A text file larger than a block arrives in blocks that end at line ends, and whole.
  const std::string big = generated_corpus(60000);
  ASSERT_GT(big.size(), 2 * CorpusSource::kBlockBytes);
  write_text(dir / "big.txt", big);
  const auto big_docs = documents_of(CorpusSource(dir / "big.txt"));
  ASSERT_EQ(big_docs.size(), 1u);
  EXPECT_TRUE(big_docs[0].first == big);
  EXPECT_GE(big_docs[0].second, 2);
  CorpusSource(dir / "big.txt").read([](std::string_view text, bool ends) {
    EXPECT_TRUE(ends || (!text.empty() && text.back() == '\n'));
  });
}

TEST(CorpusSource, BadFilesNameTheFileAndLine) {
  TempDir dir;
  write_text(dir / "bad.jsonl", "{\"text\": \"ok\"}\n\n{\"text\": \"cut\n");
  EXPECT_CONTAINS(error_of([&] { documents_of(CorpusSource(dir / "bad.jsonl")); }),
                  dir / "bad.jsonl" + ":3: not JSON");
  write_text(dir / "notext.jsonl", "{\"text\": \"ok\"}\n{\"body\": \"x\"}\n");
  EXPECT_CONTAINS(error_of([&] { documents_of(CorpusSource(dir / "notext.jsonl")); }),
                  dir / "notext.jsonl" + ":2: a JSONL record needs a string field \"text\"");
  write_text(dir / "latin1.txt", std::string("fine\ncaf\xe9 au lait\n"));
  EXPECT_CONTAINS(error_of([&] { documents_of(CorpusSource(dir / "latin1.txt")); }),
                  dir / "latin1.txt" + ":2: not UTF-8 text: invalid byte 0xe9 at column 4");
  write_text(dir / "latin1.jsonl", std::string("{\"text\": \"caf\xe9\"}\n"));
  EXPECT_CONTAINS(error_of([&] { documents_of(CorpusSource(dir / "latin1.jsonl")); }),
                  dir / "latin1.jsonl" + ":1");
  EXPECT_CONTAINS(error_of([&] { CorpusSource(dir / "*.nope"); }), "matches no file");
  write_text(dir / "x.md", "markdown");
  EXPECT_CONTAINS(error_of([&] { CorpusSource(dir / "*.md"); }),
                  "'" + dir / "x.md" + "' is neither .txt nor .jsonl");
  fs::create_directories(dir / "void");
  EXPECT_CONTAINS(error_of([&] { CorpusSource(dir / "void"); }), "holds no .txt or .jsonl file");
  write_text(dir / "empty.txt", "");
  EXPECT_CONTAINS(error_of([&] { CorpusSource(dir / "empty.txt"); }), "the file is empty");
  EXPECT_CONTAINS(error_of([&] { CorpusSource(dir / "absent.txt"); }), "No such file");
}

// ---- Tokenizer --------------------------------------------------------------------------------

TEST(Tokenizer, TrainEncodeDecodeRoundTrip) {
  TempDir dir;
  const std::string text = generated_corpus(3000);  // ~240 KB
  const auto t0 = std::chrono::steady_clock::now();
  Tokenizer tok = train_tokenizer(text, 400, dir / "tok", /*seed=*/7);
  const double train_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(fs::exists(dir / "tok.model"));
  EXPECT_EQ(tok.vocab_size(), 400);
  EXPECT_EQ(tok.unk_id(), 0);
  EXPECT_EQ(tok.bos_id(), 1);
  EXPECT_EQ(tok.eos_id(), 2);

  const std::vector<int> ids = tok.encode(text);
  std::printf("tokenizer: trained on %zu bytes in %.2f s; %zu tokens (%.2f bytes/token)\n",
              text.size(), train_s, ids.size(), double(text.size()) / ids.size());
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_LT(ids.size(), text.size() / 3);  // it learned words, not just bytes
  for (int id : ids)
    ASSERT_TRUE(id >= 3 && id < 400) << id;  // no unk, no control ids

  // Unseen characters go through byte fallback; whitespace survives exactly.
  const std::string unseen = "Zebra\t\tquixotic  jumps;   naïve 日本語 🙂\r\n\n   x  \n";
  EXPECT_EQ(tok.decode(tok.encode(unseen)), unseen);
  // A line far longer than the encoder's chunk, with and without spaces.
  std::string long_line;
  for (int i = 0; i < 3000; ++i)
    long_line += "word" + std::to_string(i % 7) + " ";
  long_line += std::string(9000, 'x') + "日本語日本語" + std::string(5000, 'y');
  EXPECT_EQ(tok.decode(tok.encode(long_line)), long_line);

  // The written model loads and encodes identically; training is deterministic for a seed.
  Tokenizer loaded(dir / "tok.model");
  EXPECT_EQ(loaded.encode(text), ids);
  Tokenizer again = train_tokenizer(text, 400, "", 7);
  EXPECT_EQ(again.serialized(), tok.serialized());
  EXPECT_LT(train_s, 5.0);
}

TEST(Tokenizer, Errors) {
  EXPECT_CONTAINS(error_of([] { train_tokenizer("some text\n", 100, "", 0); }),
                  "vocab_size must be at least 260");
  EXPECT_CONTAINS(error_of([] { train_tokenizer("\n\n\n", 300, "", 0); }), "no non-empty line");
  TempDir dir;
  write_text(dir / "junk.model", "this is not a protobuf");
  const std::string msg = error_of([&] { Tokenizer t(dir / "junk.model"); });
  EXPECT_CONTAINS(msg, dir / "junk.model");
  EXPECT_CONTAINS(msg, "not a tokenizer model");
  Tokenizer tok = train_tokenizer(generated_corpus(300), 300, "", 0);
  EXPECT_CONTAINS(error_of([&] { tok.decode({5, 300}); }), "cannot decode id 300 at position 1");
  EXPECT_CONTAINS(error_of([] { Tokenizer().encode("x"); }), "used before load()");
}

// ---- Token files ------------------------------------------------------------------------------

TEST(TokenFile, WritesAndReadsBothDtypes) {
  TempDir dir;
  for (int64_t vocab : {int64_t{1000}, int64_t{70000}}) {
    std::vector<int> tokens(12345);
    for (size_t i = 0; i < tokens.size(); ++i)
      tokens[i] = static_cast<int>((i * 7919) % vocab);
    const std::string path = dir / ("t" + std::to_string(vocab) + ".bin");
    const TokenFileInfo info = write_token_file(path, tokens, vocab);
    EXPECT_EQ(info.bytes_per_token, vocab <= 65535 ? 2 : 4);
    EXPECT_EQ(static_cast<int64_t>(fs::file_size(path)),
              kTokenFileHeaderBytes + 12345 * info.bytes_per_token);

    TokenFile f(path);
    EXPECT_EQ(f.size(), 12345);
    EXPECT_EQ(f.info().vocab_size, vocab);
    EXPECT_EQ(f.info().checksum, info.checksum);
    EXPECT_EQ(f.at(12344), tokens[12344]);
    const torch::Tensor w = f.window(100, 50);
    ASSERT_EQ(w.dtype(), torch::kLong);
    ASSERT_EQ(w.sizes(), torch::IntArrayRef({50}));
    for (int i = 0; i < 50; ++i)
      EXPECT_EQ(w[i].item<int64_t>(), tokens[100 + i]);
    EXPECT_CONTAINS(error_of([&] { f.window(12300, 46); }), "outside the 12345 tokens");
    EXPECT_CONTAINS(error_of([&] { f.window(-1, 2); }), path);
  }
  EXPECT_CONTAINS(error_of([&] {
                    write_token_file(dir / "bad.bin", std::vector<int>{1, 5}, 5);
                  }),
                  "token 5 at position 1 is outside the vocabulary [0, 5)");
  EXPECT_FALSE(fs::exists(dir / "bad.bin"));
}

TEST(TokenFile, RejectsDamagedFilesNamingThem) {
  TempDir dir;
  std::vector<int> tokens(1000);
  for (int i = 0; i < 1000; ++i)
    tokens[i] = i % 300;
  const std::string good = dir / "good.bin";
  write_token_file(good, tokens, 300);
  const std::string bytes = [&] {
    std::ifstream in(good, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  auto variant = [&](const std::string& name, std::string b) {
    write_text(dir / name, b);
    return dir / name;
  };

  std::string b = bytes;
  b.replace(0, 8, "GGUF\x03\0\0\0");
  std::string path = variant("magic.bin", b);
  std::string msg = error_of([&] { TokenFile f(path); });
  EXPECT_CONTAINS(msg, path + ": not a token file: magic is \"GGUF????\"");

  path = variant("truncated.bin", bytes.substr(0, 64 + 640 * 2 + 1));
  msg = error_of([&] { TokenFile f(path); });
  EXPECT_CONTAINS(msg, path + ": truncated: header says 1000 tokens, file holds 640");

  path = variant("short.bin", bytes.substr(0, 20));
  EXPECT_CONTAINS(error_of([&] { TokenFile f(path); }),
                  path + ": truncated: 20 bytes, less than the 64-byte header");

  path = variant("appended.bin", bytes + "xyz");
  EXPECT_CONTAINS(error_of([&] { TokenFile f(path); }), path + ": 3 bytes after the 1000 tokens");

  b = bytes;
  b[64 + 777] ^= 0x01;  // one bit of one token
  path = variant("flipped.bin", b);
  msg = error_of([&] { TokenFile f(path); });
  EXPECT_CONTAINS(msg, path + ": checksum mismatch: the tokens hash to 0x");
  // Without verification it opens (the caller chose speed over the check).
  EXPECT_EQ(error_of([&] { TokenFile f(path, /*verify_checksum=*/false); }), "");

  b = bytes;
  b[16] ^= 0x01;  // the token count
  path = variant("header.bin", b);
  EXPECT_CONTAINS(error_of([&] { TokenFile f(path); }), path + ": corrupt header");

  b = bytes;
  b[8] = 2;  // version
  path = variant("version.bin", b);
  EXPECT_CONTAINS(error_of([&] { TokenFile f(path); }),
                  path + ": format version 2, this build reads version 1");

  EXPECT_CONTAINS(error_of([&] { TokenFile f(dir / "absent.bin"); }),
                  dir / "absent.bin" + ": cannot open: No such file or directory");
  EXPECT_EQ(error_of([&] { TokenFile f(good); }), "");
}

// ---- prepare_data -----------------------------------------------------------------------------

class PrepareData : public ::testing::Test {
 protected:
  void SetUp() override {
    text_ = generated_corpus(2000);
    write_text(dir_ / "corpus.txt", text_);
    opts_.corpus = dir_ / "corpus.txt";
    opts_.out_dir = dir_ / "data";
    opts_.vocab_size = 320;
    opts_.held_out_fraction = 0.1;
    opts_.seed = 3;
  }
  fs::file_time_type mtime(const std::string& p) { return fs::last_write_time(p); }

  TempDir dir_;
  std::string text_;
  PrepareOptions opts_;
};

TEST_F(PrepareData, WritesACompleteConsistentSet) {
  const PreparedData d = prepare_data(opts_);
  EXPECT_FALSE(d.reused);
  // Exactly the four files: no temporaries, no lock file.
  EXPECT_EQ(dir_listing(opts_.out_dir),
            (std::vector<std::string>{"meta.json", "tokenizer.model", "train.bin", "val.bin"}));

  Tokenizer tok(d.tokenizer_path);
  const std::vector<int> ids = tok.encode(text_);
  EXPECT_EQ(d.vocab_size, 320);
  EXPECT_EQ(d.train_tokens + d.val_tokens, static_cast<int64_t>(ids.size()));
  EXPECT_EQ(d.val_tokens, std::llround(ids.size() * 0.1));

  // The held-out split is the last tokens, contiguous; train is the rest.
  TokenFile train(d.train_path), val(d.val_path);
  ASSERT_EQ(train.size(), d.train_tokens);
  ASSERT_EQ(val.size(), d.val_tokens);
  for (int64_t i = 0; i < train.size(); ++i)
    ASSERT_EQ(train.at(i), ids[i]) << i;
  for (int64_t i = 0; i < val.size(); ++i)
    ASSERT_EQ(val.at(i), ids[train.size() + i]) << i;

  const auto meta = nlohmann::json::parse(read_file(d.meta_path));
  EXPECT_EQ(meta["options"]["corpus"], opts_.corpus);
  EXPECT_EQ(meta["options"]["vocab_size"], 320);
  EXPECT_EQ(meta["options"]["held_out_fraction"], 0.1);
  EXPECT_EQ(meta["options"]["seed"], 3u);
  EXPECT_EQ(meta["corpus"]["bytes"], text_.size());
  EXPECT_EQ(meta["train"]["tokens"], d.train_tokens);
  EXPECT_EQ(meta["val"]["dtype"], "uint16");
  EXPECT_EQ(meta["tokenizer"]["eos_id"], 2);
  std::printf("prepared %s: %lld train + %lld val tokens\n", opts_.out_dir.c_str(),
              static_cast<long long>(d.train_tokens), static_cast<long long>(d.val_tokens));
}

// A corpus of several documents (a directory of .txt and .jsonl files) is the documents' ids
// joined by eos, split as one text is; its meta.json counts documents and files, and a second
// call reuses it. One text file is one document: its ids are those of the whole text, as before.
TEST_F(PrepareData, DocumentsAreSeparatedByEosAndCounted) {
  fs::create_directories(dir_ / "many");
  const std::string a = generated_corpus(300), b = generated_corpus(200);
  write_text(dir_ / "many/a.txt", a);
  write_text(dir_ / "many/b.jsonl", nlohmann::json{{"text", b}}.dump() + "\n" +
                                        nlohmann::json{{"text", "amen"}}.dump() + "\n");
  opts_.corpus = dir_ / "many";
  const PreparedData d = prepare_data(opts_);
  EXPECT_EQ(d.documents, 3);
  EXPECT_EQ(d.files, 2);
  Tokenizer tok(d.tokenizer_path);
  std::vector<int> want = tok.encode(a);
  for (const auto* doc : {&b, static_cast<const std::string*>(nullptr)}) {
    want.push_back(d.eos_id);
    const auto ids = tok.encode(doc ? *doc : std::string("amen"));
    want.insert(want.end(), ids.begin(), ids.end());
  }
  TokenFile train(d.train_path), val(d.val_path);
  ASSERT_EQ(train.size() + val.size(), static_cast<int64_t>(want.size()));
  EXPECT_EQ(val.size(), std::llround(want.size() * 0.1));
  for (int64_t i = 0; i < train.size(); ++i)
    ASSERT_EQ(train.at(i), want[i]) << i;
  for (int64_t i = 0; i < val.size(); ++i)
    ASSERT_EQ(val.at(i), want[train.size() + i]) << i;
  const auto meta = nlohmann::json::parse(read_file(d.meta_path));
  EXPECT_EQ(meta["corpus"]["documents"], 3);
  EXPECT_EQ(meta["corpus"]["files"], 2);
  EXPECT_EQ(meta["corpus"]["bytes"], a.size() + b.size() + 4);
  // Only the four files: the whole-stream token file and every temporary are gone.
  EXPECT_EQ(dir_listing(opts_.out_dir),
            (std::vector<std::string>{"meta.json", "tokenizer.model", "train.bin", "val.bin"}));
  const PreparedData again = prepare_data(opts_);
  EXPECT_TRUE(again.reused);
  EXPECT_EQ(again.documents, 3);
  // A changed document prepares again.
  write_text(dir_ / "many/a.txt", a + "more\n");
  EXPECT_FALSE(prepare_data(opts_).reused);
}

TEST_F(PrepareData, SecondCallReusesWithoutWriting) {
  const PreparedData first = prepare_data(opts_);
  ASSERT_FALSE(first.reused);
  const auto names = dir_listing(opts_.out_dir);
  std::vector<fs::file_time_type> before;
  for (const auto& n : names)
    before.push_back(mtime(opts_.out_dir + "/" + n));
  const std::string meta_before = read_file(first.meta_path);

  const auto t0 = std::chrono::steady_clock::now();
  const PreparedData second = prepare_data(opts_);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("reuse check took %.3f s\n", s);
  EXPECT_TRUE(second.reused);
  EXPECT_EQ(second.train_tokens, first.train_tokens);
  EXPECT_EQ(second.val_tokens, first.val_tokens);
  EXPECT_EQ(dir_listing(opts_.out_dir), names);
  for (size_t i = 0; i < names.size(); ++i)
    EXPECT_EQ(mtime(opts_.out_dir + "/" + names[i]), before[i]) << names[i] << " was rewritten";
  EXPECT_EQ(read_file(first.meta_path), meta_before);
  EXPECT_TRUE(open_prepared(opts_).reused);
}

// Prepared data copied to a machine without its corpus (docs/gpu.md: a GPU machine without
// bible-kjv) is used as it is when its own files verify; with nothing prepared, or prepared
// data that fails its checks, the corpus's own error stands.
TEST_F(PrepareData, APreparedDirectoryIsUsedWithoutItsCorpus) {
  const PreparedData first = prepare_data(opts_);
  fs::remove(opts_.corpus);
  const PreparedData copied = prepare_data(opts_);
  EXPECT_TRUE(copied.reused);
  EXPECT_EQ(copied.train_tokens, first.train_tokens);
  EXPECT_EQ(copied.val_tokens, first.val_tokens);

  std::string damaged = read_file(first.train_path);
  damaged[100] ^= 0x10;
  write_text(first.train_path, damaged);
  EXPECT_CONTAINS(error_of([&] { prepare_data(opts_); }), "corpus '" + opts_.corpus + "'");
  fs::remove_all(opts_.out_dir);
  EXPECT_CONTAINS(error_of([&] { prepare_data(opts_); }), "corpus '" + opts_.corpus + "'");
}

TEST_F(PrepareData, RebuildsWhenOptionsCorpusOrFilesChange) {
  const PreparedData first = prepare_data(opts_);
  const std::string train_bytes = read_file(first.train_path);

  // A damaged token file is detected and rebuilt, identically (preparation is deterministic).
  std::string damaged = train_bytes;
  damaged[100] ^= 0x10;
  write_text(first.train_path, damaged);
  const PreparedData repaired = prepare_data(opts_);
  EXPECT_FALSE(repaired.reused);
  EXPECT_EQ(read_file(first.train_path), train_bytes);

  // Other options: open_prepared names the key, prepare_data rebuilds.
  PrepareOptions other = opts_;
  other.held_out_fraction = 0.2;
  const std::string msg = error_of([&] { open_prepared(other); });
  EXPECT_CONTAINS(msg, first.meta_path + ": options.held_out_fraction is 0.1, requested 0.2");
  const PreparedData rebuilt = prepare_data(other);
  EXPECT_FALSE(rebuilt.reused);
  EXPECT_GT(rebuilt.val_tokens, first.val_tokens);
  EXPECT_TRUE(prepare_data(other).reused);

  // The same path with other text.
  write_text(opts_.corpus, text_ + "A new last line.\n");
  EXPECT_FALSE(prepare_data(other).reused);
  EXPECT_EQ(dir_listing(opts_.out_dir).size(), 4u);
}

// A damaged meta.json that still parses (one bit turns vocab_size 320 into 220, a letter of a
// name into another) is not believed: open_prepared names the file, prepare_data rebuilds it.
TEST_F(PrepareData, RebuildsAMetaJsonDamagedButStillValid) {
  const PreparedData first = prepare_data(opts_);
  const std::string meta_bytes = read_file(first.meta_path);
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"\"vocab_size\": 320,", "\"vocab_size\": 220,"},
           {"\"eos_id\": 2", "\"eos_id\": 3"},
           {"byte-fallback", "by.e-fallback"}}) {
    std::string damaged = meta_bytes;
    const size_t at = damaged.find(from, damaged.find("\"tokenizer\""));
    ASSERT_NE(at, std::string::npos) << from;
    damaged.replace(at, from.size(), to);
    write_text(first.meta_path, damaged);
    ASSERT_FALSE(nlohmann::json::parse(damaged).is_discarded());
    const std::string msg = error_of([&] { open_prepared(opts_); });
    EXPECT_CONTAINS(msg, first.meta_path + ": checksum");
    const PreparedData repaired = prepare_data(opts_);
    EXPECT_FALSE(repaired.reused) << to;
    EXPECT_EQ(repaired.vocab_size, 320);
    EXPECT_EQ(repaired.eos_id, 2);
    EXPECT_EQ(read_file(first.meta_path), meta_bytes) << to;
    EXPECT_TRUE(prepare_data(opts_).reused);
  }
}

TEST_F(PrepareData, RankZeroPreparesOthersWaitAndVerify) {
  constexpr int kWorld = 3;
  std::barrier sync(kWorld);
  std::vector<PreparedData> results(kWorld);
  std::vector<std::string> errors(kWorld);
  auto run = [&](const PrepareOptions& o) {
    std::vector<std::thread> ranks;
    for (int r = 0; r < kWorld; ++r)
      ranks.emplace_back([&, r] {
        errors[r] =
            error_of([&] { results[r] = prepare_data(o, r, [&] { sync.arrive_and_wait(); }); });
      });
    for (auto& t : ranks)
      t.join();
  };
  run(opts_);
  for (int r = 0; r < kWorld; ++r)
    ASSERT_EQ(errors[r], "") << "rank " << r;
  EXPECT_FALSE(results[0].reused);  // rank 0 did the work
  for (int r = 1; r < kWorld; ++r) {
    EXPECT_TRUE(results[r].reused);
    EXPECT_EQ(results[r].train_path, results[0].train_path);
    EXPECT_EQ(results[r].train_tokens, results[0].train_tokens);
  }

  // Rank 0 fails: the others are released by the barrier and fail too, instead of hanging.
  PrepareOptions broken = opts_;
  broken.corpus = dir_ / "missing.txt";
  broken.out_dir = dir_ / "data2";
  run(broken);
  EXPECT_CONTAINS(errors[0], "corpus '" + broken.corpus + "': cannot read");
  for (int r = 1; r < kWorld; ++r) {
    EXPECT_CONTAINS(errors[r], "[rank " + std::to_string(r) + "]");
    EXPECT_CONTAINS(errors[r], "meta.json: missing");
  }
}

TEST_F(PrepareData, RejectsBadOptionsNamingThem) {
  PrepareOptions o = opts_;
  o.held_out_fraction = 1.5;
  EXPECT_CONTAINS(error_of([&] { prepare_data(o); }), "PrepareOptions.held_out_fraction = 1.5");
  o = opts_;
  o.vocab_size = 100;
  EXPECT_CONTAINS(error_of([&] { prepare_data(o); }), "PrepareOptions.vocab_size = 100");
  o = opts_;
  o.out_dir = "";
  EXPECT_CONTAINS(error_of([&] { prepare_data(o); }), "PrepareOptions.out_dir is empty");
}

TEST(PrepareKjv, EndToEnd) {
  if (!have_bible())
    GTEST_FAIL() << "bible-kjv is not installed (scripts/setup.sh installs it)";
  TempDir dir;
  PrepareOptions o;
  o.corpus = "kjv";
  o.out_dir = dir / "kjv";
  const auto t0 = std::chrono::steady_clock::now();
  const PreparedData d = prepare_data(o);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto t1 = std::chrono::steady_clock::now();
  const PreparedData again = prepare_data(o);
  const double s2 = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  std::printf(
      "KJV prepared in %.1f s (reuse check %.2f s): vocab %d, %lld train + %lld val "
      "tokens, %.2f bytes/token\n",
      s, s2, d.vocab_size, static_cast<long long>(d.train_tokens),
      static_cast<long long>(d.val_tokens),
      4.3e6 / static_cast<double>(d.train_tokens + d.val_tokens));
  EXPECT_FALSE(d.reused);
  EXPECT_TRUE(again.reused);
  EXPECT_EQ(d.vocab_size, 4096);
  EXPECT_GT(d.train_tokens, 1'000'000);
  EXPECT_NEAR(static_cast<double>(d.val_tokens) / (d.train_tokens + d.val_tokens), 0.02, 1e-4);
  // The held-out text is the end of Revelation.
  Tokenizer tok(d.tokenizer_path);
  TokenFile val(d.val_path);
  std::vector<int> tail;
  for (int64_t i = val.size() - 40; i < val.size(); ++i)
    tail.push_back(val.at(i));
  EXPECT_CONTAINS(tok.decode(tail), "Amen.");
  EXPECT_LT(s, 30.0);

  // A start finds the directory by the fingerprint of bible-kjv's files (corpus_fingerprint),
  // without printing the Bible again: a meta.json that records the current fingerprint is
  // believed even with another corpus checksum. With a stale fingerprint and the same bytes, the
  // directory is reused and the fingerprint recorded, in a meta.json that verifies: the next
  // start believes it again without the read.
  const std::string fingerprint = corpus_fingerprint("kjv");
  ASSERT_FALSE(fingerprint.empty());
  const std::string meta_path = o.out_dir + "/meta.json";
  auto meta = nlohmann::json::parse(read_file(meta_path));
  EXPECT_EQ(meta["corpus"]["fingerprint"], fingerprint);
  const auto reseal = [&](nlohmann::json m) {
    m.erase("meta_xxh64");
    const std::string text = m.dump();
    char sum[24];
    std::snprintf(sum, sizeof sum, "0x%016llx",
                  static_cast<unsigned long long>(XXH64(text.data(), text.size(), 0)));
    m["meta_xxh64"] = sum;
    write_file_atomic(meta_path, m.dump(2) + "\n");
  };
  auto believed = meta;
  believed["corpus"]["xxh64"] = "0x0000000000000001";
  reseal(believed);
  EXPECT_TRUE(prepare_data(o).reused);
  auto stale = meta;
  stale["corpus"]["fingerprint"] = "/usr/bin/bible 1 2.3 4;";
  reseal(stale);
  EXPECT_TRUE(prepare_data(o).reused);
  auto recorded = nlohmann::json::parse(read_file(meta_path));
  EXPECT_EQ(recorded["corpus"]["fingerprint"], fingerprint);
  EXPECT_TRUE(open_prepared(o).reused);  // its own checksum holds
  recorded["corpus"]["xxh64"] = "0x0000000000000001";
  reseal(recorded);
  EXPECT_TRUE(prepare_data(o).reused);
}

// ---- DistributedSampler -----------------------------------------------------------------------

TEST(DistributedSampler, RanksAreDisjointWithinEachStepAndEpoch) {
  TempDir dir;
  TokenFile data(write_positions(dir, 5000));
  constexpr int64_t kBatch = 3, kSeq = 15, kW = kSeq + 1;
  for (int world = 1; world <= 4; ++world) {
    std::vector<DistributedSampler> ranks;
    for (int r = 0; r < world; ++r)
      ranks.emplace_back(data, kBatch, kSeq, r, world, 42);
    const int64_t steps = ranks[0].steps_in_epoch();
    std::set<int64_t> epoch_windows;
    int64_t epoch = 0;
    int epochs_seen = 1;
    for (int step = 0; step < 3 * steps + 5; ++step) {  // crosses epoch boundaries
      std::set<int64_t> step_windows;
      for (int r = 0; r < world; ++r) {
        const torch::Tensor xy = ranks[r].next();
        ASSERT_EQ(xy.sizes(), torch::IntArrayRef({kBatch, kW}));
        ASSERT_EQ(ranks[r].epoch(), ranks[0].epoch());
        for (int64_t b = 0; b < kBatch; ++b) {
          const int64_t start = xy[b][0].item<int64_t>();
          // A window is kW consecutive tokens of the file.
          ASSERT_TRUE(torch::equal(xy[b], torch::arange(start, start + kW, torch::kLong)));
          ASSERT_TRUE(step_windows.insert(start).second)
              << "world " << world << " step " << step << ": window " << start << " twice";
        }
      }
      if (ranks[0].epoch() != epoch) {
        epoch = ranks[0].epoch();
        ++epochs_seen;
        epoch_windows.clear();
      }
      for (int64_t s : step_windows) {
        ASSERT_TRUE(epoch_windows.insert(s).second) << "window " << s << " repeats in an epoch";
        // Non-overlapping: all windows of an epoch share the phase.
        ASSERT_EQ((s - *epoch_windows.begin()) % kW, 0);
      }
    }
    EXPECT_GE(epochs_seen, 3);
    std::printf("world %d: %lld steps/epoch, %d epochs, disjoint\n", world,
                static_cast<long long>(steps), epochs_seen);
  }
}

TEST(DistributedSampler, DeterministicAndSeeded) {
  TempDir dir;
  TokenFile data(write_positions(dir, 4000));
  DistributedSampler a(data, 4, 31, 1, 2, 9), b(data, 4, 31, 1, 2, 9), c(data, 4, 31, 1, 2, 10);
  bool any_diff = false;
  for (int i = 0; i < 50; ++i) {
    const torch::Tensor x = a.next();
    ASSERT_TRUE(torch::equal(x, b.next())) << "batch " << i;
    any_diff |= !torch::equal(x, c.next());
  }
  EXPECT_TRUE(any_diff);
}

TEST(DistributedSampler, ResumeEqualsUninterrupted) {
  TempDir dir;
  TokenFile data(write_positions(dir, 3000));
  for (int world : {1, 3}) {
    for (int r = 0; r < world; ++r) {
      DistributedSampler straight(data, 2, 20, r, world, 5);
      std::vector<torch::Tensor> expected;
      for (int i = 0; i < 100; ++i)
        expected.push_back(straight.next());

      DistributedSampler first(data, 2, 20, r, world, 5);
      for (int i = 0; i < 50; ++i)
        ASSERT_TRUE(torch::equal(first.next(), expected[i]));
      const SamplerState saved = first.state();
      // A new sampler, constructed with another seed: the state's seed wins.
      DistributedSampler resumed(data, 2, 20, r, world, 999);
      resumed.load_state(saved);
      EXPECT_EQ(resumed.state().epoch, saved.epoch);
      EXPECT_EQ(resumed.state().position, saved.position);
      for (int i = 50; i < 100; ++i)
        ASSERT_TRUE(torch::equal(resumed.next(), expected[i]))
            << "world " << world << " rank " << r << " batch " << i;
      EXPECT_GT(resumed.epoch(), saved.epoch) << "the comparison should cross an epoch";
    }
  }
}

TEST(DistributedSampler, StateCarriesOverToAnotherWorldSize) {
  TempDir dir;
  TokenFile data(write_positions(dir, 3000));
  // 2 ranks x 4 and 4 ranks x 2 share the global batch of 8: after a restart on 4 ranks, a step
  // covers the windows the 2-rank job would have trained on.
  std::vector<DistributedSampler> two, four;
  for (int r = 0; r < 2; ++r)
    two.emplace_back(data, 4, 20, r, 2, 11);
  for (int r = 0; r < 4; ++r)
    four.emplace_back(data, 2, 20, r, 4, 0);
  for (int i = 0; i < 7; ++i)
    for (auto& s : two)
      s.next();
  for (auto& s : four)
    s.load_state(two[0].state());
  for (int step = 0; step < 30; ++step) {  // crosses into the next epoch
    std::multiset<int64_t> a, b;
    for (auto& s : two)
      for (int64_t o : s.peek_offsets())
        a.insert(o);
    for (auto& s : four)
      for (int64_t o : s.peek_offsets())
        b.insert(o);
    ASSERT_EQ(a, b) << "step " << step;
    for (auto& s : two)
      s.next();
    for (auto& s : four)
      s.next();
  }
}

TEST(DistributedSampler, EpochRolloverReshuffles) {
  TempDir dir;
  TokenFile data(write_positions(dir, 2000));
  DistributedSampler s(data, 4, 9, 0, 1, 1);  // windows of 10
  std::vector<std::vector<int64_t>> epochs(3);
  for (int e = 0; e < 3; ++e) {
    std::vector<int64_t> first = s.peek_offsets();  // rolls over into epoch e
    EXPECT_EQ(s.epoch(), e);
    EXPECT_GE(s.windows_in_epoch(), 199);  // (2000 - phase) / 10
    const int64_t steps = s.steps_in_epoch();
    for (int64_t i = 0; i < steps; ++i) {
      const auto offs = s.peek_offsets();
      epochs[e].insert(epochs[e].end(), offs.begin(), offs.end());
      s.next();
    }
    EXPECT_EQ(s.epoch(), e);
    const std::set<int64_t> unique(epochs[e].begin(), epochs[e].end());
    EXPECT_EQ(static_cast<int64_t>(unique.size()), steps * 4) << "a window repeats in epoch " << e;
    // A sampler started at this epoch from a state replays it.
    DistributedSampler replay(data, 4, 9, 0, 1, 1);
    replay.load_state({e, 0, 1});
    EXPECT_EQ(replay.peek_offsets(), first);
  }
  s.next();
  EXPECT_EQ(s.epoch(), 3);
  // Different orders, and (for this seed) the phases are not all equal.
  EXPECT_NE(epochs[0], epochs[1]);
  EXPECT_NE(epochs[1], epochs[2]);
  const std::set<int64_t> phases{epochs[0][0] % 10, epochs[1][0] % 10, epochs[2][0] % 10};
  EXPECT_GT(phases.size(), 1u);
}

TEST(DistributedSampler, Errors) {
  TempDir dir;
  TokenFile data(write_positions(dir, 1000));
  std::string msg = error_of([&] { DistributedSampler s(data, 8, 127, 0, 2, 0); });
  EXPECT_CONTAINS(msg, data.path() +
                           ": 1000 tokens make 6 windows of 128 tokens, fewer than one "
                           "global batch of 16 (world_size 2 x batch 8)");
  EXPECT_CONTAINS(error_of([&] { DistributedSampler s(data, 1, 7, 2, 2, 0); }),
                  "rank 2 is outside world_size 2");
  DistributedSampler s(data, 2, 7, 0, 2, 0);
  EXPECT_CONTAINS(error_of([&] { s.load_state({0, 1000, 0}); }), "position 1000 is beyond the");
}

// ---- eval_batches -----------------------------------------------------------------------------

TEST(EvalBatches, DeterministicAndSplitAcrossRanks) {
  TempDir dir;
  TokenFile data(write_positions(dir, 1000));
  constexpr int64_t kW = 10;
  for (int world = 1; world <= 3; ++world) {
    std::set<int64_t> seen;
    size_t count = 0;
    for (int r = 0; r < world; ++r) {
      const auto batches = eval_batches(data, 4, kW - 1, r, world, 0);
      count = count ? count : batches.size();
      EXPECT_EQ(batches.size(), count) << "every rank runs the same number of batches";
      EXPECT_EQ(batches.size(), static_cast<size_t>(100 / (4 * world)));
      const auto again = eval_batches(data, 4, kW - 1, r, world, 0);
      for (size_t i = 0; i < batches.size(); ++i) {
        ASSERT_TRUE(torch::equal(batches[i], again[i]));
        ASSERT_EQ(batches[i].sizes(), torch::IntArrayRef({4, kW}));
        for (int64_t b = 0; b < 4; ++b) {
          const int64_t start = batches[i][b][0].item<int64_t>();
          EXPECT_EQ(start % kW, 0);
          EXPECT_TRUE(torch::equal(batches[i][b], torch::arange(start, start + kW, torch::kLong)));
          EXPECT_TRUE(seen.insert(start).second) << "window " << start << " on two ranks";
        }
      }
    }
    EXPECT_EQ(*seen.rbegin(), (static_cast<int64_t>(seen.size()) - 1) * kW);  // a prefix
  }
  EXPECT_EQ(eval_batches(data, 4, 9, 0, 2, 3).size(), 3u);  // max_batches
  // Too little data for a full batch: one smaller batch per rank.
  const auto small = eval_batches(data, 64, 9, 1, 2, 0);
  ASSERT_EQ(small.size(), 1u);
  EXPECT_EQ(small[0].size(0), 50);
  EXPECT_EQ(small[0][0][0].item<int64_t>(), 500);
  EXPECT_CONTAINS(error_of([&] { eval_batches(data, 4, 999, 0, 2, 0); }),
                  "fewer than one per rank");
}

}  // namespace
