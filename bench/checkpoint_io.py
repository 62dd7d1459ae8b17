#!/usr/bin/env python3
"""Checkpoint I/O on a model of 124M parameters (GPT-2 small's shapes), 2 ranks: time, MB/s
beside the disk's own write speed, and each rank's extra tensor memory beside its bound.

One command (from the repository root, after the build):

    ~/.cache/fsdp-cpp/torch-$(cat .torch-version)/bin/python bench/checkpoint_io.py [--dir D]

D (default: a directory under build/) is where the files go; it should be on the disk you
care about. Disk speed on a virtual machine swings by several times from one second to the
next, so the measurement is interleaved, ROUNDS times: dd writing two streams of 512 MiB at once
(fdatasync: as two ranks write a sharded checkpoint) and one stream of 1 GiB (as rank 0 alone
writes an export), then build/bench/bench_checkpoint under torchrun, which
reports per operation the seconds, the bytes on disk and every rank's tracked tensor
high-water mark above what was live before it (the sharded parameters and AdamW state). Its first
operation, raw_write, is the baseline in the same processes: each rank writes as many bytes as
its checkpoint file from one tensor and fsyncs. The table gives medians and ranges; the bound each operation is held to is the issue's: sharded
state + one unit (the largest, unsharded) + the I/O buffer.
"""
import argparse
import json
import os
import statistics
import shutil
import subprocess
import sys
import time

from machine import cpu_description

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "build", "bench", "bench_checkpoint")
VENV_BIN = os.path.dirname(sys.executable)
MB = 1e6
MIB = 1 << 20
# The library's I/O buffers: a sharded checkpoint's checksum block (sharded_checkpoint.cpp) and
# ConsolidatedOptions::io_buffer_bytes.
BLOCK_BYTES = 4 * MIB
IO_BUFFER_BYTES = 16 * MIB
ROUNDS = 3


def dd_write_speed(directory, streams, mib_each):
    """MB/s of `streams` dd processes writing mib_each MiB each at once, fdatasync included."""
    paths = [os.path.join(directory, f"dd-{i}") for i in range(streams)]
    start = time.monotonic()
    procs = [subprocess.Popen(["dd", "if=/dev/zero", f"of={p}", "bs=4M", f"count={mib_each // 4}",
                               "conv=fdatasync"], stderr=subprocess.DEVNULL) for p in paths]
    for p in procs:
        p.wait()
    seconds = time.monotonic() - start
    for p in paths:
        os.remove(p)
    return streams * mib_each * MIB / MB / seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=os.path.join(ROOT, "build", "bench-checkpoint-io"))
    parser.add_argument("--preset", default="gpt2-124m")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    print(f"machine: {cpu_description()}")
    disk = subprocess.run(["df", "-h", args.dir], capture_output=True, text=True).stdout
    print(f"files in {args.dir} on {disk.splitlines()[-1].split()[0]}")

    env = dict(os.environ, OMP_NUM_THREADS="1")
    dd, dd1, runs = [], [], []
    for _ in range(ROUNDS):
        dd.append(dd_write_speed(args.dir, 2, 512))
        dd1.append(dd_write_speed(args.dir, 1, 1024))
        out = subprocess.run(
            [os.path.join(VENV_BIN, "torchrun"), "--standalone", "--no-python",
             "--nproc-per-node", "2", BENCH, "--dir", os.path.join(args.dir, "files"),
             "--preset", args.preset], capture_output=True, text=True, env=env)
        if out.returncode != 0:
            sys.exit(f"bench_checkpoint failed:\n{out.stdout}\n{out.stderr}")
        runs.append([json.loads(line) for line in out.stdout.splitlines()
                     if line.startswith("{")])
    shutil.rmtree(args.dir, ignore_errors=True)

    model = runs[0][0]
    print(f"model: {model['model']}, {model['params'] / 1e6:.1f}M parameters, "
          f"{model['ranks']} ranks; largest unit {model['largest_unit'] / MIB:.1f} MiB (the root: "
          f"embeddings + final norm), a block {model['block_unit'] / MIB:.1f} MiB, largest "
          f"parameter {model['largest_param'] / MIB:.1f} MiB, unsharded fp32")
    dd_median, dd1_median = statistics.median(dd), statistics.median(dd1)
    print(f"disk write speed, dd (4 MiB blocks, fdatasync), {ROUNDS} rounds: two 512 MiB "
          f"streams at once median {dd_median:.0f} MB/s in all (range {min(dd):.0f}-"
          f"{max(dd):.0f}); one 1 GiB stream median {dd1_median:.0f} MB/s (range "
          f"{min(dd1):.0f}-{max(dd1):.0f})")
    print()
    print("| operation | on disk | seconds, median (range) | MB/s | against | sharded state per rank "
          "| extra peak, rank 0 / rank 1 (largest of the rounds) | bound: one unit + I/O "
          "buffer |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    buffers = {"raw_write": 0, "save_sharded": 0, "load_sharded": BLOCK_BYTES,
               "save_hf": IO_BUFFER_BYTES, "load_hf": IO_BUFFER_BYTES}
    raw_mbps = None
    for i, first in enumerate(runs[0][1:]):
        op = first["op"]
        seconds = [run[1 + i]["seconds"] for run in runs]
        extra = [max(run[1 + i]["extra_peak"][r] for run in runs) for r in range(model["ranks"])]
        mbps = first["bytes"] / MB / statistics.median(seconds)
        bound = model["largest_unit"] + buffers[op]
        ok = "within" if max(extra) <= bound else "ABOVE"
        # The sharded save has every rank write, as raw_write and dd's two streams do; the
        # export has rank 0 write alone, as dd's one stream.
        if op == "raw_write":
            raw_mbps = mbps
        vs = {"raw_write": f"{mbps / dd_median:.2f}x dd (2 streams)",
              "save_sharded": f"{mbps / raw_mbps:.2f}x raw write, {mbps / dd_median:.2f}x dd "
                              f"(2 streams)",
              "save_hf": f"{mbps / dd1_median:.2f}x dd (1 stream)"}.get(op, "(read)")
        state = " / ".join(f"{b / MIB:.0f}" for b in first["state_bytes"])
        if op == "raw_write":  # a baseline: its own buffer is not checkpoint memory
            print(f"| {op} | {first['bytes'] / MB:.0f} MB | {statistics.median(seconds):.2f} "
                  f"({min(seconds):.2f}-{max(seconds):.2f}) | {mbps:.0f} | {vs} | - | - | - |")
            continue
        print(f"| {op} | {first['bytes'] / MB:.0f} MB | {statistics.median(seconds):.2f} "
              f"({min(seconds):.2f}-{max(seconds):.2f}) | {mbps:.0f} | {vs} | {state} MiB | "
              f"{' / '.join(f'{e / MIB:.1f}' for e in extra)} MiB | {bound / MIB:.1f} MiB ({ok}) |")
    print()
    print("Loads read what was just written: the files are written with O_DIRECT (not left in the "
          "page cache), so from the disk unless FSDP_DIRECT_WRITES=0.")


if __name__ == "__main__":
    main()
