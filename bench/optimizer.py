#!/usr/bin/env python3
"""The optimizer step against the alternatives, one command (from the repository root, after
the build):

    ~/.cache/fsdp-cpp/torch-$(cat .torch-version)/bin/python bench/optimizer.py [--quick]

Runs build/bench/bench_optimizer (fsdp::FusedAdamW with fp32 and bf16 moments and with its
state in a file, torch::optim::AdamW, ATen's fused kernel at::_fused_adamw_, the machine's
memory bandwidth measured with AdamW's own access pattern, the file system's O_DIRECT read and
write speed) and DeepSpeed's CPU Adam (DeepSpeedCPUAdam, adamw_mode, fp32 state: its C++ op is
JIT-built by DeepSpeed on first use, which takes a minute), for 10M / 50M / 100M fp32
parameters on 1 and 2 threads. The two alternate, ROUNDS times, so that a noisy stretch of the
machine hits both; the table gives medians over rounds. DeepSpeed comes from PyPI into the
project's cached environment (pip install deepspeed==DEEPSPEED_VERSION) the first time.
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
BENCH = os.path.join(ROOT, "build", "bench", "bench_optimizer")
DEEPSPEED_VERSION = "0.19.8"
ROUNDS = 2

DS_SCRIPT = r"""
import json, sys, time, statistics, warnings, logging
warnings.filterwarnings("ignore")
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
sizes = json.loads(sys.argv[1]); threads = int(sys.argv[2]); rounds = int(sys.argv[3])
torch.set_num_threads(threads)
tensor_elems = 4 << 20
out = []
for n in sizes:
    torch.manual_seed(0)
    params = []
    done = 0
    while done < n:
        k = min(tensor_elems, n - done)
        p = torch.nn.Parameter(torch.randn(k))
        p.grad = torch.randn(k) * 1e-2
        params.append(p)
        done += k
    opt = DeepSpeedCPUAdam(params, lr=1e-4, weight_decay=0.1, adamw_mode=True,
                           fp32_optimizer_states=True)
    opt.step()  # allocates the state
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    out.append({"params": n, "threads": threads, "method": "DeepSpeedCPUAdam",
                "step_s": statistics.median(times)})
    del opt, params
print("RESULT " + json.dumps(out))
"""


def ensure_deepspeed(python):
    check = subprocess.run([python, "-c", "import deepspeed"], capture_output=True)
    if check.returncode == 0:
        return True
    print(f"installing deepspeed=={DEEPSPEED_VERSION} into {os.path.dirname(python)} (once)")
    r = subprocess.run([python, "-m", "pip", "install", "--quiet",
                        f"deepspeed=={DEEPSPEED_VERSION}"])
    return r.returncode == 0


def run_deepspeed(python, sizes, threads, rounds):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), DS_ACCELERATOR="cpu")
    r = subprocess.run([python, "-c", DS_SCRIPT, json.dumps(sizes), str(threads), str(rounds)],
                       capture_output=True, text=True, env=env)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    print("DeepSpeedCPUAdam did not run:\n" + r.stdout[-2000:] + r.stderr[-2000:])
    return []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="10M parameters only, one round")
    ap.add_argument("--offload-dir", default=None,
                    help="where the offloaded state goes (default: a directory under build/)")
    args = ap.parse_args()
    sizes = [10_000_000] if args.quick else [10_000_000, 50_000_000, 100_000_000]
    rounds = 1 if args.quick else ROUNDS
    scratch = tempfile.TemporaryDirectory(prefix="offload-", dir=os.path.join(ROOT, "build"))
    offload_dir = args.offload_dir or scratch.name
    python = sys.executable
    print("machine:", cpu_description())
    have_ds = ensure_deepspeed(python)
    results = {}  # (params, threads, method) -> list of step_s
    extra = {}  # (params, threads, method) -> last full record from bench_optimizer
    disk = None
    for r in range(rounds):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [BENCH, "--params", ",".join(str(s) for s in sizes), "--threads", "1,2",
                   "--rounds", "5", "--offload-dir", offload_dir, "--json", f.name]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit("bench_optimizer failed:\n" + out.stdout + out.stderr)
            if r == 0:
                print(out.stdout)
            data = json.load(open(f.name))
        disk = (data["disk_write_Bps"], data["disk_read_Bps"])
        for rec in data["results"]:
            key = (rec["params"], rec["threads"], rec["method"])
            results.setdefault(key, []).append(rec["step_s"])
            extra[key] = rec
        if have_ds:
            for t in (1, 2):
                for rec in run_deepspeed(python, sizes, t, 5):
                    results.setdefault((rec["params"], rec["threads"], rec["method"]), []).append(
                        rec["step_s"])
    print(f"\nSummary: medians over {rounds} round(s) of 5 steps each (Mparams/s; x: speed-up over"
          " torch::optim::AdamW; BW: bytes moved / measured bandwidth, 28 B per parameter with"
          " fp32 state, 20 with bf16)")
    methods = ["torch::optim::AdamW", "at::_fused_adamw_", "DeepSpeedCPUAdam", "fsdp::FusedAdamW",
               "fsdp::FusedAdamW bf16", "fsdp::FusedAdamW file"]
    print(f"{'params':>6} {'thr':>3} {'BW GB/s':>8}  " + "  ".join(f"{m:>24}" for m in methods))
    for n in sizes:
        for t in (1, 2):
            base = statistics.median(results[(n, t, methods[0])])
            bw = extra[(n, t, methods[0])]["bandwidth_Bps"]
            cells = []
            for m in methods:
                times = results.get((n, t, m))
                if not times:
                    cells.append(f"{'-':>24}")
                    continue
                s = statistics.median(times)
                bytes_per = 20 if "bf16" in m else 28
                cells.append(f"{n / s / 1e6:8.0f} {base / s:5.2f}x {100 * n * bytes_per / s / bw:4.0f}%BW")
            print(f"{n // 1_000_000:>5}M {t:>3} {bw / 1e9:8.1f}  " + "  ".join(f"{c:>24}" for c in cells))
    if disk:
        print(f"\nfile system ({offload_dir}): write {disk[0] / 1e9:.2f} GB/s, read {disk[1] / 1e9:.2f} GB/s (O_DIRECT)")
        for n in sizes:
            for t in (1, 2):
                rec = extra.get((n, t, "fsdp::FusedAdamW file"))
                if not rec:
                    continue
                s = statistics.median(results[(n, t, "fsdp::FusedAdamW file")])
                once = rec["io_read"] / disk[1] + rec["io_written"] / disk[0]
                print(f"  {n // 1_000_000}M, {t} thread(s): offloaded step {s * 1e3:.0f} ms, reading and writing"
                      f" its {rec['io_read'] / 1e6:.0f} MB of state once at the file system's speed"
                      f" {once * 1e3:.0f} ms: {s / once:.2f}x")
    if not have_ds:
        print("\nDeepSpeedCPUAdam: deepspeed could not be installed here")


if __name__ == "__main__":
    main()
