// The trainer's metadata in a sharded checkpoint's index (step, world size, sampler position,
// loss scaler, the previous step's gradient norm, each saving rank's random state), read back
// with errors that name the index file and the key. The index's own checksum catches edits;
// these catch a writer that saved nonsense.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include <fsdp/checkpoint/safetensors.h>

namespace fsdp_trainer {

class CheckpointMeta {
 public:
  /// `meta` as fsdp::load_sharded returns it; `index`: its file, for the messages.
  CheckpointMeta(std::map<std::string, std::string> meta, std::string index);

  /// A non-negative integer; missing, not an integer or negative: a FormatError.
  int64_t count(const std::string& key) const;
  /// A finite number > 0 (positive) or >= 0 (non_negative); nullopt when absent.
  std::optional<double> positive(const std::string& key) const;
  std::optional<double> non_negative(const std::string& key) const;
  /// The random state rank `rank` saved, if it was one of the saving ranks.
  std::optional<std::string> rng_state(int rank) const;
  const std::string& text(const std::string& key) const;
  bool has(const std::string& key) const { return meta_.count(key) > 0; }

  /// Checks that every rank of the `world` that saved left its random state ("rng.<rank>"),
  /// and that no "rng.*" key names another rank. A fault-tolerant job's checkpoint names the
  /// ranks that saved it ("live_ranks": "0,2,3", ascending, of the world): those and only
  /// those.
  void check_random_states(int64_t world) const;

  /// An error about `key`, naming the index: "<index>: metadata '<key>' <what>".
  fsdp::safetensors::FormatError bad(const std::string& key, const std::string& what) const;
  const std::string& index() const { return index_; }

 private:
  std::optional<double> finite(const std::string& key, bool zero_allowed) const;

  std::map<std::string, std::string> meta_;
  std::string index_;
};

}  // namespace fsdp_trainer
