// StepMetrics <-> JSON lines, the breakdown table, and the FLOP estimate for MFU.
//
// The field table below is the single place that knows the JSON names, their order, their
// types and their TensorBoard tags; writing, reading, validation and the TensorBoard scalars all
// walk it, so a field cannot be added to one and forgotten in another.
#include "metrics.h"

#include <fsdp/core/json_depth.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <type_traits>
#include <variant>

#include <fsdp/core/memory.h>

namespace fsdp_trainer {
namespace {

using Json = nlohmann::ordered_json;

// ---- The field table -----------------------------------------------------------------------

using Member =
    std::variant<int64_t StepMetrics::*, double StepMetrics::*,
                 std::optional<double> StepMetrics::*, std::optional<int64_t> StepMetrics::*>;
struct Field {
  const char* name;
  // Its TensorBoard tag, "<group>/<name>" (docs/trainer.md lists them); nullptr for the step,
  // which is the event's step rather than a value.
  const char* tensorboard_tag;
  Member member;
};

// Order = order in each JSON line: what a human reading the log wants first.
const std::array<Field, 35> kFields = {{
    {"step", nullptr, &StepMetrics::step},
    {"loss", "train/loss", &StepMetrics::loss},
    {"eval_loss", "eval/loss", &StepMetrics::eval_loss},
    {"lr", "train/lr", &StepMetrics::lr},
    {"grad_norm", "train/grad_norm", &StepMetrics::grad_norm},
    {"tokens", "throughput/tokens", &StepMetrics::tokens},
    {"tokens_per_second", "throughput/tokens_per_second", &StepMetrics::tokens_per_second},
    {"mfu", "throughput/mfu", &StepMetrics::mfu},
    {"step_time_s", "time/step_s", &StepMetrics::step_time_s},
    {"time_forward_s", "time/forward_s", &StepMetrics::time_forward_s},
    {"time_backward_s", "time/backward_s", &StepMetrics::time_backward_s},
    {"time_allgather_wait_s", "time/allgather_wait_s", &StepMetrics::time_allgather_wait_s},
    {"time_allgather_wait_forward_s", "time/allgather_wait_forward_s",
     &StepMetrics::time_allgather_wait_forward_s},
    {"time_reducescatter_wait_s", "time/reducescatter_wait_s",
     &StepMetrics::time_reducescatter_wait_s},
    {"time_optimizer_s", "time/optimizer_s", &StepMetrics::time_optimizer_s},
    {"peak_bytes", "memory/peak_bytes", &StepMetrics::peak_bytes},
    {"allgather_bytes", "comm/allgather_bytes", &StepMetrics::allgather_bytes},
    {"reducescatter_bytes", "comm/reducescatter_bytes", &StepMetrics::reducescatter_bytes},
    {"allreduce_bytes", "comm/allreduce_bytes", &StepMetrics::allreduce_bytes},
    {"tp_bytes", "comm/tp_bytes", &StepMetrics::tp_bytes},
    {"loss_scale", "train/loss_scale", &StepMetrics::loss_scale},
    {"skipped_steps", "train/skipped_steps", &StepMetrics::skipped_steps},
    {"mem_params_bytes", "memory/params_bytes", &StepMetrics::mem_params_bytes},
    {"mem_grads_bytes", "memory/grads_bytes", &StepMetrics::mem_grads_bytes},
    {"mem_optimizer_bytes", "memory/optimizer_bytes", &StepMetrics::mem_optimizer_bytes},
    {"mem_gathered_bytes", "memory/gathered_bytes", &StepMetrics::mem_gathered_bytes},
    {"mem_activations_bytes", "memory/activations_bytes", &StepMetrics::mem_activations_bytes},
    {"mem_other_bytes", "memory/other_bytes", &StepMetrics::mem_other_bytes},
    {"grads_peak_bytes", "memory/grads_peak_bytes", &StepMetrics::grads_peak_bytes},
    {"rss_bytes", "memory/rss_bytes", &StepMetrics::rss_bytes},
    {"peak_rss_bytes", "memory/peak_rss_bytes", &StepMetrics::peak_rss_bytes},
    {"peak_reserved_bytes", "memory/peak_reserved_bytes", &StepMetrics::peak_reserved_bytes},
    {"offload_read_bytes", "offload/read_bytes", &StepMetrics::offload_read_bytes},
    {"offload_written_bytes", "offload/written_bytes", &StepMetrics::offload_written_bytes},
    {"time_offload_wait_s", "time/offload_wait_s", &StepMetrics::time_offload_wait_s},
}};

// JSON has no NaN or infinity; a diverged loss must still be logged, so it becomes null.
Json double_to_json(double v) {
  return std::isfinite(v) ? Json(v) : Json(nullptr);
}

// Fills `m` from one parsed line; returns what is wrong, or "" if the line is valid.
std::string from_json(const Json& j, StepMetrics& m) {
  if (!j.is_object())
    return std::string("expected a JSON object, found ") + j.type_name();
  for (const auto& [key, value] : j.items()) {
    const bool known =
        std::any_of(kFields.begin(), kFields.end(), [&](const Field& f) { return key == f.name; });
    if (!known)
      return "unknown field '" + key + "'";
  }
  for (const Field& f : kFields) {
    const auto it = j.find(f.name);
    const bool present = it != j.end();
    const std::string field = std::string("field '") + f.name + "'";
    std::string error;
    std::visit(
        [&](auto member) {
          using T = std::remove_cvref_t<decltype(m.*member)>;
          if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, std::optional<int64_t>>) {
            if (!present) {
              if constexpr (std::is_same_v<T, int64_t>)
                error = "missing " + field;
              else
                m.*member = std::nullopt;
            } else if (!it->is_number_integer()) {
              error = field + " must be an integer, found " + it->dump();
            } else if (it->is_number_unsigned() &&
                       it->template get<uint64_t>() >
                           static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
              error = field + " does not fit in int64: " + it->dump();
            } else {
              m.*member = it->template get<int64_t>();
            }
          } else {
            // double or optional<double>: a number, or null for a non-finite value.
            if (!present) {
              if constexpr (std::is_same_v<T, double>)
                error = "missing " + field;
              else
                m.*member = std::nullopt;
            } else if (it->is_null()) {
              m.*member = std::numeric_limits<double>::quiet_NaN();
            } else if (!it->is_number()) {
              error = field + " must be a number, found " + it->dump();
            } else {
              m.*member = it->template get<double>();
            }
          }
        },
        f.member);
    if (!error.empty())
      return error;
  }
  return "";
}

std::string errno_text() {
  return std::strerror(errno);
}

// nlohmann's messages start with "[json.exception.parse_error.101] ": noise for a user.
std::string strip_json_prefix(std::string what) {
  if (!what.empty() && what.front() == '[') {
    const auto end = what.find("] ");
    if (end != std::string::npos)
      what.erase(0, end + 2);
  }
  return what;
}

std::string read_whole_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw std::runtime_error("cannot read metrics file '" + path + "': " + errno_text());
  std::ostringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

}  // namespace

