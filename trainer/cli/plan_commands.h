// fsdp-plan's two commands (plan_main.cpp parses the command line): the per-rank table of one
// configuration (plan_table.cpp) and the search for the fastest that fits (plan_auto.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <fsdp/plan/hardware.h>

#include "config/config.h"

namespace fsdp_trainer {

/// What the command line asked, checked.
struct PlanRequest {
  Config config;
  int world = 1;
  int per_node = 1;
  bool finetune = false;
  std::string model_file;  // the fine-tuned model's file or directory
  int64_t other = 0;       // tracked bytes outside the model (fsdp-train's held-out batches)
  int64_t budget = 0;      // 0: none
  std::string budget_key;  // where the budget came from, for messages
  const fsdp::plan::DeviceProfile* device = nullptr;  // --hardware
  double efficiency = 1.0;
  // --auto
  int64_t global_batch = 0;
  int top = 5;
  double margin = 0.05;
  std::vector<std::string> space;
  std::string json_path;
  std::string cache_dir;
  bool recalibrate = false;
};

/// A line of the calibration's progress (plan_run's `progress`), on stderr: "fsdp-plan: LINE" (a
/// "note: ..." line once, however often it comes).
void plan_progress(const std::string& line);

/// Prints each rank's predicted peak by category (and with a device, the step time it allows);
/// returns the exit code.
int plan_table(const PlanRequest& request);

/// Prints the fastest configurations that fit the budget with a TOML snippet each; returns the
/// exit code (2 when none fits).
int plan_auto(PlanRequest request);

}  // namespace fsdp_trainer
