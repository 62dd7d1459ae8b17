#!/usr/bin/env python3
"""Per-rank memory of tensor parallelism against FSDP alone on the same ranks, measured.

One command (from the repository root, after the build):

    ~/.cache/fsdp-cpp/torch-$(cat .torch-version)/bin/python bench/tensor_parallel_memory.py

runs fsdp-train on 4 ranks at (dp, tp) = (4, 1), (2, 2) and (1, 4), the last two also with
sequence parallelism, on gpt2-medium's block
shape (gpt2-350m: width 1024, 16 heads; fewer blocks, --layers, so that it runs on two cores)
at a long sequence, one sequence per tp group, fp32, and prints what each rank's peak is made of
(fsdp::memory categories of the rank with the highest peak, at that peak), each against (4, 1),
with the tensor-parallel traffic per step and the step time; and, each run being started with
--plan, the planner's prediction of rank 0's peak, activations and tensor-parallel traffic
against what rank 0 measured (plan.json). The CPU model and flags come first.

What to expect, per block and token (see analytic()): without sequence parallelism (not in the
models yet) a GPT block keeps 16 values of width C for backward, of which 12 are split by tp (q,
k, v, attention's output, the MLP's two hidden tensors of 4C) and 4 stay whole (the block's
input, the two norms' outputs, the residual after attention), plus fp32 norm statistics; the
fused loss keeps a chunk of this rank's words only. So a block's activations per rank fall by
16 / (12 / tp + 4): 1.6x at tp 2, 2.3x at tp 4, not tp x, until the residual stream is split too;
the root's (the embedding's output, whole on every rank) fall by less, so the whole by less still.
With parallel.sequence_parallel the block's 16 values are all split (its input, the norms' outputs
and the residual hold 1/tp of the positions), but the two gathered norm outputs (whole sequence,
C each) are kept by the column-parallel layers that read them, for their weight gradients
(Megatron gathers them again in backward instead; not done here yet): 16 / (16 / tp + 2), the
same as without at tp 2 (1.6x) and 2.7x at tp 4.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

from machine import cpu_description

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "build", "trainer", "fsdp-train")
RANKS = 4
CATEGORIES = ["params", "grads", "optimizer", "gathered", "activations", "other"]


def run(tp, sequence_parallel, args, workdir):
    run_dir = os.path.join(workdir, f"tp{tp}{'-sp' if sequence_parallel else ''}")
    cmd = [TRAIN, "--nproc", str(RANKS), os.path.join(ROOT, "configs", "demo.toml"),
           "--model.preset=gpt2-350m", f"--model.n_layer={args.layers}",
           f"--training.seq_len={args.seq}", "--training.batch_size=1",
           f"--training.steps={args.steps}", "--training.warmup_steps=1",
           "--training.eval_every=0", "--training.eval_batches=1", "--generate.tokens=0",
           "--precision.param_dtype=fp32", "--logging.plot=false", "--logging.progress=none",
           f"--parallel.tp={tp}", f"--logging.run_dir={run_dir}", "--plan"]
    if sequence_parallel:
        cmd.append("--parallel.sequence_parallel=true")
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    with open(os.path.join(run_dir, "plan.json")) as f:
        return metrics, json.load(f)


def analytic_ratio(tp, sequence_parallel):
    """Activations per rank at tp against tp = 1, per block (the blocks dominate); see the
    module docstring."""
    return 16 / (12 / tp + 4) if not sequence_parallel else 16 / (16 / tp + 2)


def mib(b):
    return f"{b / 2**20:.1f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    print(f"CPU: {cpu_description()}")
    print(f"Model: gpt2-350m's blocks (width 1024, 16 heads), {args.layers} of them, the demo's "
          f"vocabulary; {RANKS} ranks, one sequence of {args.seq} tokens per tp group, fp32, "
          f"step {args.steps} (AdamW state exists).\n")
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for tp, sp in ((1, False), (2, False), (4, False), (2, True), (4, True)):
            metrics, plan = run(tp, sp, args, workdir)
            rows.append((tp, sp, metrics[-1], plan))
    base = rows[0][2]
    print("| (dp, tp) | peak MiB | vs (4, 1) | " + " | ".join(CATEGORIES) +
          " | activations vs (4, 1) (expected) | tp traffic per step | step s |")
    print("|" + " --- |" * (len(CATEGORIES) + 6))
    for tp, sp, m, _ in rows:
        cells = " | ".join(mib(m[f"mem_{c}_bytes"]) for c in CATEGORIES)
        act = base["mem_activations_bytes"] / max(1, m["mem_activations_bytes"])
        traffic = mib(m.get("tp_bytes", 0)) + " MiB" if tp > 1 else "-"
        print(f"| ({RANKS // tp}, {tp}){' + sequence parallel' if sp else ''} | "
              f"{mib(m['peak_bytes'])} | {m['peak_bytes'] / base['peak_bytes']:.0%} | {cells} | "
              f"{act:.2f}x less ({analytic_ratio(tp, sp):.2f}x) | {traffic} | "
              f"{m['step_time_s']:.2f} |")
    print("\nMiB at the peak of the rank with the highest one (its categories sum to it). "
          "Expected activation ratio: 16 / (12 / tp + 4) for the blocks (the module docstring); "
          "the root's activations are not split.\n")
    print("The planner (fsdp-train --plan) against rank 0's measurement: the step's peak (and "
          "without Gloo's staging buffers), the activations' own highest value in the step, "
          "and the tp group's bytes per step:\n")
    print("| (dp, tp) | peak predicted MiB (without staging) | measured | error | moment "
          "predicted / measured | activations' peak predicted MiB | measured | error | "
          "activations vs (4, 1), predicted / measured | tp traffic predicted B/step | "
          "measured (tp_bytes) |")
    print("|" + " --- |" * 11)
    base_act = rows[0][3]["predicted"]["category_peaks"]["activations"]
    base_act_measured = rows[0][3]["measured"]["category_peaks"]["activations"]
    for tp, sp, m, plan in rows:
        pr, me = plan["predicted"], plan["measured"]
        pa, ma = pr["category_peaks"]["activations"], me["category_peaks"]["activations"]
        traffic = plan.get("traffic", {}).get("tp", {}).get("bytes", 0)
        print(f"| ({RANKS // tp}, {tp}){' + sequence parallel' if sp else ''} | "
              f"{mib(pr['peak'])} ({mib(pr['peak_without_staging'])}) | {mib(me['peak'])} | "
              f"{pr['peak'] / me['peak'] - 1:+.1%} | {pr['moment']} / {me['moment']} | "
              f"{mib(pa)} | {mib(ma)} | {pa / max(1, ma) - 1:+.1%} | "
              f"{base_act / max(1, pa):.2f}x / {base_act_measured / max(1, ma):.2f}x less | "
              f"{traffic:,} | {m.get('tp_bytes', 0):,} |")
    print("\nWith dp = 1 the world is the tp group, and the trainer's global norm all-reduce "
          "(8 bytes per step) is counted in tp_bytes too; the planner counts the model's "
          "collectives.")


if __name__ == "__main__":
    sys.exit(main())
