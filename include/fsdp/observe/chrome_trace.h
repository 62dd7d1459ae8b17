// The recorder's spans (fsdp/core/trace.h) as a Chrome trace: one JSON file per rank, which
// Perfetto (ui.perfetto.dev) and chrome://tracing open, laid out as one process per rank and
// one row per thread or track.
//
// The fields are those of PyTorch's profiler (Kineto) traces, so that Holistic Trace Analysis
// finds what it reads: top-level "distributedInfo" {"rank", "world_size"} first (HTA finds the
// rank by matching `"rank": <n>` in the text) and "traceEvents", one event per line;
// every span a complete event ("ph": "X", "cat": "user_annotation", "name", "pid" = the rank,
// "tid", "ts" and "dur" in microseconds with three decimals, "args" {"kind", "step", "for",
// "bytes"}); "M" metadata events name each process "rank N" and each thread. Times are the
// steady clock, which the ranks of one machine share, so their timelines line up.
#pragma once

#include <string>
#include <vector>

#include <fsdp/core/trace.h>

namespace fsdp {

/// The trace of one rank as JSON text, the events of each thread sorted by start (enclosing
/// spans first).
std::string chrome_trace(const std::vector<trace::ThreadSpans>& threads, int rank, int world_size);

/// Writes chrome_trace() to `path` (parent directories created, replaced atomically). Throws
/// std::runtime_error naming the path.
void write_chrome_trace(const std::string& path, const std::vector<trace::ThreadSpans>& threads,
                        int rank, int world_size);

}  // namespace fsdp
