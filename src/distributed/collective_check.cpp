// See collective_check.h.
#include "collective_check.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <c10/util/Exception.h>

#include <charconv>
#include <cstdlib>
#include <map>
#include <sstream>
#include <stdexcept>

namespace fsdp::detail {
namespace {

std::vector<uint8_t> to_bytes(const std::string& s) {
  return {s.begin(), s.end()};
}

std::vector<std::string> split_lines(const std::vector<uint8_t>& bytes) {
  std::vector<std::string> out;
  std::string line;
  for (uint8_t c : bytes) {
    if (c == '\n') {
      out.push_back(std::move(line));
      line.clear();
    } else {
      line.push_back(static_cast<char>(c));
    }
  }
  return out;
}

}  // namespace

CollectiveCheck::CollectiveCheck(c10::intrusive_ptr<c10d::Store> store, int rank,
                                 std::vector<int> global_ranks, int every,
                                 std::chrono::milliseconds timeout)
    : store_(std::move(store)),
      rank_(rank),
      global_ranks_(std::move(global_ranks)),
      every_(every),
      timeout_(timeout) {
  TORCH_CHECK(every_ >= 1, "check_collectives must be at least 1, got ", every_);
}

std::string CollectiveCheck::key(uint64_t round, int rank) const {
  return "fsdp/check/" + std::to_string(round) + "/" + std::to_string(rank);
}

void CollectiveCheck::before(std::string description) {
  // One description per line: a newline inside one would shift the comparison.
  for (auto& c : description) {
    if (c == '\n')
      c = ' ';
  }
  pending_.push_back(std::move(description));
  ++count_;
  if (pending_.size() >= static_cast<size_t>(every_))
    exchange();
}

void CollectiveCheck::exchange() {
  const int size = static_cast<int>(global_ranks_.size());
  const int me = global_ranks_[static_cast<size_t>(rank_)];
  const uint64_t first = count_ - pending_.size() + 1;  // number of the round's first collective
  std::string mine;
  for (const auto& d : pending_)
    mine += d + "\n";
  store_->set(key(round_, rank_), to_bytes(mine));

  std::vector<std::vector<std::string>> all(static_cast<size_t>(size));
  all[static_cast<size_t>(rank_)] = pending_;
  for (int r = 0; r < size; ++r) {
    if (r == rank_)
      continue;
    try {
      store_->wait({key(round_, r)}, timeout_);
    } catch (const std::exception&) {
      TORCH_CHECK(false, "[rank ", me, "] collective check: rank ", global_ranks_[size_t(r)],
                  " did not reach collective #", count_, " of this group within ", timeout_.count(),
                  " ms (it may be blocked in a collective the others did not "
                  "issue, or may have stopped); this rank's collective #",
                  count_, " is '", pending_.back(), "'");
    }
    all[static_cast<size_t>(r)] = split_lines(store_->get(key(round_, r)));
  }
  // The first position where some rank differs: report what every rank issues there.
  for (size_t i = 0; i < pending_.size(); ++i) {
    bool differ = false;
    for (const auto& seq : all)
      differ = differ || i >= seq.size() || seq[i] != pending_[i];
    if (!differ)
      continue;
    std::map<std::string, std::vector<int>> by_description;
    for (int r = 0; r < size; ++r) {
      const auto& seq = all[static_cast<size_t>(r)];
      by_description[i < seq.size() ? seq[i] : std::string("(nothing)")].push_back(
          global_ranks_[static_cast<size_t>(r)]);
    }
    std::ostringstream msg;
    msg << "[rank " << me << "] collective check: the " << size
        << " ranks of this group issue different collectives at #" << first + i << ":";
    for (const auto& [description, ranks] : by_description) {
      msg << (ranks.size() > 1 ? " ranks " : " rank ");
      for (size_t k = 0; k < ranks.size(); ++k)
        msg << (k ? "," : "") << ranks[k];
      msg << " '" << description << "';";
    }
    std::string text = msg.str();
    text.pop_back();
    pending_.clear();
    throw std::runtime_error(text);
  }
  // Every rank has read the previous round (it wrote this one after reading it): drop ours.
  if (round_ > 0)
    store_->deleteKey(key(round_ - 1, rank_));
  ++round_;
  pending_.clear();
}

int check_collectives_from_environment() {
  const char* v = std::getenv("FSDP_CHECK_COLLECTIVES");
  if (v == nullptr || *v == '\0')
    return 0;
  int n = 0;
  const char* end = v + std::char_traits<char>::length(v);
  auto [ptr, ec] = std::from_chars(v, end, n);
  if (ec != std::errc() || ptr != end || n < 0) {
    throw std::invalid_argument(std::string("FSDP_CHECK_COLLECTIVES=\"") + v +
                                "\" is not a non-negative integer (collectives per check)");
  }
  return n;
}

}  // namespace fsdp::detail