std::string to_json_line(const StepMetrics& m) {
  Json j = Json::object();
  for (const Field& f : kFields) {
    std::visit(
        [&](auto member) {
          using T = std::remove_cvref_t<decltype(m.*member)>;
          if constexpr (std::is_same_v<T, int64_t>)
            j[f.name] = m.*member;
          else if constexpr (std::is_same_v<T, double>)
            j[f.name] = double_to_json(m.*member);
          else if constexpr (std::is_same_v<T, std::optional<int64_t>>) {
            if ((m.*member).has_value())
              j[f.name] = *(m.*member);
          } else if ((m.*member).has_value()) {
            j[f.name] = double_to_json(*(m.*member));
          }
        },
        f.member);
  }
  return j.dump();
}

std::vector<TensorBoardScalar> tensorboard_scalars(const StepMetrics& m) {
  std::vector<TensorBoardScalar> out;
  for (const Field& f : kFields) {
    if (!f.tensorboard_tag)
      continue;
    std::visit(
        [&](auto member) {
          using T = std::remove_cvref_t<decltype(m.*member)>;
          if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, double>)
            out.push_back({f.tensorboard_tag, static_cast<double>(m.*member)});
          else if ((m.*member).has_value())
            out.push_back({f.tensorboard_tag, static_cast<double>(*(m.*member))});
        },
        f.member);
  }
  return out;
}

