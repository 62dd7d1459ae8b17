// See replica_membership.h.
#include "replica_membership.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include <fsdp/core/durable_file.h>

namespace fsdp_trainer {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

std::string first_line(const std::exception& e) {
  std::string what = e.what();
  return what.substr(0, what.find('\n'));
}

ReplicaMembership::ReplicaMembership(const Config& config,
                                     std::shared_ptr<fsdp::ProcessGroup> world, int incarnation,
                                     Hooks hooks)
    : config_(config), incarnation_(incarnation), hooks_(std::move(hooks)) {
  const int k = static_cast<int>(config_.fsdp.hybrid_shard_size);
  const int replicas = world->size() / k;
  quorum_ = std::make_unique<fsdp::ReplicaQuorum>(
      std::move(world), fsdp::ReplicaQuorumOptions()
                            .ranks_per_replica(k)
                            .incarnation(incarnation)
                            .max_live(replicas - static_cast<int>(config_.fsdp.spare_replicas)));
  joining_ = quorum_->left();  // restarted, or a spare
  if (!config_.fsdp.membership_schedule.empty())
    schedule_ = parse_membership_schedule(config_.fsdp.membership_schedule);
}

void ReplicaMembership::start(int64_t first_step) {
  if (first_step > 1 && writer()) {
    // Resumed from a checkpoint: the changes before it stay (the membership that produced the
    // state resumed from), those of the abandoned steps after it go.
    const auto path = std::filesystem::path(config_.logging.run_dir) / "membership.jsonl";
    std::ifstream in(path);
    std::string kept;
    for (std::string line; std::getline(in, line);) {
      int64_t step = 0;
      if (std::sscanf(line.c_str(), "{\"step\": %" SCNd64, &step) == 1 && step < first_step)
        kept += line + "\n";
    }
    std::filesystem::create_directories(config_.logging.run_dir);
    fsdp::write_file_atomic(path.string(), kept);
  }
  record(first_step, first_step > 1 ? "resumed" : "start");
}

int ReplicaMembership::rank() const {
  return quorum_->replica() * static_cast<int>(config_.fsdp.hybrid_shard_size) + quorum_->index();
}

bool ReplicaMembership::writer() const {
  const auto& live = quorum_->live_group();
  return live && live->rank() == 0;
}

void ReplicaMembership::changed(int64_t step, const char* cause) {
  hooks_.changed(step);
  record(step, cause);
}

void ReplicaMembership::record(int64_t step, const char* cause) {
  if (!writer())
    return;
  // One line per change, by the rank that writes the run's outputs after it.
  const auto path = std::filesystem::path(config_.logging.run_dir) / "membership.jsonl";
  std::string line =
      fmt::format("{{\"step\": {}, \"live\": [{}], \"epoch\": {}, \"cause\": \"{}\"}}\n", step,
                  fmt::join(quorum_->live(), ", "), quorum_->epoch(), cause);
  if (std::string(cause) == "start") {  // a new run's first line
    std::filesystem::create_directories(config_.logging.run_dir);
    fsdp::write_file_atomic(path.string(), line);
  } else {
    std::FILE* f = std::fopen(path.c_str(), "a");
    if (f) {
      std::fputs(line.c_str(), f);
      std::fclose(f);
    }
  }
  std::printf("fsdp-train: replicas [%s] train from step %lld (%s)\n",
              fmt::format("{}", fmt::join(quorum_->live(), ", ")).c_str(),
              static_cast<long long>(step), cause);
  std::fflush(stdout);
}

int64_t ReplicaMembership::rejoin(bool ask, std::chrono::milliseconds timeout) {
  const int64_t step = quorum_->rejoin(timeout, ask);
  if (step == fsdp::ReplicaQuorum::kFinished)
    return step;
  if (step < 0) {
    throw LeftTheJob(fmt::format("replica {} was not admitted back within {} s", quorum_->replica(),
                                 timeout.count() / 1000));
  }
  changed(step, ask ? "rejoined" : "schedule");
  const auto start = Clock::now();
  try {
    hooks_.sync_state(/*joining=*/true);
  } catch (const std::exception& e) {
    // The sender died, or the copy's checksums differ: this rank's state is not the replicas'.
    // The live ones drop it at their next step, as after any fault; restarted, it asks again
    // (the protocol's test, with a joiner that dies in the copy:
    // FaultTolerance.AReplicaDyingInItsStateCopyIsDroppedAndJoinsWhenRestartedAgain).
    throw LeftTheJob(fmt::format("replica {}'s state copy at step {} failed: {}",
                                 quorum_->replica(), step, first_line(e)));
  }
  std::printf(
      "fsdp-train: [rank %d] replica %d back at step %lld, its state copied from a "
      "replica that stayed in %.3f s\n",
      rank(), quorum_->replica(), static_cast<long long>(step),
      std::chrono::duration<double>(Clock::now() - start).count());
  std::fflush(stdout);
  return step;
}

int64_t ReplicaMembership::join() {
  // The live replicas admit a restarted replica at their next step boundary: within a step and
  // a vote. A spare waits for room as long as the job runs.
  const auto timeout =
      restarted() ? std::chrono::milliseconds(static_cast<int64_t>(config_.fsdp.timeout_s * 1000)) +
                        std::chrono::seconds(90)
                  : std::chrono::milliseconds(std::chrono::hours(24 * 365));
  // In a schedule's run it asks nothing: the schedule admits it (set_membership).
  const int64_t step = rejoin(/*ask=*/schedule_.empty(), timeout);
  joining_ = false;
  return step;
}

void ReplicaMembership::finish() {
  if (!quorum_->left())
    quorum_->finish();
}

void ReplicaMembership::before_step(int64_t step) {
  resume_step_ = -1;
  const auto it = schedule_.find(step);
  if (it == schedule_.end())
    return;
  const auto before = quorum_->live();
  bool stays = false;
  try {
    stays = quorum_->set_membership(it->second, step);
    if (stays) {
      changed(step, "schedule");
      // A replica joins (the same change may drop another): the state goes to it.
      const auto& live = quorum_->live();
      if (std::any_of(live.begin(), live.end(), [&](int r) {
            return std::find(before.begin(), before.end(), r) == before.end();
          }))
        hooks_.sync_state(/*joining=*/false);
    }
  } catch (const std::exception& e) {
    // A replica the schedule takes back died while it was waiting, or in its state copy: the
    // new groups could not be made (set_membership changes nothing but the epoch then), or the
    // copy failed. As after an admission that fails (after_step), the step fails and the live
    // replicas reform without it. This rank stays: a dropped one makes no group.
    std::fprintf(stderr,
                 "fsdp-train: [rank %d] the change of fsdp.membership_schedule at step %lld "
                 "failed: %s\n",
                 rank(), static_cast<long long>(step), first_line(e).c_str());
    broken_ = true;
    return;
  }
  if (stays)
    return;
  // Dropped by the schedule: back at its next entry that names this replica, if any.
  if (hooks_.dropped)
    hooks_.dropped();
  const int me = quorum_->replica();
  for (auto later = std::next(it); later != schedule_.end(); ++later) {
    if (std::count(later->second.begin(), later->second.end(), me) == 0)
      continue;
    // The others' steps in between take less than a vote timeout each.
    const auto per_step =
        std::chrono::milliseconds(static_cast<int64_t>(config_.fsdp.timeout_s * 1000)) +
        std::chrono::seconds(30);
    resume_step_ = rejoin(/*ask=*/false, per_step * (later->first - step + 1));
    return;
  }
  throw LeftTheJob(fmt::format("fsdp.membership_schedule drops replica {} at step {}", me, step));
}

void ReplicaMembership::commit(int64_t step, const std::function<bool()>& attempt) {
  const auto start = Clock::now();
  bool ok = !broken_ && attempt();
  broken_ = false;
  bool reformed = false;
  while (!quorum_->commit(step, ok)) {
    ok = false;
    try {
      if (!quorum_->reform(step)) {
        throw LeftTheJob(fmt::format(
            "replica {} left the job at step {}: one of its ranks failed (or this rank was cut "
            "off from the others)",
            quorum_->replica(), step));
      }
      reformed = true;
      changed(step, "fault");
      ok = attempt();
    } catch (const LeftTheJob&) {
      throw;
    } catch (const std::exception& e) {
      // A rank died while the groups were made: vote the step failed, and reform again.
      std::fprintf(stderr, "fsdp-train: [rank %d] reforming at step %lld failed: %s\n", rank(),
                   static_cast<long long>(step), first_line(e).c_str());
    }
  }
  if (reformed && writer()) {
    std::printf("fsdp-train: step %lld committed by replicas [%s], %.2f s after it started\n",
                static_cast<long long>(step),
                fmt::format("{}", fmt::join(quorum_->live(), ", ")).c_str(),
                std::chrono::duration<double>(Clock::now() - start).count());
    std::fflush(stdout);
  }
}

void ReplicaMembership::after_step(int64_t step) {
  if (quorum_->admitted().empty())
    return;
  try {
    quorum_->admit(step + 1);
    changed(step + 1, "admitted");
    hooks_.sync_state(/*joining=*/false);
  } catch (const std::exception& e) {
    // A joining rank did not come (it died, or gave up): the next step fails, and the live
    // replicas reform without it.
    std::fprintf(stderr, "fsdp-train: admitting replicas after step %lld failed: %s\n",
                 static_cast<long long>(step), first_line(e).c_str());
    broken_ = true;
  }
}

}  // namespace fsdp_trainer
