// See checkpoint_meta.h.
#include "checkpoint_meta.h"

#include <charconv>
#include <cmath>
#include <set>
#include <system_error>
#include <utility>

namespace fsdp_trainer {

CheckpointMeta::CheckpointMeta(std::map<std::string, std::string> meta, std::string index)
    : meta_(std::move(meta)), index_(std::move(index)) {}

fsdp::safetensors::FormatError CheckpointMeta::bad(const std::string& key,
                                                   const std::string& what) const {
  return fsdp::safetensors::FormatError(index_ + ": metadata '" + key + "' " + what);
}

const std::string& CheckpointMeta::text(const std::string& key) const {
  auto it = meta_.find(key);
  if (it == meta_.end())
    throw bad(key, "is missing");
  return it->second;
}

int64_t CheckpointMeta::count(const std::string& key) const {
  const auto& text = this->text(key);
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size())
    throw bad(key, "is not an integer");
  if (v < 0)
    throw bad(key, "is negative (" + text + ")");
  return v;
}

std::optional<double> CheckpointMeta::finite(const std::string& key, bool zero_allowed) const {
  if (!has(key))
    return std::nullopt;
  const auto& text = this->text(key);
  double v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || !std::isfinite(v) || v < 0 ||
      (v == 0 && !zero_allowed))
    throw bad(key,
              zero_allowed ? "is not a finite number >= 0" : "is not a positive finite number");
  return v;
}

std::optional<double> CheckpointMeta::positive(const std::string& key) const {
  return finite(key, false);
}

std::optional<double> CheckpointMeta::non_negative(const std::string& key) const {
  return finite(key, true);
}

std::optional<std::string> CheckpointMeta::rng_state(int rank) const {
  auto it = meta_.find("rng." + std::to_string(rank));
  if (it == meta_.end())
    return std::nullopt;
  return it->second;
}

void CheckpointMeta::check_random_states(int64_t world) const {
  // The saving ranks: "live_ranks" where a fault-tolerant job saved, else the whole world.
  std::set<int64_t> saved;
  if (has("live_ranks")) {
    const std::string& list = text("live_ranks");
    const char* p = list.data();
    const char* const end = p + list.size();
    while (p < end) {
      int64_t r = -1;
      const auto [next, ec] = std::from_chars(p, end, r);
      if (ec != std::errc() || r < 0 || r >= world || (!saved.empty() && r <= *saved.rbegin()) ||
          (next != end && (*next != ',' || next + 1 == end)))
        throw bad("live_ranks", "is not a list of ascending ranks below world_size (" +
                                    std::to_string(world) + "): '" + list + "'");
      saved.insert(r);
      p = next == end ? end : next + 1;
    }
    if (saved.empty())
      throw bad("live_ranks", "is empty");
  }
  const bool listed = !saved.empty();  // else every rank below world saved
  const int64_t savers = listed ? static_cast<int64_t>(saved.size()) : world;
  std::set<int64_t> present;
  for (const auto& [key, value] : meta_) {
    if (!key.starts_with("rng."))
      continue;
    int64_t r = -1;
    const auto [end, ec] = std::from_chars(key.data() + 4, key.data() + key.size(), r);
    if (ec != std::errc() || end != key.data() + key.size() || r < 0 || r >= world ||
        (listed && !saved.count(r)))
      throw bad(key, "names no rank of the " + std::to_string(savers) + " that saved it");
    present.insert(r);
  }
  // The first saving rank without its state; found among the present ones and one more, so
  // that a huge world_size costs nothing.
  const auto missing = [&](int64_t r) {
    return bad("rng." + std::to_string(r),
               "is missing (world_size is " + std::to_string(world) + ")");
  };
  if (listed) {
    for (const int64_t r : saved)
      if (!present.count(r))
        throw missing(r);
  } else if (static_cast<int64_t>(present.size()) < world) {
    int64_t r = 0;
    while (present.count(r))
      ++r;
    throw missing(r);
  }
}

}  // namespace fsdp_trainer