// ---- MetricsWriter -------------------------------------------------------------------------

MetricsWriter::MetricsWriter(const std::string& path, std::optional<int64_t> first_step)
    : path_(path) {
  std::error_code ec;
  if (std::filesystem::exists(path_, ec) && std::filesystem::file_size(path_, ec) > 0) {
    const std::string old = read_whole_file(path_);
    std::string kept;
    kept.reserve(old.size());
    int64_t dropped_steps = 0;
    size_t pos = 0;
    int64_t line_no = 0;
    while (pos < old.size()) {
      const size_t nl = old.find('\n', pos);
      if (nl == std::string::npos) {
        // Every line the writer completes ends in '\n', so a tail without one is a line that a
        // killed run did not finish. Appending after it would glue two lines into one.
        std::cerr << "metrics: dropping an incomplete last line of '" << path_
                  << "' (a previous run was killed while writing it)\n";
        break;
      }
      ++line_no;
      const std::string line = old.substr(pos, nl - pos);
      pos = nl + 1;
      if (first_step.has_value() && !line.empty()) {
        if (const auto deep = fsdp::json_too_deep(line); !deep.empty())
          throw std::runtime_error(path_ + ":" + std::to_string(line_no) + ": " + deep);
        const Json j = Json::parse(line, nullptr, /*allow_exceptions=*/false);
        const auto it = j.is_object() ? j.find("step") : j.end();
        if (it == j.end() || !it->is_number_integer())
          throw std::runtime_error(path_ + ":" + std::to_string(line_no) +
                                   ": no integer 'step' in this line; cannot drop the steps a "
                                   "resumed run logs again (fix or move the file)");
        if (it->get<int64_t>() >= *first_step) {
          ++dropped_steps;
          continue;
        }
      }
      kept += line;
      kept += '\n';
    }
    if (kept.size() != old.size()) {
      if (dropped_steps > 0)
        std::cerr << "metrics: dropping " << dropped_steps
                  << " line(s) with step >= " << *first_step << " from '" << path_
                  << "' (this resumed run logs them again)\n";
      // Rewrite through a temporary and rename, so that a crash now loses nothing.
      const std::string tmp = path_ + ".tmp";
      {
        std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
        out << kept;
        out.flush();
        if (!out)
          throw std::runtime_error("cannot write '" + tmp + "': " + errno_text());
      }
      std::filesystem::rename(tmp, path_, ec);
      if (ec)
        throw std::runtime_error("cannot replace '" + path_ + "': " + ec.message());
    }
  }
  file_ = std::fopen(path_.c_str(), "a");
  if (file_ == nullptr)
    throw std::runtime_error("cannot open metrics file '" + path_ +
                             "' for appending: " + errno_text());
}

MetricsWriter::~MetricsWriter() {
  if (file_ != nullptr)
    std::fclose(file_);
}

void MetricsWriter::append(const StepMetrics& m) {
  const std::string line = to_json_line(m) + '\n';
  // One fwrite + fflush per line: the line reaches the kernel whole before the next step, so a
  // killed process leaves complete lines (a crash of the machine may still lose the tail).
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0)
    throw std::runtime_error("cannot write metrics file '" + path_ + "': " + errno_text());
}

// ---- read_metrics --------------------------------------------------------------------------

