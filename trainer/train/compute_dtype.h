// precision.param_dtype resolved for this machine: "auto" picks bf16 where bf16 matmuls are
// fast (CPUs with AVX-512 BF16 or AMX, GPUs) and fp32 where they are slow (AVX2-only CPUs,
// ~36x slower than fp32 there); an explicit low precision that is slow here is kept, with a
// warning that gives the measured ratio.
#pragma once

#include <torch/types.h>

#include <string>

namespace fsdp_trainer {

/// The measured speeds the choice rests on: FLOP/s of a training step's three matmul forms
/// (MatmulSpeed::step) in fp32 and in the candidate low precision, the same shape, the highest
/// over ranks. 0 where not measured.
struct DtypeSpeeds {
  double fp32 = 0;
  double low = 0;     // bf16 for "auto", else the requested dtype
  std::string shape;  // "256x512x1024", for the messages
};

struct ComputeDtype {
  std::string dtype;    // fp32, bf16 or fp16: what the units compute in
  std::string reason;   // one line for start-up: the choice and why
  std::string warning;  // one line, or empty: an explicit dtype that is slow on this machine
};

/// Whether `requested` (fp32, bf16, fp16 or auto) needs speeds measured on this machine: auto,
/// and an explicit bf16/fp16 on CPU (for the warning).
/// The config's dtype names (fp32, bf16, fp16; validated there: another one is a bug).
torch::ScalarType dtype_named(const std::string& name);

bool needs_dtype_speeds(const std::string& requested, bool cuda);

/// The low precision `requested` is compared with fp32 in: bf16 for auto, else itself.
std::string candidate_dtype(const std::string& requested);

/// Resolves `requested`. On CUDA, auto is bf16 (the GPUs FSDP is used on have bf16 tensor
/// cores; docs/gpu.md's runs set bf16 or fp32 explicitly). On CPU, auto is bf16 when its step
/// matmuls are at least as fast as fp32's, fp32 otherwise; an explicit bf16/fp16 slower than fp32
/// gets a warning.
ComputeDtype choose_compute_dtype(const std::string& requested, bool cuda,
                                  const DtypeSpeeds& speeds);

}  // namespace fsdp_trainer
