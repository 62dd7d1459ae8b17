// TensorBoard event files: what `tensorboard --logdir` reads, written without TensorFlow or a
// protobuf library (logging.tensorboard, rank 0 only).
//
// An event file is a sequence of TFRecords, each
//   uint64 length (little-endian) | uint32 masked CRC-32C of those 8 bytes | data |
//   uint32 masked CRC-32C of data
// with masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8, and data a serialized tensorflow.Event.
// The first event carries file_version "brain.Event:2"; then one SessionLog START at the first
// step this writer logs (see TensorBoardWriter), then one event per step whose Summary holds
// that step's scalars (Value {tag, simple_value}).
//
// simple_value is a float32 in TensorBoard's format: byte counts above 2^24 keep about seven
// significant digits there (metrics.jsonl has them exact).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <fsdp/core/file.h>

namespace fsdp_trainer {

struct TensorBoardScalar {
  std::string tag;   // "train/loss": TensorBoard groups the charts by the part before the slash
  double value = 0;  // stored as float32; NaN and infinities are kept (a diverged loss shows)
};

/// One TFRecord around `data`: length, masked CRC of the length, data, masked CRC of the data.
std::string tfrecord(std::string_view data);

/// Writes one event file, record by record. Each step's event reaches the file with one
/// write(2) before write_scalars returns (no user-space buffer), so a crashed or killed run
/// loses nothing it logged and a running TensorBoard sees each step as it is written.
class TensorBoardWriter {
 public:
  /// Creates `dir` if needed and in it a new file events.out.tfevents.<unix time, 10
  /// digits>.<hostname>.<pid> (the name TensorBoard looks for; `dir` is one run to TensorBoard).
  /// The file appears whole, with its first records (file version and a SessionLog START at
  /// `first_step`), or not at all: they are written to a temporary name and linked into
  /// place, which also refuses to replace an existing file. The START event makes TensorBoard
  /// drop the steps >= first_step that earlier files in `dir` hold: a run resumed from a
  /// checkpoint logs again the steps made after that checkpoint. Throws std::runtime_error
  /// "<path>: <what failed>: <reason>".
  TensorBoardWriter(const std::string& dir, int64_t first_step);

  /// Appends one event at `step` (the optimizer step) with `values` as its summary, stamped
  /// with `wall_time` (seconds since the epoch; now by default). Throws on a failed write.
  void write_scalars(int64_t step, const std::vector<TensorBoardScalar>& values,
                     std::optional<double> wall_time = {});

  const std::string& path() const { return file_.path(); }

 private:
  fsdp::File file_;
};

/// The name of an event file: starts with "events.out.tfevents.".
bool is_tensorboard_event_file(const std::string& file_name);

}  // namespace fsdp_trainer
