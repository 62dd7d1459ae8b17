// The merge of flight-recorder dumps (flight_analysis.h).
#include <fsdp/distributed/flight_analysis.h>

#include <fcntl.h>
#include <sys/stat.h>

#include <fsdp/core/json_depth.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>

#include <fsdp/core/file.h>

namespace fsdp {

namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

// A dump is at most capacity x a few hundred bytes: 64 MiB is far above any real one, and
// bounds what a wrong file (a link to /dev/zero, a huge log) makes us read.
constexpr uint64_t kMaxDumpBytes = uint64_t{64} << 20;

struct Rec {
  std::string description, context, state, error;
  uint64_t seq = 0;
};

struct Dump {
  std::string path;
  int rank = 0, world_size = 0;
  std::string host, reason;
  std::map<std::string, std::map<uint64_t, Rec>> by_group;  // group -> seq -> record
  std::map<std::string, uint64_t> issued, completed;        // from "progress"
  std::map<std::string, std::vector<int>> groups;
  Json peers;
  Rec last_completed;
  std::string last_completed_group;
  Rec last;  // the newest record
  std::string last_group;
};

std::string read_capped(const std::string& path) {
  File f(path, O_RDONLY | O_NONBLOCK);  // O_NONBLOCK: a FIFO must not block the open
  struct stat st {};
  if (::fstat(f.fd(), &st) != 0 || !S_ISREG(st.st_mode))
    throw std::runtime_error(path + ": not a regular file");
  if (static_cast<uint64_t>(st.st_size) > kMaxDumpBytes)
    throw std::runtime_error(path + ": " + std::to_string(st.st_size) +
                             " bytes, more than a flight-recorder dump can be (64 MiB)");
  std::string bytes(static_cast<size_t>(st.st_size), '\0');
  const uint64_t got = f.pread_some(bytes.data(), bytes.size(), 0);
  bytes.resize(static_cast<size_t>(got));
  return bytes;
}

Dump load(const std::string& path) {
  Dump d;
  d.path = path;
  try {
    const std::string text = read_capped(path);
    if (const auto deep = json_too_deep(text); !deep.empty())
      throw std::runtime_error(deep);
    const Json j = Json::parse(text);
    if (j.value("format", std::string()) != "fsdp-cpp flight recorder")
      throw std::runtime_error("not an fsdp-cpp flight-recorder dump");
    d.rank = j.at("rank").get<int>();
    d.world_size = j.at("world_size").get<int>();
    if (d.world_size < 1 || d.rank < 0 || d.rank >= d.world_size)
      throw std::runtime_error("rank " + std::to_string(d.rank) + " of world size " +
                               std::to_string(d.world_size));
    d.host = j.value("host", std::string("?"));
    d.reason = j.value("reason", std::string());
    for (const auto& [g, p] : j.at("progress").items()) {
      d.issued[g] = p.at("issued").get<uint64_t>();
      d.completed[g] = p.at("completed").get<uint64_t>();
    }
    d.groups = j.at("groups").get<std::map<std::string, std::vector<int>>>();
    d.peers = j.value("peers", Json::array());
    for (const auto& r : j.at("records")) {
      Rec rec;
      rec.seq = r.at("seq").get<uint64_t>();
      rec.description = r.at("description").get<std::string>();
      rec.context = r.at("context").get<std::string>();
      rec.state = r.at("state").get<std::string>();
      rec.error = r.at("error").get<std::string>();
      const std::string g = r.at("group").get<std::string>();
      d.last = rec;
      d.last_group = g;
      if (rec.state == "completed") {
        d.last_completed = rec;
        d.last_completed_group = g;
      }
      if (rec.seq > 0)
        d.by_group[g][rec.seq] = std::move(rec);
    }
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(path + ": malformed flight-recorder dump: " + e.what());
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    if (what.rfind(path, 0) == 0)
      throw;
    throw std::runtime_error(path + ": " + what);
  }
  return d;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream s;
  s << (ranks.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < ranks.size(); ++i)
    s << (i ? "," : "") << ranks[i];
  return s.str();
}

std::string describe(const std::string& group, const Rec& r) {
  if (r.description.empty())
    return "nothing";
  std::string s = r.seq ? "#" + std::to_string(r.seq) + " of '" + group + "' " : "";
  return s + r.description + " (" + r.state + ")";
}

// What the surviving ranks last heard of `rank` (their progress reports at the failure).
std::string heard_of(const std::map<int, Dump>& dumps, int rank) {
  for (const auto& [r, d] : dumps) {
    for (const auto& p : d.peers) {
      if (p.value("rank", -1) != rank || !p.value("heard", false))
        continue;
      std::ostringstream s;
      s << "rank " << r << " heard from it " << p.value("age_s", 0.0) << " s before its failure ("
        << p.value("verdict", std::string("?")) << "; issued #" << p.value("issued", 0) << ": "
        << p.value("last", std::string()) << "; host " << p.value("host", std::string("?")) << ")";
      return s.str();
    }
  }
  return "no rank heard from it";
}

}  // namespace

