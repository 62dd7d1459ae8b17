#!/usr/bin/env python3
"""fsdp-plan --auto against measurement (issue 26): predicts every configuration of a search
space with fsdp-plan --auto --json, runs each through fsdp-train for a few steps (the grid),
then for three budgets checks that the configuration --auto chooses fits (its measured peak is
within the budget) and that its measured tokens/s is within 10% of the best measured among the
grid's configurations that fit (the chosen one and the grid's three fastest that fit run four
times more, and each counts by its median: one 12-step run varies by about 8% here). Prints the machine, the grid's rows and one line per budget.

    bench/plan_auto.py [--build build] [--steps 12] [--out table.md] [--resume OUTPUT]

--resume takes the measured rows of an earlier run's output (same space and steps) instead of
running them again.

The budgets are placed by the grid's measured peaks (a tight one near the smallest, one in the
middle, and one every configuration fits), each where no configuration's peak lies within
--auto's 5% safety margin below it (that margin, not the prediction, would decide otherwise).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_description  # noqa: E402

BASE = ["configs/demo.toml", "--training.seq_len=256", "--data.held_out_fraction=0.02"]
WORLD = 2
GLOBAL_BATCH = 16
SPACE = ["strategy=full_shard,shard_grad_op,no_shard", "ac=none,selective,full",
         "dtype=fp32,bf16", "gather=param_dtype", "offload=none",
         "micro_batches=1,2,4,8"]


def predict(build, budget, json_path):
    cmd = [os.path.join(build, "trainer", "fsdp-plan"), *BASE[:1], "--world", str(WORLD),
           "--auto", "--budget", str(budget), "--global-batch", str(GLOBAL_BATCH),
           "--json", json_path, "--top", "1", *BASE[1:]]
    for s in SPACE:
        cmd += ["--space", s]
    r = subprocess.run(cmd, capture_output=True, text=True)
    with open(json_path) as f:
        return r.returncode, r.stdout + r.stderr, json.load(f)


def measure(build, overrides, steps, workdir):
    run_dir = tempfile.mkdtemp(dir=workdir)
    os.makedirs(os.path.join(run_dir, "offload"))
    cmd = [os.path.join(build, "trainer", "fsdp-train"), BASE[0], "--nproc", str(WORLD),
           f"--training.steps={steps}", "--training.eval_every=0", "--generate.tokens=0",
           "--logging.plot=false", "--logging.progress=none", f"--logging.run_dir={run_dir}",
           f"--optimizer.offload_dir={run_dir}/offload", *BASE[1:],
           *["--" + o for o in overrides]]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr[-2000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))
            if line.strip()]
    steady = [x for x in rows if x["step"] > 2]
    return (statistics.median(x["tokens_per_second"] for x in steady),
            max(x["peak_bytes"] for x in rows if x["step"] > 1))


def knobs(overrides):
    d = dict(o.split("=", 1) for o in overrides)
    return (f"{d['fsdp.strategy']} / AC {d['fsdp.activation_checkpointing']} / "
            f"{d['precision.param_dtype']} / optimizer {d['optimizer.offload']} / "
            f"{d['training.micro_batches']} micro")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out")
    ap.add_argument("--resume")
    args = ap.parse_args()
    earlier = {}
    if args.resume:
        for line in open(args.resume):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 5 and cells[2].replace(".", "").isdigit():
                earlier[cells[0]] = (float(cells[2]), float(cells[4]) * 2**20)
    out = []
    say = lambda line="": (print(line, flush=True), out.append(line))  # noqa: E731
    say(f"Machine: {cpu_description()}")
    workdir = tempfile.mkdtemp(prefix="plan-auto-")
    code, text, grid = predict(args.build, "1TiB", os.path.join(workdir, "all.json"))
    if code != 0:
        sys.exit(text)
    say(f"{len(grid)} configurations; each run {args.steps} steps on {WORLD} ranks, "
        f"global batch {GLOBAL_BATCH}, median tokens/s of steps 3+")
    say()
    say("| configuration | predicted tokens/s | measured tokens/s | predicted peak MiB | "
        "measured peak MiB |")
    say("|---|---|---|---|---|")
    measured = {}
    for c in grid:
        key = tuple(c["overrides"])
        measured[key] = earlier.get(knobs(c["overrides"])) or measure(
            args.build, c["overrides"], args.steps, workdir)
        tps, peak = measured[key]
        say(f"| {knobs(c['overrides'])} | {c['tokens_per_s']:.0f} | {tps:.0f} | "
            f"{c['peak'] / 2**20:.2f} | {peak / 2**20:.2f} |")
    pred = [c["tokens_per_s"] for c in grid]
    meas = [measured[tuple(c["overrides"])][0] for c in grid]
    # Rank agreement (Spearman) of predicted and measured speed over the grid.
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0] * len(v)
        for pos, i in enumerate(order):
            r[i] = pos
        return r
    rp, rm = ranks(pred), ranks(meas)
    n = len(grid)
    rho = 1 - 6 * sum((a - b) ** 2 for a, b in zip(rp, rm)) / (n * (n * n - 1))
    say()
    say(f"Spearman rank correlation of predicted and measured tokens/s: {rho:.3f}")
    # Budgets where no configuration's measured peak lies within --auto's 5% margin below
    # them, so that the margin does not decide what fits: just above a peak that has the next
    # one more than 6% higher, the nearest such to the eighth and the half of the peaks; and
    # one every configuration fits.
    peaks = sorted(set(p for _, p in measured.values()))
    gaps = [p for p, q in zip(peaks, peaks[1:]) if q > p * 1.06]
    def near(target):
        return int(min(gaps, key=lambda p: abs(p - target)) * 1.055)
    budgets = [near(peaks[len(peaks) // 8]), near(peaks[len(peaks) // 2]), int(peaks[-1] * 1.1)]
    say()
    say("| budget | chosen by --auto | its measured tokens/s | its measured peak | "
        "best measured that fits | best tokens/s | ratio | verdict |")
    say("|---|---|---|---|---|---|---|---|")
    failures = 0
    for budget in budgets:
        code, text, cands = predict(args.build, budget, os.path.join(workdir, "b.json"))
        if code != 0:
            say(f"| {budget / 2**20:.2f} MiB | nothing fits: {text.strip()[-200:]} |")
            failures += 1
            continue
        chosen = next(c for c in cands if c["fits"])
        ckey = tuple(chosen["overrides"])
        cpeak = measured[ckey][1]
        # One run is noisy (+-8% here): the chosen configuration and the three fastest that fit
        # run four times more, interleaved, and each counts by the median of its five runs.
        fitting = sorted(((tps, key) for key, (tps, peak) in measured.items() if peak <= budget),
                         reverse=True)
        again = [ckey] + [key for _, key in fitting[:3] if key != ckey]
        runs = {key: [measured[key][0]] for key in again}
        for _ in range(4):
            for key in again:
                runs[key].append(measure(args.build, list(key), args.steps, workdir)[0])
        median = {key: statistics.median(v) for key, v in runs.items()}
        ctps = median[ckey]
        best_key = max(median, key=median.get)
        best_tps = median[best_key]
        ratio = ctps / best_tps
        ok = cpeak <= budget and ratio >= 0.9
        failures += not ok
        say(f"| {budget / 2**20:.2f} MiB | {knobs(chosen['overrides'])} | {ctps:.0f} | "
            f"{cpeak / 2**20:.2f} MiB | {knobs(best_key)} | {best_tps:.0f} | {ratio:.3f} | "
            f"{'pass' if ok else 'FAIL'} |")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(out) + "\n")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
