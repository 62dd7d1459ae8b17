#!/usr/bin/env python3
"""The planner's memory prediction against measurement (issue 26): runs fsdp-train --plan on a
grid of configurations (GPT and Llama presets, SmolLM2 LoRA/QLoRA, world sizes 1-4, every
strategy, precisions, gather formats, activation checkpointing, offload, optimizers,
accumulation) for a few steps each, reads each run's plan.json (rank 0: the prediction made
before step 1, at the measured step's sequence length, and the highest tracked peak of the
steady steps) and prints one Markdown row per configuration, then the median and worst absolute
error of the peak.

    bench/plan_accuracy.py [--build build] [--only SUBSTRING] [--steps 4] [--out table.md]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_description  # noqa: E402

TINY = ["configs/demo.toml"]
SMALL = ["configs/demo.toml", "--model.preset=gpt2-small", "--training.seq_len=256",
         "--training.batch_size=4"]
LLAMA = ["configs/llama-tiny.toml"]
LORA = ["finetune", "configs/smollm2-lora.toml", "--finetune.samples=0"]

# (name, world size, arguments)
GRID = [
    ("gpt2-tiny full_shard fp32", 1, TINY),
    ("gpt2-tiny full_shard fp32", 2, TINY),
    ("gpt2-tiny full_shard fp32", 3, TINY),
    ("gpt2-tiny full_shard fp32", 4, TINY),
    ("gpt2-tiny shard_grad_op", 2, TINY + ["--fsdp.strategy=shard_grad_op"]),
    ("gpt2-tiny no_shard", 2, TINY + ["--fsdp.strategy=no_shard"]),
    ("gpt2-tiny hybrid_shard 2x2", 4, TINY + ["--fsdp.strategy=hybrid_shard",
                                              "--fsdp.hybrid_shard_size=2"]),
    ("gpt2-tiny reshard_after_forward_size 2", 4, TINY + ["--fsdp.reshard_after_forward_size=2"]),
    ("gpt2-tiny bf16", 2, TINY + ["--precision.param_dtype=bf16"]),
    ("gpt2-tiny bf16, int8 gather", 2, TINY + ["--precision.param_dtype=bf16",
                                                "--precision.gather_format=int8"]),
    ("gpt2-tiny fp32, bf16 gather", 2, TINY + ["--precision.gather_format=bf16"]),
    ("gpt2-tiny bf16, root fp32, bf16 reduce", 2, TINY + ["--precision.param_dtype=bf16",
                                                           "--precision.root_fp32=true",
                                                           "--precision.reduce_dtype=bf16"]),
    ("gpt2-tiny AC selective", 2, TINY + ["--fsdp.activation_checkpointing=selective"]),
    ("gpt2-tiny AC full", 2, TINY + ["--fsdp.activation_checkpointing=full"]),
    ("gpt2-tiny AC full every 2", 2, TINY + ["--fsdp.activation_checkpointing=full",
                                              "--fsdp.ac_every=2"]),
    ("gpt2-tiny CPU offload", 2, TINY + ["--fsdp.cpu_offload=true"]),
    ("gpt2-tiny bf16 moments", 2, TINY + ["--optimizer.moments_dtype=bf16"]),
    ("gpt2-tiny optimizer state in a file", 2, TINY + ["--optimizer.offload=file",
                                                        "--optimizer.chunk_mb=1"]),
    ("gpt2-tiny torch::optim::AdamW", 2, TINY + ["--optimizer.name=adamw"]),
    ("gpt2-tiny SGD momentum", 2, TINY + ["--optimizer.name=sgd", "--training.lr=0.1"]),
    ("gpt2-tiny 2 micro-batches", 2, TINY + ["--training.micro_batches=2"]),
    ("gpt2-tiny 2 micro-batches, no sync", 2, TINY + ["--training.micro_batches=2",
                                                       "--fsdp.sync_every_micro_batch=false"]),
    ("gpt2-tiny backward_post, 1 in flight", 2, TINY + ["--fsdp.backward_prefetch=backward_post",
                                                         "--fsdp.max_inflight_all_gathers=1"]),
    # Moved here from TrainerRun.PlanPredictsThePeakWithinFivePercent, which keeps one case
    # of each mechanism (issue 42: each test within 25 s).
    ("gpt2-tiny AC selective, bf16 moments", 3, TINY + ["--fsdp.activation_checkpointing=selective",
                                                         "--optimizer.moments_dtype=bf16"]),
    ("gpt2-tiny shard_grad_op, int8 gather, 2 micro-batches", 2,
     TINY + ["--fsdp.strategy=shard_grad_op", "--precision.gather_format=int8",
             "--training.micro_batches=2"]),
    ("gpt2-tiny unfused loss", 2, TINY + ["--training.loss_chunk=-1"]),
    ("gpt2-tiny int8 reduce and gather", 3, TINY + ["--precision.reduce_format=int8",
                                                     "--precision.gather_format=int8"]),
    ("gpt2-tiny optimizer in backward, 2 x 16 tokens", 2,
     TINY + ["--fsdp.optimizer_in_backward=true", "--training.grad_clip=0",
             "--training.batch_size=2", "--training.seq_len=16"]),
    ("gpt2-small full_shard fp32", 3, SMALL),
    ("gpt2-small bf16 AC full", 2, SMALL + ["--precision.param_dtype=bf16",
                                             "--fsdp.activation_checkpointing=full"]),
    ("gpt2-small shard_grad_op AC selective", 4, SMALL + ["--fsdp.strategy=shard_grad_op",
                                                           "--fsdp.activation_checkpointing="
                                                           "selective"]),
    ("llama-tiny full_shard fp32", 1, LLAMA),
    ("llama-tiny full_shard fp32", 2, LLAMA),
    ("llama-tiny bf16 AC selective", 3, LLAMA + ["--precision.param_dtype=bf16",
                                                  "--fsdp.activation_checkpointing=selective"]),
    ("llama-tiny hybrid_shard 2x2", 4, LLAMA + ["--fsdp.strategy=hybrid_shard",
                                                "--fsdp.hybrid_shard_size=2"]),
    ("SmolLM2-135M LoRA bf16", 2, LORA),
    ("SmolLM2-135M QLoRA bf16", 2, LORA + ["--finetune.method=qlora"]),
    ("SmolLM2-135M LoRA bf16 AC full", 1, LORA + ["--fsdp.activation_checkpointing=full"]),
]


def mib(b):
    return f"{b / 2**20:.2f}"


def largest(categories):
    return max(categories, key=lambda k: categories[k])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--only", default="", help="run the rows whose name contains this")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default="", help="also write the table to this file")
    args = ap.parse_args()
    trainer = os.path.join(args.build, "trainer", "fsdp-train")
    lines = [f"Machine: {cpu_description()}", "",
             "| configuration | ranks | predicted peak MiB | without Gloo staging | measured MiB | "
             "error | predicted moment | measured moment | largest category | predicted step s | "
             "measured s | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    errors, time_errors = [], []
    started = time.time()
    for name, world, cfg in GRID:
        if args.only and args.only not in name:
            continue
        with tempfile.TemporaryDirectory() as run_dir:
            cmd = [trainer] + cfg[:1] + ["--nproc", str(world)] + cfg[1:] + [
                "--plan", f"--training.steps={args.steps}", "--training.eval_every=0",
                "--training.eval_batches=1", "--generate.tokens=1", "--logging.plot=false",
                "--logging.progress=none", f"--logging.run_dir={run_dir}"]
            if cfg[0] == "finetune":
                cmd = [trainer, "finetune", "--nproc", str(world)] + cfg[1:] + cmd[len(cfg) + 3:]
            done = subprocess.run(cmd, capture_output=True, text=True)
            path = os.path.join(run_dir, "plan.json")
            if done.returncode != 0 or not os.path.exists(path):
                print(f"| {name} | {world} | failed: {done.stderr.strip()[-300:]} |", flush=True)
                errors.append(float("inf"))
                continue
            with open(path) as f:
                plan = json.load(f)
        p, m = plan["predicted"], plan["measured"]
        err = 100.0 * (p["peak"] - m["peak"]) / m["peak"]
        errors.append(abs(err))
        same = largest(p["categories"]) == largest(m["categories"])
        # The measured moment's predicted height, as a fraction of the predicted peak.
        there = p["moments"].get(m["moment"], -1) / p["peak"]
        row = (f"| {name} | {world} | {mib(p['peak'])} | {mib(p['peak_without_staging'])} | "
               f"{mib(m['peak'])} | {err:+.1f}% | "
               f"{p['moment']} | {m['moment']}"
               f"{'' if m['moment'] == p['moment'] else f' ({100 * there:.1f}% of the peak there)'}"
               f" | {largest(m['categories'])}"
               f"{'' if same else ' (predicted ' + largest(p['categories']) + ')'} |")
        timing = plan.get("time")
        if timing and timing["measured"]["step"] > 0:
            terr = 100.0 * (timing["predicted"]["step"] - timing["measured"]["step"]) / \
                timing["measured"]["step"]
            time_errors.append((abs(terr), timing["method"]))
            row += (f" {timing['predicted']['step']:.4f} | {timing['measured']['step']:.4f} | "
                    f"{terr:+.1f}%{'' if 'blocks' in timing['method'] else ' (pieces)'} |")
        else:
            row += " | | |"
        lines.append(row)
        print(row, flush=True)
    finite = [e for e in errors if e != float("inf")]
    summary = (f"\n{len(finite)} of {len(errors)} configurations ran; |error| median "
               f"{statistics.median(finite):.1f}%, worst {max(finite):.1f}% "
               f"({time.time() - started:.0f} s)" if finite else "\nnothing ran")
    by_blocks = [e for e, method in time_errors if "blocks" in method]
    if by_blocks:
        summary += (f"\nstep time (the job with 1 and 3 blocks, {len(by_blocks)} configurations): "
                    f"|error| median {statistics.median(by_blocks):.1f}%, worst "
                    f"{max(by_blocks):.1f}%")
    pieces = [e for e, method in time_errors if "blocks" not in method]
    if pieces:
        summary += (f"\nstep time (timed pieces and links, fine-tuning, {len(pieces)} "
                    f"configurations): |error| median {statistics.median(pieces):.1f}%, worst "
                    f"{max(pieces):.1f}%")
    lines.append(summary)
    print(summary)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0 if finite and len(finite) == len(errors) else 1


if __name__ == "__main__":
    sys.exit(main())
