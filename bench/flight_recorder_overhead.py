"""The flight recorder's cost at the demo setting: fsdp-train --nproc 2 configs/demo.toml with
logging.flight_recorder = 2000 (the default) against 0 (off), interleaved rounds, tokens/s as the
median over steps 11..N of each run (the first steps warm up), and the peak memory.

    python3 bench/flight_recorder_overhead.py [--rounds 4] [--steps 120]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from machine import cpu_description  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "build", "trainer", "fsdp-train")


def run(entries, steps):
    run_dir = f"/tmp/fr-overhead-{os.getpid()}"
    shutil.rmtree(run_dir, ignore_errors=True)
    subprocess.run([TRAIN, "--nproc", "2", os.path.join(ROOT, "configs", "demo.toml"),
                    f"--training.steps={steps}", "--training.eval_every=0", "--logging.plot=false",
                    "--logging.progress=none", f"--logging.run_dir={run_dir}",
                    f"--logging.flight_recorder={entries}"], check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        m = [json.loads(line) for line in f if '"tokens_per_second"' in line]
    shutil.rmtree(run_dir, ignore_errors=True)
    return (statistics.median(x["tokens_per_second"] for x in m[10:]),
            max(x["peak_bytes"] for x in m))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=120)
    args = ap.parse_args()
    print(f"machine: {cpu_description()}")
    on, off = [], []
    for r in range(args.rounds):
        for entries, into in ((0, off), (2000, on)) if r % 2 == 0 else ((2000, on), (0, off)):
            into.append(run(entries, args.steps))
        print(f"round {r + 1}: off {off[-1][0]:.0f} tok/s, on {on[-1][0]:.0f} tok/s")
    ratios = [a[0] / b[0] for a, b in zip(on, off)]
    print(f"\ntokens/s, recorder on / off, per round: {', '.join(f'{x:.3f}' for x in ratios)}; "
          f"median {statistics.median(ratios):.3f}")
    print(f"spread of 'off' alone (max/min): {max(x[0] for x in off) / min(x[0] for x in off):.3f}")
    print(f"peak memory: off {max(x[1] for x in off) / 2**20:.2f} MiB, "
          f"on {max(x[1] for x in on) / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
