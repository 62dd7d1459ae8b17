#!/usr/bin/env python3
"""checkpoint.async against synchronous saves and against no saves: how much longer the steps
that save take, fsdp-train on 2 ranks with GPT-2 small's shapes (124M parameters).

One command (from the repository root, after the build):

    ~/.cache/fsdp-cpp/torch-$(cat .torch-version)/bin/python bench/async_checkpoint.py

Five runs of the same job, interleaved ROUNDS times: no checkpoints, checkpoint.every=EVERY
synchronous, and the same asynchronous. Each run's progress lines (one per step) are stamped as
they arrive; the interval between step N's line and step N+1's is step N+1 plus whatever ran
between them, the save of step N included (fsdp-train saves after logging the step). For the
saving runs the table gives the median interval after a saving step and after the step after it
(an asynchronous save's writes run during the next steps and compete for the cores and the
disk), each as a ratio to the median interval of the run without checkpoints, and the first
also to the median of the saving runs' own other steps (neither saving nor following a save).
Memory: each run's highest resident set (metrics.jsonl's peak_rss_bytes): an asynchronous save
holds an image of the rank's file (its shards and optimizer state), kept for the next save.
Both saving runs again with FSDP_DIRECT_WRITES=0 ("plain"): the shard files through the page
cache instead of O_DIRECT.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

from machine import cpu_description

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "build", "trainer", "fsdp-train")
STEP_LINE = re.compile(r"^step +(\d+)/\d+ \|")


def run(work, name, steps, every, extra, env):
    run_dir = os.path.join(work, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [TRAIN, "--nproc", "2", os.path.join(ROOT, "configs", "demo.toml"),
           "--model.preset=gpt2-124m", "--training.batch_size=1", "--training.seq_len=256",
           f"--training.steps={steps}", "--training.warmup_steps=1", "--training.eval_every=0",
           "--training.eval_batches=1", "--generate.tokens=0", "--logging.plot=false",
           "--logging.progress=lines", "--logging.log_every=1", f"--logging.run_dir={run_dir}",
           f"--checkpoint.every={every}", "--checkpoint.keep=1"] + extra
    stamps = {}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env={**os.environ, **env})
    output = []
    for line in proc.stdout:
        output.append(line)
        m = STEP_LINE.match(line)
        if m:
            stamps[int(m.group(1))] = time.monotonic()
    if proc.wait() != 0:
        sys.exit(f"async_checkpoint.py: {' '.join(cmd)} failed:\n{''.join(output[-20:])}")
    peak_rss = max(json.loads(l).get("peak_rss_bytes", 0)
                   for l in open(os.path.join(run_dir, "metrics.jsonl")))
    shutil.rmtree(run_dir, ignore_errors=True)
    intervals = {s: stamps[s] - stamps[s - 1] for s in stamps if s - 1 in stamps}
    return intervals, peak_rss


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default=os.path.join(ROOT, "build", "bench-async-checkpoint"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--every", type=int, default=3)
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    print(f"machine: {cpu_description()}")
    # "plain": FSDP_DIRECT_WRITES=0, the shard files written through the page cache instead of
    # with O_DIRECT (include/fsdp/core/sequential_file.h), to measure what the direct path saves.
    kinds = {"none": (0, [], {}), "sync": (args.every, [], {}),
             "async": (args.every, ["--checkpoint.async=true"], {}),
             "sync, plain": (args.every, [], {"FSDP_DIRECT_WRITES": "0"}),
             "async, plain": (args.every, ["--checkpoint.async=true"], {"FSDP_DIRECT_WRITES": "0"})}
    after_save, after_next, plain, rss = ({k: [] for k in kinds} for _ in range(4))
    for r in range(args.rounds):
        for kind, (every, extra, env) in kinds.items():
            intervals, peak = run(args.work, f"{kind.replace(', ', '-')}-{r}", args.steps, every,
                                  extra, env)
            rss[kind].append(peak)
            for step, seconds in intervals.items():
                if step < 3:
                    continue  # the first steps create the optimizer state and warm up
                if every and (step - 1) % every == 0:
                    after_save[kind].append(seconds)
                elif every and (step - 2) % every == 0:
                    after_next[kind].append(seconds)
                else:
                    plain[kind].append(seconds)
    base = statistics.median(plain["none"] + after_save["none"] + after_next["none"])
    print(f"fsdp-train --nproc 2, gpt2-124m, batch 1 x 256 tokens, {args.steps} steps, a "
          f"checkpoint every {args.every} (checkpoint.keep=1), {args.rounds} rounds")
    print(f"median step without checkpoints: {base:.3f} s")
    print("ratio: to the median step without checkpoints; own: to the median of the same runs' "
          "steps that neither save nor follow a save")
    print(f"{'run':12} {'after a save (s)':>17} {'ratio':>6} {'own':>5} {'the step after (s)':>19} "
          f"{'ratio':>6} {'peak RSS per rank':>18}")
    for kind in ("sync", "async", "sync, plain", "async, plain"):
        a = statistics.median(after_save[kind])
        n = statistics.median(after_next[kind]) if after_next[kind] else float("nan")
        own = statistics.median(plain[kind]) if plain[kind] else float("nan")
        print(f"{kind:12} {a:17.3f} {a / base:6.2f} {a / own:5.2f} {n:19.3f} {n / base:6.2f} "
              f"{max(rss[kind]) / 2**20:15.0f} MiB")
    print(f"{'none':12} {'':17} {'':6} {'':5} {'':19} {'':6} {max(rss['none']) / 2**20:15.0f} MiB")


if __name__ == "__main__":
    main()
