// Test seam of save_sharded: called at each stage of a save on every rank, so that a test can
// kill a rank at an exact point ("files_written": this rank's file is complete and fsynced,
// the index not yet written). Empty (no cost) unless a test sets it.
#pragma once

#include <functional>
#include <string>

namespace fsdp::detail {

extern std::function<void(int rank, const std::string& stage)> save_sharded_hook;

}  // namespace fsdp::detail
