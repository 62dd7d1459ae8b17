#!/usr/bin/env bash
# The two commands README promises, each installing and building what it needs first:
#   scripts/run.sh demo [example flags]   train a small GPT on 2 ranks (FULL_SHARD)
#   scripts/run.sh test [ctest flags]     run every test
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${FSDP_CACHE:-$HOME/.cache/fsdp-cpp}"
VENV="$CACHE/torch-$(tr -d '[:space:]' < "$ROOT/.torch-version")"
BUILD="${FSDP_BUILD_DIR:-$ROOT/build}"
cmd="${1:-}"
shift || true

"$ROOT/scripts/setup.sh"

case "$cmd" in
  demo)
    text="$ROOT/data/kjv.txt"
    if [ ! -s "$text" ]; then
      # The King James Bible from Debian's bible-kjv: ~4.3 MB of real text, no download.
      mkdir -p "$ROOT/data"
      bible -p /usr/lib "Gen1:1-Rev22:21" > "$text.tmp"
      mv "$text.tmp" "$text"
    fi
    OMP_NUM_THREADS=1 exec "$VENV/bin/torchrun" --standalone --no-python --nproc-per-node 2 \
      "$BUILD/examples/train_gpt" --text "$text" "$@"
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
