#!/usr/bin/env python3
"""The caching CPU allocator (training.cpu_cache, on by default) against glibc alone: each rank's
peak resident memory and the step time, in interleaved rounds (on, off, on, off) so that machine
noise hits both alike.

    python3 bench/cpu_cache.py [--rounds 2]

Cases (2 ranks each, fsdp-train --nproc):
  demo        configs/demo.toml (gpt2-tiny, batch 8 x 128), 100 steps
  small-fs    gpt2-small, batch 4 x 256, full_shard, 12 steps
  small-ns    the same, no_shard
  lora        fsdp-train finetune configs/smollm2-lora.toml (SmolLM2-135M, LoRA, fp32 compute),
              12 steps: batches of varying length, so sizes change from step to step
Per run: the peak resident memory of the rank with the highest one (VmHWM, the last step's
peak_rss_bytes in metrics.jsonl), the tracked tensor peak, and the median step time of the steps
after the first two. Prints the machine first.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from machine import cpu_description  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "build", "trainer", "fsdp-train")
COMMON = ["--logging.plot=false", "--logging.progress=none", "--generate.tokens=0",
          "--training.eval_every=0", "--training.eval_batches=1"]
CASES = {
    "demo": ["--nproc", "2", "configs/demo.toml", "--training.steps=100"],
    "small-fs": ["--nproc", "2", "configs/demo.toml", "--model.preset=gpt2-small",
                 "--training.steps=12", "--training.batch_size=4", "--training.seq_len=256"],
    "small-ns": ["--nproc", "2", "configs/demo.toml", "--model.preset=gpt2-small",
                 "--training.steps=12", "--training.batch_size=4", "--training.seq_len=256",
                 "--fsdp.strategy=no_shard"],
    "lora": ["finetune", "--nproc", "2", "configs/smollm2-lora.toml", "--training.steps=12",
             "--precision.param_dtype=fp32", "--finetune.samples=0",
             "--finetune.save_adapter=false"],
}


def run(case, cache, run_dir):
    args = CASES[case]
    cmd = [TRAIN, *args, *COMMON, f"--training.cpu_cache={'true' if cache else 'false'}",
           f"--logging.run_dir={run_dir}"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    times = [s["step_time_s"] for s in steps[2:]]
    return {"rss": steps[-1]["peak_rss_bytes"] / 2**20, "tracked": max(
        s["peak_bytes"] for s in steps) / 2**20, "step": statistics.median(times) * 1000}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    print(f"machine: {cpu_description()}")
    cases = args.cases.split(",")
    results = {(c, on): [] for c in cases for on in (True, False)}
    with tempfile.TemporaryDirectory() as work:
        for r in range(args.rounds):
            for c in cases:
                for on in (True, False):
                    results[(c, on)].append(run(c, on, os.path.join(work, f"{c}-{on}-{r}")))
    print("\n| case | cpu_cache | peak RSS per rank | tracked peak | step (median) |")
    print("| --- | --- | --- | --- | --- |")
    span = lambda xs, f: (f"{f.format(min(xs))}-{f.format(max(xs))}" if len(xs) > 1
                          else f.format(xs[0]))
    for c in cases:
        for on in (True, False):
            rs = results[(c, on)]
            print(f"| {c} | {'on' if on else 'off'} | {span([x['rss'] for x in rs], '{:.0f}')} MiB"
                  f" | {rs[0]['tracked']:.1f} MiB | {span([x['step'] for x in rs], '{:.0f}')} ms |")


if __name__ == "__main__":
    main()
