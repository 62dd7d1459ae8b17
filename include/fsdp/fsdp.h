// fsdp-cpp: Fully Sharded Data Parallel training for LibTorch.
//
// The one header to include. See README.md for the change a model needs (call sharded
// modules through fsdp::forward) and docs/design.md for how a unit lives through a step.
#pragma once

#include <fsdp/clip_grad.h>
#include <fsdp/comm_stats.h>
#include <fsdp/consolidated.h>
#include <fsdp/durable_file.h>
#include <fsdp/fully_shard.h>
#include <fsdp/grad_scaler.h>
#include <fsdp/memory.h>
#include <fsdp/mixed_precision.h>
#include <fsdp/nf4.h>
#include <fsdp/process_group.h>
#include <fsdp/safetensors.h>
#include <fsdp/sharded_checkpoint.h>
#include <fsdp/state_dict.h>
#include <fsdp/step_profiler.h>
#include <fsdp/tensor_visit.h>
#include <fsdp/unshard.h>
