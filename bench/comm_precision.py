#!/usr/bin/env python3
"""Communication precision apart from compute: fp32 vs bf16 vs int8 gathers and reductions.

One command (from the repository root, after the build; root for the emulated link):

    ~/.cache/fsdp-cpp/torch-$(cat .torch-version)/bin/python bench/comm_precision.py

Five variants of fsdp-train on 2 ranks, full_shard, all computing in fp32:
  fp32              the all-gather and the reduce-scatter in fp32 (the baseline)
  bf16 comm         gather_format = bf16, reduce_dtype = bf16
  int8 comm         gather_format = int8 (a scale per 256 values of a row), reduce_dtype = bf16
  int8 both         gather_format = int8, reduce_format = int8 with error feedback
  int8 both, no EF  the same without error feedback

1. Loss: the demo (configs/demo.toml) for --loss-steps steps per variant on loopback; per-step
   training-loss gap to the fp32 run (same seed, same batches) and the final eval loss.
2. Speed: tokens/s (median of the steps after --warmup), interleaved (fp32, bf16, int8, fp32,
   ...) over --rounds rounds so that machine noise hits every variant alike, on loopback and
   over bench/emulated_link.sh's 1 Gbit/s link (each rank its own network namespace; needs
   root, skipped otherwise), at two settings: the demo's (gpt2-tiny, 8 x 128 tokens per rank)
   and a communication-bound one (gpt2-small, 2 x 128). Bytes per step are counted by the
   engine (allgather_bytes, reducescatter_bytes).
The CPU model and flags are printed first.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from machine import cpu_description

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "build", "trainer", "fsdp-train")
LINK = os.path.join(ROOT, "bench", "emulated_link.sh")
CONFIG = os.path.join(ROOT, "configs", "demo.toml")
RANKS = 2
VARIANTS = [
    ("fp32", []),
    ("bf16 comm", ["--precision.gather_format=bf16", "--precision.reduce_dtype=bf16"]),
    ("int8 comm", ["--precision.gather_format=int8", "--precision.reduce_dtype=bf16"]),
    ("int8 both", ["--precision.gather_format=int8", "--precision.reduce_format=int8"]),
    ("int8 both, no EF", ["--precision.gather_format=int8", "--precision.reduce_format=int8",
                          "--precision.error_feedback=false"]),
]
SETTINGS = [
    ("demo: gpt2-tiny, 8x128/rank", ["--model.preset=gpt2-tiny", "--training.batch_size=8"]),
    ("gpt2-small, 2x128/rank", ["--model.preset=gpt2-small", "--training.batch_size=2"]),
]


def run(run_dir, args, link):
    common = ["--logging.plot=false", "--logging.progress=none", f"--logging.run_dir={run_dir}",
              "--generate.tokens=0"]
    if link:
        # One process per rank, each in its own namespace; fsdp-train reads torchrun's
        # variables, which emulated_link.sh sets.
        cmd = [LINK, "--rate", link, "--nproc", str(RANKS), "--", TRAIN, CONFIG] + args + common
    else:
        cmd = [TRAIN, "--nproc", str(RANKS), CONFIG] + args + common
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def slug(name):
    return "".join(c if c.isalnum() else "-" for c in name)


def loss_part(steps, workdir):
    print(f"## Loss: demo, {steps} steps, fp32 compute, 2 ranks (loopback)\n")
    runs = {}
    for name, extra in VARIANTS:
        runs[name] = run(os.path.join(workdir, "loss-" + slug(name)),
                         [f"--training.steps={steps}", f"--training.eval_every={steps}"] + extra,
                         None)
    base = {m["step"]: m["loss"] for m in runs["fp32"] if "loss" in m}
    base_eval = [m["eval_loss"] for m in runs["fp32"] if m.get("eval_loss") is not None]
    print("| variant | all-gather B/step | reduce-scatter B/step | max train-loss gap (step) "
          "| mean gap, last 50 | eval loss at end |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, _ in VARIANTS:
        m = runs[name]
        gaps = [(abs(s["loss"] - base[s["step"]]), s["step"]) for s in m if s["step"] in base]
        worst = max(gaps)
        rel = worst[0] / base[worst[1]]
        last = [g for g, step in gaps if step > steps - 50]
        ev = [s["eval_loss"] for s in m if s.get("eval_loss") is not None]
        print(f"| {name} | {m[-1]['allgather_bytes']:,} | {m[-1]['reducescatter_bytes']:,} | "
              f"{worst[0]:.4f} ({rel:.2%}, step {worst[1]}) | {statistics.mean(last):.4f} | "
              f"{ev[-1]:.4f} |")
    print(f"\n(fp32 eval loss {base_eval[-1]:.4f}; gaps are |loss - fp32 loss| on the same "
          "batch.)\n")


def speed_part(rounds, steps, warmup, links, workdir):
    print(f"## Speed: tokens/s, median of steps {warmup + 1}-{steps}, {rounds} interleaved "
          "rounds (spread: min-max of the round medians)\n")
    for link in links:
        label = link or "loopback"
        for setting, sargs in SETTINGS:
            tps = {name: [] for name, _ in VARIANTS}
            sent = {}
            for r in range(rounds):
                for name, extra in VARIANTS:
                    rd = os.path.join(workdir, f"speed-{label}-{slug(name)}-{r}")
                    m = run(rd, sargs + [f"--training.steps={steps}", "--training.eval_every=0",
                                         "--training.eval_batches=1"] + extra, link)
                    tps[name].append(statistics.median(s["tokens_per_second"]
                                                       for s in m[warmup:]))
                    sent[name] = m[-1]["allgather_bytes"] + m[-1]["reducescatter_bytes"]
            print(f"### {setting}, {label}\n")
            print("| variant | bytes/step (gather + reduce) | vs fp32 | tokens/s | spread "
                  "| speed vs fp32 |")
            print("| --- | --- | --- | --- | --- | --- |")
            base = statistics.median(tps["fp32"])
            for name, _ in VARIANTS:
                med = statistics.median(tps[name])
                print(f"| {name} | {sent[name]:,} | {sent[name] / sent['fp32']:.2f} | "
                      f"{med:.0f} | {min(tps[name]):.0f}-{max(tps[name]):.0f} | "
                      f"{med / base:.2f}x |")
            print()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--loss-steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12, help="steps per speed run")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rate", default="1gbit", help="emulated link rate ('' to skip)")
    ap.add_argument("--skip-loss", action="store_true")
    args = ap.parse_args()
    print(f"CPU: {cpu_description()}\n")
    links = [None]
    if args.rate:
        if os.geteuid() == 0:
            links.append(args.rate)
        else:
            print("(not root: the emulated link is skipped)\n")
    with tempfile.TemporaryDirectory() as workdir:
        if not args.skip_loss:
            loss_part(args.loss_steps, workdir)
        speed_part(args.rounds, args.steps, args.warmup, links, workdir)


if __name__ == "__main__":
    sys.exit(main())
