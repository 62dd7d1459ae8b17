// fsdp-cpp: Fully Sharded Data Parallel training for LibTorch.
//
// The one header to include. See README.md for the change a model needs (call sharded
// modules through fsdp::forward) and docs/design.md for how a unit lives through a step.
#pragma once

// The engine: sharding a model and what a user calls around a step.
#include <fsdp/activation_checkpoint.h>
#include <fsdp/clip_grad.h>
#include <fsdp/fully_shard.h>
#include <fsdp/grad_scaler.h>
#include <fsdp/mixed_precision.h>
#include <fsdp/state_dict.h>
#include <fsdp/unshard.h>
// The subsystems under and beside it (docs/design.md, "Subsystems").
#include <fsdp/checkpoint/consolidated.h>
#include <fsdp/checkpoint/safetensors.h>
#include <fsdp/checkpoint/sharded_checkpoint.h>
#include <fsdp/core/caching_allocator.h>
#include <fsdp/core/durable_file.h>
#include <fsdp/core/memory.h>
#include <fsdp/core/trace.h>
#include <fsdp/distributed/collectives.h>
#include <fsdp/distributed/comm_stats.h>
#include <fsdp/distributed/device_mesh.h>
#include <fsdp/distributed/flight_recorder.h>
#include <fsdp/distributed/process_group.h>
#include <fsdp/observe/chrome_trace.h>
#include <fsdp/observe/step_profiler.h>
#include <fsdp/optim/fused_optimizer.h>
#include <fsdp/optim/torch_fused_adamw.h>
#include <fsdp/plan/activations.h>
#include <fsdp/plan/hardware.h>
#include <fsdp/plan/machine_profile.h>
#include <fsdp/plan/model_states.h>
#include <fsdp/plan/step_memory.h>
#include <fsdp/plan/step_time.h>
#include <fsdp/plan/unit_overhead.h>
#include <fsdp/plan/units.h>
#include <fsdp/quant/nf4.h>
#include <fsdp/tensor_parallel/tp_ops.h>
#include <fsdp/tensor_parallel/vocab_parallel.h>
