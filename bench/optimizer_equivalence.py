#!/usr/bin/env python3
"""Same math, on the demo model: fsdp-train with configs/demo.toml (gpt2-tiny on the KJV, 2
ranks, FULL_SHARD) for STEPS steps with each optimizer, one command (from the repository root,
after the build and once the demo's data exist, e.g. after `scripts/run.sh demo`):

    ~/.cache/fsdp-cpp/torch-$(cat .torch-version)/bin/python bench/optimizer_equivalence.py

Runs torch::optim::AdamW, fsdp::FusedAdamW (fp32 moments, in memory), the same with its state
offloaded to a file, and FusedAdamW with bf16 moments. Every run saves a sharded checkpoint at
step 100 and at the end; the script compares the parameters of the checkpoints (max |diff|
and max relative diff over every tensor) and the loss curves. The state file of the offloaded
run is checked bitwise against the in-memory one (checkpoint rank files byte for byte).
"""
import json
import re
import os
import shutil
import statistics
import subprocess
import sys

import numpy as np
from safetensors.numpy import load_file

from machine import cpu_description

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "build", "trainer", "fsdp-train")
WORK = os.path.join(ROOT, "build", "optimizer-equivalence")
STEPS = 200

RUNS = {
    "torch AdamW": ["--optimizer.name=adamw"],
    # The noise floor: torch's own AdamW with ATen's AVX2 kernels instead of its AVX-512 ones
    # (ulp-level differences in elementwise ops and reductions), against itself.
    "torch AdamW, ATen AVX2": ["--optimizer.name=adamw"],
    "fused fp32": ["--optimizer.name=adamw_fused"],
    "fused fp32, file": ["--optimizer.name=adamw_fused", "--optimizer.offload=file"],
    "fused bf16": ["--optimizer.name=adamw_fused", "--optimizer.moments_dtype=bf16"],
}


def run(name, extra):
    env = dict(os.environ)
    if "AVX2" in name:
        env["ATEN_CPU_CAPABILITY"] = "avx2"
    run_dir = os.path.join(WORK, name.replace(" ", "_").replace(",", ""))
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [TRAIN, "--nproc", "2", os.path.join(ROOT, "configs", "demo.toml"),
           f"--training.steps={STEPS}", "--training.eval_every=0", "--generate.tokens=0",
           "--logging.plot=false", "--logging.progress=none", "--checkpoint.every=100",
           "--checkpoint.keep=2", f"--logging.run_dir={run_dir}"] + extra
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"{name} failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    losses = [json.loads(l)["loss"] for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    return run_dir, losses


def params(run_dir, step):
    d = os.path.join(run_dir, "checkpoints", f"step-{step:08d}")
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            for k, v in load_file(os.path.join(d, f)).items():
                if k.startswith("model/"):
                    out.setdefault(k, []).append(v)
    return {k: np.concatenate(v) for k, v in out.items()}, d


def compare(a, b):
    max_abs = max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
    scale = max(float(np.max(np.abs(a[k]))) for k in a)
    return max_abs, scale


def main():
    print("machine:", cpu_description())
    os.makedirs(WORK, exist_ok=True)
    results = {name: run(name, extra) for name, extra in RUNS.items()}
    ref_dir, ref_losses = results["torch AdamW"]
    fused_dir, fused_losses = results["fused fp32"]
    for step in (100, STEPS):
        ref, _ = params(ref_dir, step)
        fused, _ = params(fused_dir, step)
        max_abs, scale = compare(fused, ref)
        print(f"step {step}: fused vs torch AdamW parameters: max |diff| {max_abs:.3g} (largest "
              f"|parameter| {scale:.3g}); loss at step {step}: {ref_losses[step - 1]:.6f} vs "
              f"{fused_losses[step - 1]:.6f}")
    avx2_dir, avx2_losses = results["torch AdamW, ATen AVX2"]
    for step in (100, STEPS):
        max_abs, _ = compare(params(avx2_dir, step)[0], params(ref_dir, step)[0])
        print(f"step {step}: noise floor, torch AdamW with ATen's AVX2 kernels vs AVX-512: max "
              f"|diff| {max_abs:.3g}")
    gaps = [abs(a - b) for a, b in zip(ref_losses, avx2_losses)]
    print(f"loss gap torch AVX2 vs torch AVX-512 over {STEPS} steps: max {max(gaps):.3g}, mean "
          f"{statistics.mean(gaps):.3g}")
    gaps = [abs(a - b) for a, b in zip(ref_losses, fused_losses)]
    print(f"loss gap fused vs torch over {STEPS} steps: max {max(gaps):.3g}, mean {statistics.mean(gaps):.3g}")
    file_dir, file_losses = results["fused fp32, file"]
    same = all(
        open(os.path.join(fused_dir, "checkpoints", f"step-{STEPS:08d}", f), "rb").read()
        == open(os.path.join(file_dir, "checkpoints", f"step-{STEPS:08d}", f), "rb").read()
        for f in os.listdir(os.path.join(fused_dir, "checkpoints", f"step-{STEPS:08d}"))
        if f.endswith(".safetensors"))
    print(f"file offload vs in memory: losses identical {file_losses == fused_losses}, "
          f"step-{STEPS} checkpoint rank files byte-identical {same}")
    bf16_dir, bf16_losses = results["fused bf16"]
    gaps = [abs(a - b) for a, b in zip(fused_losses, bf16_losses)]
    rel = [abs(a - b) / a for a, b in zip(fused_losses, bf16_losses)]
    tail = slice(STEPS - 50, STEPS)
    changes = [abs(fused_losses[i] - fused_losses[i - 1]) for i in range(STEPS - 50, STEPS)]
    print(f"bf16 vs fp32 moments over {STEPS} steps: max loss gap {max(gaps):.4f} "
          f"({100 * max(rel):.2f}% relative, step {gaps.index(max(gaps)) + 1}); mean gap over the "
          f"last 50 steps {statistics.mean(gaps[tail]):.4f} (fp32's own mean step-to-step change "
          f"there: {statistics.mean(changes):.4f}); final loss {fused_losses[-1]:.4f} vs "
          f"{bf16_losses[-1]:.4f}")
    memory_with_offload()
    shutil.rmtree(WORK, ignore_errors=True)


