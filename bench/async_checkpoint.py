#!/usr/bin/env python3
"""checkpoint.async against synchronous saves and against no saves: how much longer the steps
that save take, fsdp-train on 2 ranks with GPT-2 small's shapes (124M parameters).

One command (from the repository root, after the build):

    ~/.cache/fsdp-cpp/torch-$(cat .torch-version)/bin/python bench/async_checkpoint.py

Three runs of the same job, interleaved ROUNDS times: no checkpoints, checkpoint.every=EVERY
synchronous, and the same asynchronous. Each run's progress lines (one per step) are stamped as
they arrive; the interval between step N's line and step N+1's is step N+1 plus whatever ran
between them, the save of step N included (fsdp-train saves after logging the step). For the
saving runs the table gives the median interval after a saving step and after the step after it
(an asynchronous save's writes run during the next steps and compete for the cores and the
disk), each as a ratio to the median interval of the run without checkpoints. Memory: each
run's highest resident set (metrics.jsonl's peak_rss_bytes): an asynchronous save holds a copy
of the rank's shards and optimizer state until its file is written.
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


def run(work, name, steps, every, extra):
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
                            cwd=ROOT)
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
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--every", type=int, default=3)
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    print(f"machine: {cpu_description()}")
    kinds = {"none": (0, []), "sync": (args.every, []),
             "async": (args.every, ["--checkpoint.async=true"])}
    after_save, after_next, plain, rss = ({k: [] for k in kinds} for _ in range(4))
    for r in range(args.rounds):
        for kind, (every, extra) in kinds.items():
            intervals, peak = run(args.work, f"{kind}-{r}", args.steps, every, extra)
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
    print(f"{'run':6} {'after a save (s)':>17} {'ratio':>6} {'the step after (s)':>19} "
          f"{'ratio':>6} {'peak RSS per rank':>18}")
    for kind in ("sync", "async"):
        a = statistics.median(after_save[kind])
        n = statistics.median(after_next[kind]) if after_next[kind] else float("nan")
        print(f"{kind:6} {a:17.3f} {a / base:6.2f} {n:19.3f} {n / base:6.2f} "
              f"{max(rss[kind]) / 2**20:15.0f} MiB")
    print(f"{'none':6} {'':17} {'':6} {'':19} {'':6} {max(rss['none']) / 2**20:15.0f} MiB")


if __name__ == "__main__":
    main()
