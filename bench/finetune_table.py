#!/usr/bin/env python3
"""Full fine-tuning vs LoRA vs QLoRA of SmolLM2-135M-Instruct: per-rank memory by category and
tokens/s, beside the analytic sizes.

One command (from the repository root, after the build):

    ~/.cache/fsdp-cpp/torch-$(cat .torch-version)/bin/python bench/finetune_table.py

runs `fsdp-train finetune` (configs/smollm2-lora.toml, the KJV instruction set, batch 4
conversations per rank; bf16 compute unless `--dtype fp32` or `--dtype auto`) on 2 ranks for each method, in interleaved rounds (full, lora,
qlora, full, lora, qlora) so that machine noise hits all three alike, and prints a markdown
table: the peak of the rank with the highest one and what it is made of (fsdp::memory
categories at that peak; they sum to it), the analytic size of the sharded parameters and of the
optimizer state, the resident bits per quantized block weight, the all-gather bytes per step,
and tokens/s (median of the steps after the first two, median over rounds, with the spread).
The CPU model and flags are printed first: bf16 speed depends on them (on a CPU without AVX-512
BF16 or AMX, bf16 runs ~20x slower than fp32: use `--dtype fp32` there).
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

from machine import cpu_description

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "build", "trainer", "fsdp-train")
RANKS = 2
STEPS = 8
ROUNDS = 2
METHODS = ["full", "lora", "qlora"]
CATEGORIES = ["params", "grads", "optimizer", "gathered", "activations", "other"]
# SmolLM2-135M: vocab, width, layers, heads, k/v heads, SwiGLU width; tied embeddings.
V, D, L, H, KV, F = 49152, 576, 30, 9, 3, 1536
RANK, TARGETS = 8, ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]


def linears():
    """(name, out, in) of one block's Linear layers."""
    kv = D // H * KV
    return [("wq", D, D), ("wk", kv, D), ("wv", kv, D), ("wo", D, D), ("w1", F, D),
            ("w2", D, F), ("w3", F, D)]


def shard(rows):
    return math.ceil(rows / RANKS)


def analytic(method):
    """Bytes per rank of the sharded parameters (all of them: frozen and trainable) and of the
    AdamW state (fp32 m and v of the trainable ones), and bits per quantized weight."""
    params = 4 * (shard(V) * D + (2 * L + 1) * shard(D))  # embedding (tied head), norms
    trainable = 0 if method != "full" else V * D + (2 * L + 1) * D
    nf4_bytes = nf4_weights = 0
    for _, out, inp in linears():
        if method == "qlora":
            n = out * inp
            blocks = n // 64
            b = shard(out) * (inp // 2) + shard(blocks) + 4 * shard(math.ceil(blocks / 256)) + 4
            nf4_bytes += L * b
            nf4_weights += L * shard(out) * inp
            params += L * b
        else:
            params += L * 4 * shard(out) * inp
            trainable += L * out * inp if method == "full" else 0
        if method != "full":  # A (rank, in) and B (out, rank), fp32
            params += L * 4 * (shard(RANK) * inp + shard(out) * RANK)
            trainable += L * (RANK * inp + out * RANK)
    optimizer = 8 * trainable / RANKS
    bits = 8 * nf4_bytes / nf4_weights if nf4_weights else None
    return {"params": params, "optimizer": optimizer, "trainable": trainable, "bits": bits}


def run(method, round_, workdir, dtype):
    run_dir = os.path.join(workdir, f"{method}-{round_}")
    cmd = [TRAIN, "finetune", "--nproc", str(RANKS),
           os.path.join(ROOT, "configs", "smollm2-lora.toml"), f"--finetune.method={method}",
           f"--training.steps={STEPS}", f"--precision.param_dtype={dtype}",
           "--training.eval_every=0", "--finetune.samples=0",
           "--finetune.save_adapter=false", "--logging.plot=false", "--logging.progress=none",
           f"--logging.run_dir={run_dir}"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def mib(b):
    return f"{b / 2**20:.1f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["bf16", "fp32", "auto"], default="bf16",
                        help="precision.param_dtype of every run (default bf16)")
    args = parser.parse_args()
    print(f"CPU: {cpu_description()}")
    print(f"SmolLM2-135M-Instruct (134.5M parameters), {RANKS} ranks full_shard, "
          f"{args.dtype} compute, "
          f"4 conversations per rank per step, {STEPS} steps x {ROUNDS} rounds per method; LoRA "
          f"rank {RANK} on {', '.join(TARGETS)}.\n")
    runs = {m: [] for m in METHODS}
    with tempfile.TemporaryDirectory() as workdir:
        for r in range(ROUNDS):
            for m in METHODS:
                runs[m].append(run(m, r, workdir, args.dtype))
    print("| method | trainable | peak MiB | " + " | ".join(CATEGORIES) +
          " | all-gather MiB/step | tokens/s |")
    print("|" + " --- |" * (len(CATEGORIES) + 5))
    notes = []
    for m in METHODS:
        want = analytic(m)
        peaks, speeds = [], []
        for metrics in runs[m]:
            top = max(metrics, key=lambda s: s["peak_bytes"])
            peaks.append(top)
            speeds.append(statistics.median(s["tokens_per_second"] for s in metrics[2:]))
        top = max(peaks, key=lambda s: s["peak_bytes"])
        cells = []
        for c in CATEGORIES:
            cell = mib(top[f"mem_{c}_bytes"])
            if c in want:
                cell += f" ({mib(want[c])})"
            cells.append(cell)
        gather = statistics.mean(s["allgather_bytes"] for s in runs[m][0])
        spread = f"{min(speeds):.0f}-{max(speeds):.0f}"
        print(f"| {m} | {want['trainable'] / 1e6:.2f}M | {mib(top['peak_bytes'])} | " +
              " | ".join(cells) + f" | {mib(gather)} | {statistics.median(speeds):.0f} "
              f"({spread}) |")
        if want["bits"]:
            notes.append(f"{m}: block weights resident at {want['bits']:.3f} bits per weight "
                         "(NF4 codes, 8-bit absmaxes, fp32 scales and offset, this rank's rows)")
    print("\nMiB at the peak of the rank with the highest one; analytic sizes in parentheses "
          "(params: every sharded parameter, frozen or trainable; optimizer: AdamW's fp32 m and "
          "v of the trainable ones; analytic() in bench/finetune_table.py).")
    for n in notes:
        print(n)


if __name__ == "__main__":
    sys.exit(main())