def memory_with_offload():
    """Per-rank peak tracked memory of gpt2-124m (124.4M parameters, 2 ranks, a few steps) with
    FusedAdamW's state in memory and in a file: the drop against the analytic state bytes."""
    rows = {}
    for name, extra in (("in memory", []),
                        ("file", ["--optimizer.offload=file", "--optimizer.chunk_mb=16"])):
        run_dir = os.path.join(WORK, "mem-" + name.replace(" ", "_"))
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [TRAIN, "--nproc", "2", os.path.join(ROOT, "configs", "demo.toml"),
               "--model.preset=gpt2-124m", "--training.steps=4", "--training.batch_size=1",
               "--training.seq_len=64", "--training.eval_every=0", "--training.eval_batches=1",
               "--generate.tokens=0", "--logging.plot=false", "--logging.progress=lines",
               f"--logging.run_dir={run_dir}", "--optimizer.name=adamw_fused"] + extra
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"gpt2-124m {name} failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
        lines = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
        rows[name] = lines[-1]
        # "... 12 layers, width 768, 87.42M parameters on 2 rank(s)": the demo's vocabulary
        # (2048) replaces GPT-2's 50257, hence fewer than 124M.
        match = re.search(r"([0-9.]+)M parameters", r.stdout + r.stderr)
        rows[name]["params"] = float(match.group(1)) * 1e6 if match else float("nan")
        rows[name]["opt_time"] = statistics.median(l["time_optimizer_s"] for l in lines[1:])
    for name, m in rows.items():
        print(f"gpt2-124m, 2 ranks, state {name}: peak {m['peak_bytes'] / 2**20:.1f} MiB, of which "
              f"optimizer {m['mem_optimizer_bytes'] / 2**20:.1f} MiB; optimizer step "
              f"{m['opt_time'] * 1e3:.0f} ms (median of steps 2-4)"
              + (f"; streamed {m['offload_read_bytes'] / 1e6:.0f} MB read + "
                 f"{m['offload_written_bytes'] / 1e6:.0f} MB written, waited "
                 f"{m['time_offload_wait_s'] * 1e3:.0f} ms" if 'offload_read_bytes' in m else ""))
    drop = rows["in memory"]["peak_bytes"] - rows["file"]["peak_bytes"]
    opt_drop = rows["in memory"]["mem_optimizer_bytes"] - rows["file"]["mem_optimizer_bytes"]
    # Analytic: exp_avg + exp_avg_sq in fp32 for half the parameters (2 ranks; the padding of
    # rows and 64-element slots is below 0.1 MiB here), minus two 16 MiB chunk buffers.
    analytic = 8 * rows["in memory"]["params"] / 2
    print(f"{rows['in memory']['params'] / 1e6:.2f}M parameters: peak drop with offload "
          f"{drop / 2**20:.1f} MiB, optimizer category at the peak {opt_drop / 2**20:.1f} MiB; "
          f"analytic: state {analytic / 2**20:.1f} MiB per rank minus two chunk buffers (32.0 MiB)"
          f" = {(analytic - 2 * 16 * 2**20) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
