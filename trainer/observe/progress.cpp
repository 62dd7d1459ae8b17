// See progress.h. The bar redraws in place with '\r' and is cleared before any other line.
#include "progress.h"

#include <fmt/core.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <cstdio>

#include <fsdp/core/memory.h>

namespace fsdp_trainer {
namespace {

int terminal_width() {
  winsize ws{};
  if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 20)
    return ws.ws_col;
  return 100;
}

std::string format_duration(double seconds) {
  const auto s = static_cast<int64_t>(seconds + 0.5);
  return s >= 3600 ? fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
                   : fmt::format("{}:{:02}", s / 60, s % 60);
}

}  // namespace

Progress::Progress(const std::string& mode, int64_t total_steps, int64_t log_every)
    : bar_(mode == "bar" || (mode == "auto" && isatty(STDOUT_FILENO))),
      quiet_(mode == "none"),
      total_(total_steps),
      log_every_(log_every) {}

Progress::~Progress() {
  finish();
}

std::string Progress::format(const ProgressLine& l, bool with_bar) const {
  std::string text = fmt::format(
      "step {:>{}}/{} | loss {:.4f} | {:>7.0f} tok/s | MFU {:4.1f}% | peak {} | ETA {}", l.step,
      std::to_string(total_).size(), total_, l.loss, l.tokens_per_second, 100 * l.mfu,
      fsdp::memory::format_bytes(l.peak_bytes), format_duration(l.eta_seconds));
  if (!with_bar)
    return text;
  const int width = terminal_width();
  const int bar_width = std::max(10, std::min(30, width - static_cast<int>(text.size()) - 4));
  const int filled = static_cast<int>(bar_width * l.step / std::max<int64_t>(1, total_));
  // Built with fmt, not "[" + std::string&&: GCC 12 warns falsely (-Wstringop-overflow) on
  // that insert once the precompiled LibTorch header changes its inlining.
  text = fmt::format("[{}{}] {}", std::string(filled, '#'), std::string(bar_width - filled, '.'),
                     text);
  if (static_cast<int>(text.size()) > width - 1)
    text.resize(width - 1);
  return text;
}

void Progress::update(const ProgressLine& line) {
  if (quiet_)
    return;
  if (bar_) {
    std::fputs(("\r\033[K" + format(line, true)).c_str(), stdout);
    bar_drawn_ = true;
  } else if (line.step % log_every_ == 0 || line.step == total_ || line.step == 1) {
    std::puts(format(line, false).c_str());
  }
  std::fflush(stdout);
}

void Progress::message(const std::string& text) {
  if (quiet_)
    return;
  if (bar_drawn_)
    std::fputs("\r\033[K", stdout);
  std::puts(text.c_str());
  bar_drawn_ = false;
  std::fflush(stdout);
}

void Progress::finish() {
  if (bar_drawn_) {
    std::fputs("\n", stdout);
    std::fflush(stdout);
    bar_drawn_ = false;
  }
}

}  // namespace fsdp_trainer
