// What rank 0 shows while training: a live one-line bar on a terminal, plain lines otherwise.
#pragma once

#include <cstdint>
#include <string>

namespace fsdp_trainer {

struct ProgressLine {
  int64_t step = 0;
  double loss = 0;
  double tokens_per_second = 0;
  double mfu = 0;  // fraction
  int64_t peak_bytes = 0;
  double eta_seconds = 0;
};

class Progress {
 public:
  /// mode: "auto" (a bar if stdout is a terminal, else lines), "bar", "lines" or "none".
  Progress(const std::string& mode, int64_t total_steps, int64_t log_every);
  ~Progress();

  void update(const ProgressLine& line);
  /// A line of its own (an eval result, a warning), printed above the bar.
  void message(const std::string& text);
  /// Ends the bar's line.
  void finish();

 private:
  std::string format(const ProgressLine& line, bool with_bar) const;

  bool bar_;
  bool quiet_;
  int64_t total_;
  int64_t log_every_;
  bool bar_drawn_ = false;
};

}  // namespace fsdp_trainer
