// Training curves as a PNG: loss, throughput and memory over steps, drawn by gnuplot.
//
// gnuplot (Debian's gnuplot-nox, terminal pngcairo) is run as a child process on a data file and
// a script in a private temporary directory; nothing is linked. No gnuplot, no picture: the
// metrics log (metrics.h) is the record, the plot only a view of it.
#pragma once

#include <string>
#include <vector>

#include "metrics.h"

namespace fsdp_trainer {

/// Draws three panels over steps: loss (train line, eval points where eval_loss is set),
/// throughput (tokens/s) and memory (peak_bytes in MiB), under `title`. The PNG appears at
/// `png_path` atomically (drawn under a temporary name in the same directory, then renamed), so
/// a reader never sees half a file and a failed draw leaves the previous picture in place.
/// Throws std::runtime_error with one line, e.g.
///   "cannot draw out/loss.png: gnuplot not found (apt-get install gnuplot-nox)".
void write_plot(const std::vector<StepMetrics>& steps, const std::string& png_path,
                const std::string& title);

}  // namespace fsdp_trainer
