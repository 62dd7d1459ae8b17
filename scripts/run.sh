#!/usr/bin/env bash
# The two commands README promises, each installing and building what it needs first:
#   scripts/run.sh demo [--key=value ...]  fsdp-train: a small GPT on 2 ranks (FULL_SHARD)
#   scripts/run.sh test [ctest flags]     run every test
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${FSDP_CACHE:-$HOME/.cache/fsdp-cpp}"
VENV="$CACHE/torch-${FSDP_TORCH_VERSION:-$(tr -d '[:space:]' < "$ROOT/.torch-version")}"
BUILD="${FSDP_BUILD_DIR:-$ROOT/build}"
cmd="${1:-}"
shift || true

# The demo builds only what it runs (fsdp-train and the libraries it links); the tests build
# everything and also need the Python packages they check our files against.
case "$cmd" in
  demo) "$ROOT/scripts/setup.sh" --target fsdp-train ;;
  test) "$ROOT/scripts/setup.sh" --checks ;;
esac

# FSDP_EMULATE_CPU=avx2: run as on a CPU without fast bf16 (AVX2 and FMA only, no AVX-512 BF16
# or AMX), whatever this one has: oneDNN (LibTorch's bf16 matmuls) and ATen's own kernels are
# limited to AVX2, which makes bf16 matmuls 30-60x slower than fp32 as on such a CPU. The suite
# must pass in time under it (docs/design.md, "Machines").
case "${FSDP_EMULATE_CPU:-}" in
  "") ;;
  avx2) export ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 ;;
  *) echo "run.sh: FSDP_EMULATE_CPU must be avx2 or empty, got '$FSDP_EMULATE_CPU'" >&2; exit 2 ;;
esac

case "$cmd" in
  demo)
    # fsdp-train on 2 local ranks: prepares the King James Bible (Debian's bible-kjv) on first
    # run, trains a small GPT for a few minutes, writes runs/demo/ and prints a sample.
    cd "$ROOT"
    exec "$BUILD/trainer/fsdp-train" --nproc 2 configs/demo.toml "$@"
    ;;
  test)
    cd "$BUILD"
    # Two tests at a time on two cores: multi-process tests run one intra-op thread per rank.
    exec ctest --output-on-failure --no-tests=error -j "${FSDP_TEST_JOBS:-2}" "$@"
    ;;
  *)
    echo "usage: scripts/run.sh demo|test [args]" >&2
    exit 2
    ;;
esac