FlightAnalysis analyze_flight_dumps(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw std::runtime_error(dir + ": not a directory of flight-recorder dumps");
  std::map<int, Dump> dumps;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("rank", 0) != 0 || entry.path().extension() != ".json")
      continue;
    Dump d = load(entry.path().string());
    if (dumps.count(d.rank))
      throw std::runtime_error(d.path + ": a second dump of rank " + std::to_string(d.rank));
    dumps.emplace(d.rank, std::move(d));
  }
  if (ec)
    throw std::runtime_error(dir + ": cannot list: " + ec.message());
  if (dumps.empty())
    throw std::runtime_error(dir + ": no flight-recorder dumps (rank<R>.json) in it");
  const int world = dumps.begin()->second.world_size;
  for (const auto& [r, d] : dumps) {
    if (d.world_size != world)
      throw std::runtime_error(d.path + ": world size " + std::to_string(d.world_size) + ", but " +
                               dumps.begin()->second.path + " says " + std::to_string(world) +
                               " (dumps of different jobs?)");
  }

  FlightAnalysis a;
  std::ostringstream out;
  for (int r = 0; r < world; ++r) {
    if (!dumps.count(r))
      a.missing_dumps.push_back(r);
  }
  out << "flight recorder: " << dumps.size() << " dump(s) of " << world << " rank(s) in " << dir
      << "\n";
  for (const auto& [r, d] : dumps)
    out << "  rank " << r << " (host " << d.host << "): " << d.reason << "\n";
  if (!a.missing_dumps.empty())
    out << "  no dump from " << rank_list(a.missing_dumps)
        << " (killed, or stopped before it could write one)\n";

  // Every group, "world" first (its failures are usually the cause of the subgroups').
  std::map<std::string, std::vector<int>> groups;
  for (const auto& [r, d] : dumps) {
    for (const auto& [g, ranks] : d.groups)
      groups[g] = ranks;
  }
  std::vector<std::string> order;
  if (groups.count("world"))
    order.push_back("world");
  for (const auto& [g, ranks] : groups) {
    if (g != "world")
      order.push_back(g);
  }

  for (const auto& g : order) {
    if (a.seq)
      break;
    const auto& members = groups[g];
    std::vector<int> dumped;
    uint64_t from = 1, to = 0;
    for (int r : members) {
      auto it = dumps.find(r);
      if (it == dumps.end())
        continue;
      dumped.push_back(r);
      const auto& recs = it->second.by_group[g];
      // Numbers older than a rank's ring are unknown: start where every rank still has them.
      if (!recs.empty())
        from = std::max(from, recs.begin()->first);
      to = std::max(to, it->second.issued[g]);
    }
    for (uint64_t s = from; s <= to && !a.seq; ++s) {
      std::map<std::string, std::vector<int>> by_description;
      std::vector<int> absent;
      bool all_completed = true;
      for (int r : dumped) {
        const auto& recs = dumps.at(r).by_group[g];
        auto it = recs.find(s);
        if (it == recs.end()) {
          absent.push_back(r);
          all_completed = false;
          continue;
        }
        by_description[it->second.description].push_back(r);
        all_completed &= it->second.state == "completed";
      }
      if (by_description.empty())
        continue;
      // The majority's collective is the one the group was running; the others are to blame.
      auto majority = std::max_element(
          by_description.begin(), by_description.end(),
          [](const auto& x, const auto& y) { return x.second.size() < y.second.size(); });
      auto context_of = [&](int r) { return dumps.at(r).by_group[g].at(s).context; };
      // This collective is the answer: what went wrong, and who issued it.
      auto found = [&](const char* kind) {
        a.kind = kind;
        a.group = g;
        a.seq = s;
        a.context = context_of(majority->second.front());
      };
      if (by_description.size() > 1) {
        found("desync");
        out << "group '" << g << "' (" << rank_list(members) << "): the ranks disagree at #" << s
            << ":\n";
        for (const auto& [desc, ranks] : by_description) {
          out << "  " << rank_list(ranks) << " issued " << desc << "\n";
          if (desc != majority->first) {
            a.culprits.insert(a.culprits.end(), ranks.begin(), ranks.end());
            a.culprit_context = context_of(ranks.front());
          }
        }
        if (by_description.size() == 2 && majority->second.size() * 2 == dumped.size())
          out << "  (as many ranks on each side: either side may be the one that diverged)\n";
      } else if (!absent.empty()) {
        found("not joined");
        a.culprits = absent;
        out << "group '" << g << "' (" << rank_list(members) << "): at #" << s << ", "
            << rank_list(majority->second) << " issued " << majority->first << ";\n  "
            << rank_list(absent) << " never joined it\n";
      } else if (!all_completed && !a.missing_dumps.empty()) {
        // Every dumped rank issued it and it did not complete: the ranks without a dump are
        // the ones it waited for.
        std::vector<int> missing;
        for (int r : members) {
          if (!dumps.count(r))
            missing.push_back(r);
        }
        if (missing.empty())
          continue;
        found("no dump");
        a.culprits = missing;
        out << "group '" << g << "' (" << rank_list(members) << "): #" << s << " ("
            << majority->first << ") did not complete on " << rank_list(majority->second)
            << "; it waited for " << rank_list(missing) << ", which left no dump\n";
        for (int r : missing)
          out << "  rank " << r << ": " << heard_of(dumps, r) << "\n";
      }
    }
  }
  if (a.seq) {
    out << "culprit: " << rank_list(a.culprits);
    if (!a.culprit_context.empty())
      out << " (" << a.culprit_context << " where the others had " << a.context << ")";
    else if (!a.context.empty())
      out << " (at " << a.context << ")";
    out << "\n";
  } else {
    out << "no disagreement: every rank issued the same collectives";
    if (!a.missing_dumps.empty())
      out << " (missing dumps: " << rank_list(a.missing_dumps) << ")";
    out << "\n";
  }
  out << "where each rank stopped:\n";
  for (int r = 0; r < world; ++r) {
    auto it = dumps.find(r);
    if (it == dumps.end()) {
      out << "  rank " << r << ": no dump\n";
      continue;
    }
    const auto& d = it->second;
    out << "  rank " << r << ": last completed "
        << describe(d.last_completed_group, d.last_completed);
    if (d.last.description != d.last_completed.description || d.last.seq != d.last_completed.seq)
      out << "; then " << describe(d.last_group, d.last);
    if (!d.last.error.empty())
      out << ": " << d.last.error;
    out << "\n";
  }
  a.text = out.str();
  return a;
}

}  // namespace fsdp
