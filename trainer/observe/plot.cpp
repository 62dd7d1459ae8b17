// write_plot: a data file and a gnuplot script in a private temporary directory, gnuplot run on
// them with posix_spawnp (no shell, so no quoting of the command line), the PNG renamed into
// place only once gnuplot has succeeded.
#include "plot.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

extern char** environ;

namespace fsdp_trainer {
namespace {

namespace fs = std::filesystem;

[[noreturn]] void fail(const std::string& png_path, const std::string& why) {
  throw std::runtime_error("cannot draw " + png_path + ": " + why);
}

// A mkdtemp directory, removed with its contents when the plot is done or has failed.
class TempDir {
 public:
  explicit TempDir(const std::string& png_path) {
    std::string tmpl = (fs::temp_directory_path() / "fsdp-plot-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr)
      fail(png_path, std::string("cannot create a temporary directory: ") + std::strerror(errno));
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// A gnuplot single-quoted string: only '' is special inside. Newlines would end the command.
std::string gp_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'')
      out += "''";
    else if (c == '\n' || c == '\r')
      out += ' ';
    else
      out += c;
  }
  return out + "'";
}

// '?' is declared the missing-value marker in the script; gnuplot then skips the point.
std::string number_or_missing(double v) {
  if (!std::isfinite(v))
    return "?";
  std::array<char, 32> buf{};
  std::snprintf(buf.data(), buf.size(), "%.9g", v);
  return buf.data();
}

void write_data(const fs::path& file, const std::vector<StepMetrics>& steps) {
  std::ofstream out(file);
  out << "# step loss eval_loss tokens_per_second peak_MiB\n";
  for (const StepMetrics& s : steps) {
    out << s.step << ' ' << number_or_missing(s.loss) << ' '
        << number_or_missing(s.eval_loss.value_or(NAN)) << ' '
        << number_or_missing(s.tokens_per_second) << ' '
        << number_or_missing(static_cast<double>(s.peak_bytes) / (1024.0 * 1024.0)) << '\n';
  }
}

std::string script(const std::vector<StepMetrics>& steps, const fs::path& data,
                   const std::string& png_tmp, const std::string& title) {
  bool any_eval = false;
  for (const StepMetrics& s : steps)
    any_eval = any_eval || s.eval_loss.has_value();
  // A line through a handful of points hides them; show the points on short runs.
  const std::string style = steps.size() <= 50 ? "linespoints pt 7 ps 0.6" : "lines";
  const auto [lo, hi] = std::minmax_element(
      steps.begin(), steps.end(),
      [](const StepMetrics& a, const StepMetrics& b) { return a.step < b.step; });
  const int64_t span = hi->step - lo->step;
  const std::string d = gp_quote(data.string());
  std::ostringstream gp;
  // noenhanced: run names like "gpt_small" must not turn into subscripts.
  gp << "set terminal pngcairo size 1000,1200 noenhanced font ',10'\n"
     << "set output " << gp_quote(png_tmp) << "\n"
     << "set datafile missing '?'\n"
     << "set multiplot layout 3,1 title " << gp_quote(title) << " font ',13'\n"
     << "set grid\nset key top right\nset xlabel 'step'\n"
     << "set lmargin 12\n"  // same left margin in every panel, so the step axes line up
     // A small margin instead of rounding the step axis out to the next tic, so that the first
     // and last points are not drawn on the frame.
     << "set autoscale xfix\nset offsets graph 0.01, graph 0.01, 0, 0\n"
     // Steps are integers: on a short run gnuplot would otherwise put tics at 1.5, 2.5.
     << (span < 10 ? "set xtics 1\n" : "") << "set title 'Loss'\nset ylabel 'loss'\n"
     << "plot " << d << " using 1:2 with " << style << " lw 1.5 title 'train'";
  // A plot clause with no valid point at all is an error in gnuplot, so only if eval ran.
  if (any_eval)
    gp << ", " << d << " using 1:3 with linespoints pt 7 ps 1 lw 1.5 title 'eval'";
  gp << "\n"
     // From zero: a 2% wobble in throughput or memory must not look like a cliff.
     << "set yrange [0:*]\n"
     << "set title 'Throughput'\nset ylabel 'tokens/s'\n"
     << "plot " << d << " using 1:4 with " << style << " lw 1.5 notitle\n"
     << "set title 'Memory'\nset ylabel 'peak tensor memory (MiB)'\n"
     << "plot " << d << " using 1:5 with " << style << " lw 1.5 notitle\n"
     << "unset multiplot\nunset output\n";
  return gp.str();
}

// gnuplot reports an error as the offending line, a caret, then '"file" line N: message'.
std::string last_nonempty_line(const fs::path& log) {
  std::ifstream in(log);
  std::string line, last;
  while (std::getline(in, line))
    if (line.find_first_not_of(" \t\r") != std::string::npos)
      last = line;
  return last;
}

void run_gnuplot(const std::string& png_path, const fs::path& script_file, const fs::path& log) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  std::string prog = "gnuplot", arg = script_file.string();
  char* argv[] = {prog.data(), arg.data(), nullptr};
  pid_t pid = 0;
  // posix_spawn rather than fork: the trainer has Gloo and intra-op threads running.
  const int rc = ::posix_spawnp(&pid, "gnuplot", &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc == ENOENT)
    fail(png_path, "gnuplot not found (apt-get install gnuplot-nox)");
  if (rc != 0)
    fail(png_path, std::string("cannot run gnuplot: ") + std::strerror(rc));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR)
      fail(png_path, std::string("waitpid on gnuplot failed: ") + std::strerror(errno));
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 127)  // a shell-style "not found"
    fail(png_path, "gnuplot not found (apt-get install gnuplot-nox)");
  if (WIFSIGNALED(status))
    fail(png_path, "gnuplot was killed by signal " + std::to_string(WTERMSIG(status)));
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    const std::string why = last_nonempty_line(log);
    fail(png_path, "gnuplot failed (exit " + std::to_string(WEXITSTATUS(status)) + ")" +
                       (why.empty() ? "" : ": " + why));
  }
}

}  // namespace

void write_plot(const std::vector<StepMetrics>& steps, const std::string& png_path,
                const std::string& title) {
  if (steps.empty())
    fail(png_path, "no steps to plot");
  const fs::path target(png_path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    fail(png_path, "directory '" + dir.string() + "' does not exist");

  TempDir tmp(png_path);
  const fs::path data = tmp.path() / "metrics.dat";
  const fs::path gp_file = tmp.path() / "plot.gp";
  const fs::path log = tmp.path() / "gnuplot.log";
  // Same directory as the target, so that the final rename cannot cross filesystems.
  const std::string png_tmp = png_path + ".tmp." + std::to_string(::getpid());
  write_data(data, steps);
  {
    std::ofstream out(gp_file);
    out << script(steps, data, png_tmp, title);
    if (!out)
      fail(png_path, "cannot write the gnuplot script in " + tmp.path().string());
  }
  try {
    run_gnuplot(png_path, gp_file, log);
    if (fs::file_size(png_tmp, ec) == 0 || ec)
      fail(png_path, "gnuplot exited normally but wrote no image");
    fs::rename(png_tmp, target, ec);
    if (ec)
      fail(png_path, "cannot rename " + png_tmp + " into place: " + ec.message());
  } catch (...) {
    fs::remove(png_tmp, ec);
    throw;
  }
}

}  // namespace fsdp_trainer
