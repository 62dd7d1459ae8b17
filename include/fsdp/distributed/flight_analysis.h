// Reading a job's flight-recorder dumps (flight_recorder.h) together: the first collective
// where the ranks disagree, who never joined it, and where each rank stopped. What
// torchfrtrace does for PyTorch's NCCL dumps; `fsdp-train fr-analyze DIR` prints it.
//
// A collective's number within its group is the same on every member, so the dumps line up
// by (group, number). Walking each group's numbers from the oldest every rank still holds, the
// first one where members differ is the answer:
//  - some issued it and others issued a different collective under that number: a desync
//    (a rank skipped a unit, or ran another branch); the ranks in the minority are named;
//  - some issued it and others never did: those never joined (stalled, or hung elsewhere);
//  - a member left no dump at all (killed, or stopped so it could not write one): it is named,
//    with what the others last heard of it (flight_recorder.h's PeerReport).
#pragma once

#include <string>
#include <vector>

namespace fsdp {

struct FlightAnalysis {
  /// The report, several lines, as fr-analyze prints it.
  std::string text;
  /// The group and number of the first collective where the ranks disagree (0: none found).
  std::string group;
  uint64_t seq = 0;
  /// The ranks to blame for it (never joined it, issued something else, or left no dump).
  std::vector<int> culprits;
  /// "desync", "not joined", "no dump" or "" (no disagreement found).
  std::string kind;
  /// Who issued that collective on the ranks that did (its context: "unit 'h3'"), and on the
  /// culprits when they issued something else.
  std::string context, culprit_context;
  /// Ranks of the job that left no dump.
  std::vector<int> missing_dumps;
};

/// Reads every rank<R>.json in `dir` and analyses them. Throws std::runtime_error naming the
/// file for an unreadable or malformed dump, or when `dir` holds none.
FlightAnalysis analyze_flight_dumps(const std::string& dir);

}  // namespace fsdp
