// The trainer's readers of JSON from outside (tokenizer.json, tokenizer_config.json, JSONL
// corpora, metrics.jsonl, a data directory's meta.json) refuse a file nesting 100,000 arrays
// (a few hundred KB, within every size bound) by its depth, naming the file, before the parser
// builds what would overflow the stack to print, copy or compare (fsdp/core/json_depth.h).
#include <gtest/gtest.h>

#include <string>

#include "data/corpus_source.h"
#include "data/data.h"
#include "data/pretrained_model.h"
#include "harness/deep_json.h"
#include "harness/errors.h"
#include "harness/files.h"
#include "observe/metrics.h"
#include "text/bpe_tokenizer.h"

namespace {

using fsdp::test::error_of;

class JsonReaders : public fsdp::test::DeepJsonFiles {};

TEST_F(JsonReaders, TokenizerJson) {
  const auto path = dir_.path() + "/tokenizer.json";
  expect_refused(
      error_of([&] { fsdp_trainer::BpeTokenizer::from_hf_json(deep_json(), path, "", ""); }), path);
}

TEST_F(JsonReaders, TokenizerConfigJson) {
  // A model directory's chat template comes from tokenizer_config.json when there is no
  // chat_template.jinja.
  const auto path = write("model/tokenizer_config.json", deep_json());
  expect_refused(error_of([&] { fsdp_trainer::pretrained_chat_template(dir_.path() + "/model"); }),
                 path);
}

TEST_F(JsonReaders, JsonlCorpusLine) {
  const auto path =
      write("corpus.jsonl", "{\"text\": \"in the beginning\"}\n" + deep_json() + "\n");
  const auto error =
      error_of([&] { fsdp_trainer::CorpusSource(path).read([](std::string_view, bool) {}); });
  expect_refused(error, path + ":2");
}

TEST_F(JsonReaders, MetricsJsonlLine) {
  const auto path = write("metrics.jsonl", deep_json() + "\n");
  expect_refused(error_of([&] { fsdp_trainer::read_metrics(path); }), path + ":1");
  // Reopened by a resumed run, which reads the step of each line.
  expect_refused(error_of([&] { fsdp_trainer::MetricsWriter(path, 3); }), path + ":1");
}

TEST_F(JsonReaders, PreparedDataMeta) {
  fsdp_trainer::PrepareOptions options;
  options.corpus = "kjv";
  options.out_dir = dir_.path() + "/data";
  const auto path = write("data/meta.json", deep_json());
  expect_refused(error_of([&] { fsdp_trainer::open_prepared(options); }), path);
}

}  // namespace
