#!/usr/bin/env python3
"""Per-rank memory by category, measured, for fp32 / bf16 / bf16 + full AC / bf16 + selective AC.

One command (from the repository root, after the build):

    ~/.cache/fsdp-cpp/torch-$(cat .torch-version)/bin/python bench/memory_table.py

runs fsdp-train on 2 ranks for a few steps per variant on one fixed GPT shape and prints a
markdown table of what the peak is made of (fsdp::memory categories of the rank with the
highest peak, at that peak: they sum to it), beside the analytic value of each category at
the moment that variant peaks (see analytic(); "other", the token batch and small buffers, has
none), and the tokens/s of each variant. The CPU model and flags are printed first: the speed of bf16
depends on them.
"""
import json
import os
import subprocess
import sys
import tempfile

from gpt_shapes import gpt_param_shapes, padded
from machine import cpu_description

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "build", "trainer", "fsdp-train")
RANKS = 2
SHAPE = dict(n_layer=4, n_embd=384, n_head=6, vocab=2048, seq=256, batch=8)
STEPS = 3
VARIANTS = [
    ("fp32", []),
    ("fp32 + full AC", ["--fsdp.activation_checkpointing=full"]),
    ("bf16", ["--precision.param_dtype=bf16"]),
    ("bf16 + full AC", ["--precision.param_dtype=bf16", "--fsdp.activation_checkpointing=full"]),
    ("bf16 + selective AC",
     ["--precision.param_dtype=bf16", "--fsdp.activation_checkpointing=selective"]),
]
CATEGORIES = ["params", "grads", "optimizer", "gathered", "activations", "other"]


def shapes():
    """(rows, cols) of every parameter: blocks, then the root unit."""
    return gpt_param_shapes(SHAPE["n_embd"], SHAPE["vocab"], SHAPE["seq"])


def analytic(name):
    """Closed form of every category at the moment the variant peaks (MiB-exact byte counts).

    Without full checkpointing the peak is the loss's log-softmax backward: every block's saved
    activations, the root's, and three fp32 logit-sized tensors (logits, log-softmax output,
    its gradient). A block saves 16 values of width C per token in the compute dtype: its
    input, ln_1 out, qkv (3C, which attention keeps as q/k/v views), attention out (C, already
    in (B, T, C) order), h, ln_2 out, fc out (4C), gelu out (4C); plus fp32 norm statistics (2
    per norm) and attention's log-sum-exp (one per head). Selective checkpointing keeps, per
    block, the input and copies of the matmul and attention outputs: 3C + C + C + 4C + C.
    With full checkpointing the peak moves into backward, to the GELU backward of block L-2
    while block L-1's reduce-scatter is in flight: saved block inputs (L-1), block L-2
    recomputed (15 more C), the block's output gradient (C) and the GELU's input and output
    gradients (8C); gathered: the root,
    block L-2 and block L-3 prefetched (whose gather is not waited for yet: in bf16 its cast
    copy of the shard is still alive); grads: the root's unsharded grads (compute dtype) and
    block L-1's reduce-scatter buffers (input, received copy and output, reduce dtype fp32).
    """
    block, root = shapes()
    C, V, H, L = SHAPE["n_embd"], SHAPE["vocab"], SHAPE["n_head"], SHAPE["n_layer"]
    tokens = SHAPE["batch"] * SHAPE["seq"]
    e = 2 if "bf16" in name else 4
    shard = padded(block, RANKS) * L + padded(root, RANKS)
    root_full = RANKS * padded(root, RANKS)
    block_full = RANKS * padded(block, RANKS)
    stats = 2 * 2 * 4 + H * 4  # per block and token, fp32
    logits = 3 * V * 4
    out = {"params": 4 * shard, "optimizer": 8 * shard}
    if "full AC" in name:
        act_c = (L - 1) + 15 + 1 + 8
        out["activations"] = tokens * (act_c * C * e + stats)
        cast_input = padded(block, RANKS) * e if e != 4 else 0
        out["gathered"] = (root_full + 2 * block_full) * e + cast_input
        out["grads"] = root_full * e + (2 * block_full + padded(block, RANKS)) * 4
    else:
        per_block = (11 if "selective" in name else 16) * C * e + stats
        out["activations"] = tokens * (L * per_block + 2 * C * e + logits)
        out["gathered"] = root_full * e  # the root, held through forward and backward
        out["grads"] = 0
    return out


def run(name, extra, workdir):
    run_dir = os.path.join(workdir, name.replace(" ", "_").replace("+", ""))
    cmd = [TRAIN, "--nproc", str(RANKS), os.path.join(ROOT, "configs", "demo.toml"),
           f"--model.n_layer={SHAPE['n_layer']}", f"--model.n_embd={SHAPE['n_embd']}",
           f"--model.n_head={SHAPE['n_head']}", f"--training.seq_len={SHAPE['seq']}",
           f"--training.batch_size={SHAPE['batch']}", f"--training.steps={STEPS}",
           "--training.eval_every=0", "--training.eval_batches=1", "--generate.tokens=0",
           "--logging.plot=false", "--logging.progress=none", f"--logging.run_dir={run_dir}",
           ] + extra
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def mib(b):
    return f"{b / 2**20:.1f}"


def main():
    print(f"CPU: {cpu_description()}")
    print(f"Model: GPT, {SHAPE['n_layer']} layers, width {SHAPE['n_embd']}, vocab "
          f"{SHAPE['vocab']}; {RANKS} ranks full_shard, batch {SHAPE['batch']} x "
          f"{SHAPE['seq']} tokens per rank; step {STEPS} (AdamW state exists).\n")
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for name, extra in VARIANTS:
            m = run(name, extra, workdir)
            last = m[-1]
            measured = {c: last[f"mem_{c}_bytes"] for c in CATEGORIES}
            want = analytic(name)
            rows.append((name, last["peak_bytes"], measured, want, last["tokens_per_second"]))
    base = rows[0][1]
    print("| variant | peak MiB | vs fp32 | " + " | ".join(CATEGORIES) + " | tokens/s |")
    print("|" + " --- |" * (len(CATEGORIES) + 4))
    for name, peak, measured, want, tps in rows:
        cells = []
        for c in CATEGORIES:
            cell = mib(measured[c])
            if c in want:
                cell += f" ({mib(want[c])})"
            cells.append(cell)
        print(f"| {name} | {mib(peak)} | {peak / base:.0%} | " + " | ".join(cells) +
              f" | {tps:.0f} |")
    worst = max(abs(m[c] - w[c]) / w[c] for _, _, m, w, _ in rows for c in w if w[c] > 0)
    print("\n'other' is memory allocated outside any category: Gloo's staging buffers of a "
          "gather still in flight at the peak (allocated on Gloo's thread), when there is one.")
    print("\nMiB measured at the peak, analytic in parentheses (the closed forms and the moment "
          f"each variant peaks: analytic() in bench/memory_table.py). Largest relative gap "
          f"between a measured category and its analytic value: {worst:.1%}.")


if __name__ == "__main__":
    sys.exit(main())
