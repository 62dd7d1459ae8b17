// `fsdp-train --nproc N`: this process becomes the launcher of N local ranks, the way torchrun's
// agent is (fsdp::launch_local_ranks: it hosts the TCPStore and starts N copies of itself with
// torchrun's environment, forked copies of the launcher where it can); it shows rank 0's output as
// it comes, keeps the other ranks quiet unless they fail (then prints their output, prefixed with
// the rank, the rank that failed first first, and ends with a line naming that rank and its last
// line when it is not rank 0), and stops every rank soon after one fails. A rank calls
// fsdp::die_with_launcher() first.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <fsdp/distributed/local_launch.h>

namespace fsdp_trainer {

/// Runs `args` (argv without the program name and without --nproc) as `nproc` ranks of this
/// executable and returns the job's exit code: 0, or the first failing rank's code. With
/// rank_main, a rank may instead be a fork of this process that runs it (LocalLaunchOptions).
/// fsdp-train --nnodes: this launcher's node (fsdp::LocalLaunchOptions' nnodes ...).
struct Nodes {
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr;
  int master_port = 0;
};

/// With `restarts` (fsdp.fault_tolerant), a failed rank ends only its replica, which is started
/// again (fsdp::LocalLaunchOptions::replica_restarts); the job's code is then 0 when a rank
/// finished training, and each replica's restarts are said at the end.
int launch_local(int nproc, const std::vector<std::string>& args, int threads_per_rank,
                 std::function<int()> rank_main = {},
                 std::optional<fsdp::LocalLaunchOptions::ReplicaRestarts> restarts = {},
                 const Nodes& nodes = {});

}  // namespace fsdp_trainer