std::vector<StepMetrics> read_metrics(const std::string& path) {
  const std::string text = read_whole_file(path);
  std::vector<StepMetrics> out;
  size_t pos = 0;
  int64_t line_no = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    const bool terminated = nl != std::string::npos;
    if (!terminated)
      nl = text.size();
    ++line_no;
    std::string line = text.substr(pos, nl - pos);
    pos = nl + 1;
    if (!line.empty() && line.back() == '\r')
      line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos)
      continue;
    const std::string where = path + ":" + std::to_string(line_no) + ": ";
    const std::string hint =
        terminated ? "" : " (last line has no newline: the run was probably killed mid-write)";
    if (const auto deep = fsdp::json_too_deep(line); !deep.empty())
      throw std::runtime_error(where + deep);
    Json j;
    try {
      j = Json::parse(line);
    } catch (const Json::parse_error& e) {
      throw std::runtime_error(where + "not valid JSON: " + strip_json_prefix(e.what()) + hint);
    }
    StepMetrics m;
    const std::string error = from_json(j, m);
    if (!error.empty())
      throw std::runtime_error(where + error + hint);
    out.push_back(m);
  }
  return out;
}

// ---- Breakdown -----------------------------------------------------------------------------

Breakdown compute_breakdown(const std::vector<StepMetrics>& steps, int64_t skip_first) {
  if (skip_first < 0)
    throw std::invalid_argument("breakdown: skip_first must be >= 0, got " +
                                std::to_string(skip_first));
  if (steps.empty())
    throw std::invalid_argument("breakdown: no steps recorded");
  Breakdown b;
  const auto n_total = static_cast<int64_t>(steps.size());
  int64_t begin = skip_first;
  if (begin >= n_total) {
    begin = 0;
    b.warmup_skipped = skip_first == 0;
  }
  b.first_step = steps[begin].step;
  b.last_step = steps.back().step;
  b.num_steps = n_total - begin;

  double fwd = 0, bwd = 0, ag = 0, ag_fwd = 0, rs = 0, opt = 0, total = 0;
  for (int64_t i = begin; i < n_total; ++i) {
    const StepMetrics& s = steps[i];
    fwd += s.time_forward_s;
    bwd += s.time_backward_s;
    ag += s.time_allgather_wait_s;
    ag_fwd += s.time_allgather_wait_forward_s;
    rs += s.time_reducescatter_wait_s;
    opt += s.time_optimizer_s;
    total += s.step_time_s;
    b.tokens_per_second += s.tokens_per_second;
    b.mfu += s.mfu;
    b.allgather_bytes += static_cast<double>(s.allgather_bytes);
    b.reducescatter_bytes += static_cast<double>(s.reducescatter_bytes);
    b.allreduce_bytes += static_cast<double>(s.allreduce_bytes);
    if (s.tp_bytes)
      b.tp_bytes = b.tp_bytes.value_or(0) + static_cast<double>(*s.tp_bytes);
  }
  if (b.tp_bytes)
    *b.tp_bytes /= static_cast<double>(b.num_steps);
  const double n = static_cast<double>(b.num_steps);
  for (double* v : {&fwd, &bwd, &ag, &ag_fwd, &rs, &opt, &total, &b.tokens_per_second, &b.mfu,
                    &b.allgather_bytes, &b.reducescatter_bytes, &b.allreduce_bytes})
    *v /= n;
  for (const StepMetrics& s : steps)
    b.peak_bytes = std::max(b.peak_bytes, s.peak_bytes);

  // Note [Waits inside phases]: take the waits out of the phases they happened in.
  double fwd_compute = fwd - ag_fwd;
  double bwd_compute = bwd - (ag - ag_fwd) - rs;
  double other = total - fwd - bwd - opt;
  // Below this, a negative remainder is rounding, not an inconsistency worth a warning.
  const double tolerance = 1e-6 * std::max(total, 1e-9);
  if (fwd_compute < -tolerance)
    b.warning += "forward time is shorter than the all-gather wait attributed to it; ";
  if (bwd_compute < -tolerance)
    b.warning +=
        "backward time is shorter than the waits attributed to it (is "
        "time_allgather_wait_forward_s set?); ";
  if (other < -tolerance)
    b.warning += "forward + backward + optimizer take longer than the step; ";
  if (!b.warning.empty())
    b.warning.resize(b.warning.size() - 2);
  fwd_compute = std::max(fwd_compute, 0.0);
  bwd_compute = std::max(bwd_compute, 0.0);
  other = std::max(other, 0.0);

  const auto row = [&](const char* name, double seconds) {
    b.rows.push_back({name, seconds, total > 0 ? 100.0 * seconds / total : 0.0});
  };
  row("Forward pass", fwd_compute);
  row("Backward pass", bwd_compute);
  row("All-gather wait (not hidden)", ag);
  row("Gradient reduce wait (not hidden)", rs);  // reduce-scatter + all-reduce
  row("Optimizer step", opt);
  row("Other", other);
  row("Total", total);
  return b;
}

std::string breakdown_table(const std::vector<StepMetrics>& steps, int64_t skip_first) {
  const Breakdown b = compute_breakdown(steps, skip_first);
  std::string out;
  std::array<char, 512> buf{};
  const auto line = [&](const char* fmt, auto... args) {
    std::snprintf(buf.data(), buf.size(), fmt, args...);
    out += buf.data();
  };
  const auto steps_long = static_cast<long long>(b.num_steps);
  const char* noun = b.num_steps == 1 ? "step" : "steps";
  if (b.warmup_skipped)
    line(
        "Step-time breakdown, mean of steps %lld..%lld (%lld %s; first %lld skipped as "
        "warm-up)\n",
        static_cast<long long>(b.first_step), static_cast<long long>(b.last_step), steps_long, noun,
        static_cast<long long>(skip_first));
  else
    line(
        "Step-time breakdown, mean of steps %lld..%lld (%lld %s; too few to skip %lld as "
        "warm-up, so all are included)\n",
        static_cast<long long>(b.first_step), static_cast<long long>(b.last_step), steps_long, noun,
        static_cast<long long>(skip_first));
  line("%-34s %10s %9s\n", "Component", "s/step", "% of step");
  for (const BreakdownRow& r : b.rows)
    line("%-34s %10.5f %8.1f%%\n", r.name.c_str(), r.seconds, r.percent);
  out +=
      "(Forward and backward exclude the collective waits inside them; the rows sum to Total.)\n";
  if (!b.warning.empty())
    out += "warning: " + b.warning + "\n";
  const auto bytes = [](double v) { return fsdp::memory::format_bytes(std::llround(v)); };
  line(
      "tokens/s %.1f | MFU %.2f%% | peak memory %s | per step: all-gather %s, reduce-scatter "
      "%s, all-reduce %s%s\n",
      b.tokens_per_second, 100.0 * b.mfu, fsdp::memory::format_bytes(b.peak_bytes).c_str(),
      bytes(b.allgather_bytes).c_str(), bytes(b.reducescatter_bytes).c_str(),
      bytes(b.allreduce_bytes).c_str(),
      b.tp_bytes
          ? (", tensor parallel " + bytes(*b.tp_bytes) + " (inside forward and backward)").c_str()
          : "");
  return out;
}

// ---- FLOPs and MFU -------------------------------------------------------------------------

double gpt_flops_per_token(int64_t n_params, int64_t n_layer, int64_t n_embd, int64_t seq_len) {
  if (n_params < 0 || n_layer < 0 || n_embd < 0 || seq_len < 0)
    throw std::invalid_argument("gpt_flops_per_token: arguments must be >= 0");
  return 6.0 * static_cast<double>(n_params) + 12.0 * static_cast<double>(n_layer) *
                                                   static_cast<double>(n_embd) *
                                                   static_cast<double>(seq_len);
}

double model_flops_utilization(double flops_per_token, double tokens_per_second,
                               double peak_flops) {
  if (peak_flops <= 0)
    return 0;
  return flops_per_token * tokens_per_second / peak_flops;
}

}  // namespace fsdp_trainer
