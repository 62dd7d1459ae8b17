#!/usr/bin/env python3
"""fsdp-cpp on one NVIDIA GPU: the checks of docs/gpu.md, in one run, with one report.

    scripts/gpu_check.sh OUT_DIR            builds what it needs, then runs this
    python3 bench/gpu_check.py --build BUILD_DIR --out OUT_DIR [--deadline 480]
    python3 bench/gpu_check.py ... --cpu-dry-run   every section on the CPU, tiny sizes

Sections, in order (each writes its part of the report as soon as it ends, so a run cut short
still reports what it did; a section that would start past --deadline is reported as not run):
  env          the card, driver, CUDA, torch, the CPU; a large bf16 matmul's measured rate
  cuda_tests   tests/cuda (fsdp_cuda_tests): NCCL at world size 1, Gloo carrying CUDA tensors
               on 3 ranks of the one GPU, a GPU made to lag the host (missing waits show)
  fsdp2        fsdp-train against PyTorch FSDP2 on this GPU: same weights and batches, 20 AdamW
               steps, fp32 and bf16, with and without activation checkpointing; loss per step
  speed        GPT-2 XL-size and Llama-1B-size, bf16, fsdp-train and FSDP2 in the same run:
               tokens/s, MFU against the data sheet and against the measured matmul, peaks
  plan         fsdp-plan --hardware for the speed runs against their measured allocator peaks
  offload      fsdp.cpu_offload on the GPU: losses against no offload (fp32), step time, memory
  lora         LoRA and QLoRA of SmolLM2 on the GPU against the CPU run of the same steps
  sanitizer    compute-sanitizer memcheck on a small NCCL run with the caching allocator off

Without a GPU (and without --cpu-dry-run) it says so and exits 1. It writes OUT/report.json,
OUT/report.md and OUT/gpu_check.log (every command and its output).
"""
import argparse
import datetime
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from machine import cpu_description  # noqa: E402

PY = sys.executable
DATA_DIR = "data/kjv-2048"
VOCAB = 2048
# Dense bf16 tensor-core rate of the data sheets (the H200's compute is the H100 SXM's); the
# first name the device's contains counts, so the PCIe part comes before the plain "H100".
DATASHEET_BF16 = [("H100 PCIe", 756.5e12), ("H100", 989.4e12), ("H200", 989.4e12),
                  ("A100", 312e12)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Check:
    """The run: options, the log, the report, and the clock."""

    def __init__(self, a):
        self.a = a
        self.cpu = a.cpu_dry_run
        self.device = "cpu" if self.cpu else "cuda"
        self.out = os.path.abspath(a.out)
        os.makedirs(self.out, exist_ok=True)
        self.work = tempfile.mkdtemp(prefix="gpu_check.")
        self.log_file = open(os.path.join(self.out, "gpu_check.log"), "w")
        self.start = time.monotonic()
        self.report = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "dry_run_on_cpu": self.cpu, "sections": {}}
        self.train = os.path.join(a.build, "trainer", "fsdp-train")
        self.plan = os.path.join(a.build, "trainer", "fsdp-plan")
        self.cuda_tests = os.path.join(a.build, "tests", "fsdp_cuda_tests")

    def elapsed(self):
        return time.monotonic() - self.start

    def log(self, text):
        self.log_file.write(text if text.endswith("\n") else text + "\n")
        self.log_file.flush()

    def run(self, cmd, timeout, env=None, cwd=ROOT):
        """Runs cmd, logs it and its output; returns (exit code, output). 124 on timeout."""
        shown = " ".join(cmd)
        # No command runs past --deadline + --grace: the report must come back whole.
        timeout = max(5, min(timeout, self.a.deadline + self.a.grace - self.elapsed()))
        self.log(f"\n$ {shown}   (t={self.elapsed():.0f}s, timeout {timeout:.0f}s)")
        full_env = dict(os.environ, **(env or {}))
        t0 = time.monotonic()
        # Its own session, so that a timeout ends everything it started (ranks, compute-
        # sanitizer's targets), not only the direct child: nothing may go on using the GPU.
        p = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, errors="replace",
                             start_new_session=True)
        try:
            output, _ = p.communicate(timeout=timeout)
            code = p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            output, _ = p.communicate()
            code = 124
            output = (output or "") + f"\n[timed out after {timeout:.0f} s]"
        self.log(output[-20000:])
        self.log(f"[exit {code} after {time.monotonic() - t0:.1f} s]")
        return code, output

    def save(self):
        self.report["elapsed_s"] = round(self.elapsed(), 1)
        with open(os.path.join(self.out, "report.json"), "w") as f:
            json.dump(self.report, f, indent=1)
        with open(os.path.join(self.out, "report.md"), "w") as f:
            f.write(markdown(self.report))


def tail(text, n=15):
    return "\n".join(text.strip().splitlines()[-n:])


# ---- fsdp-train and torch_gpt.py runs ----------------------------------------------------------

def train_args(c, run_dir, steps, batch, seq, extra):
    nproc = ["--nproc", "1"]
    return [c.train] + nproc + [
        os.path.join(ROOT, "configs", "demo.toml"), f"--data.dir={DATA_DIR}",
        f"--data.vocab_size={VOCAB}", f"--training.batch_size={batch}",
        f"--training.seq_len={seq}", f"--training.steps={steps}", "--training.eval_every=0",
        "--training.eval_batches=1", "--generate.tokens=0", "--logging.plot=false",
        "--logging.progress=lines", "--logging.log_every=1", f"--logging.run_dir={run_dir}",
        f"--training.device={c.device}"] + extra


def read_jsonl(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def run_ours(c, name, steps, batch, seq, extra, timeout):
    run_dir = os.path.join(c.work, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    code, out = c.run(train_args(c, run_dir, steps, batch, seq, extra), timeout)
    if code != 0:
        raise RuntimeError(f"fsdp-train ({name}) exit {code}:\n{tail(out)}")
    rows = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "loss" in r]
    return rows, out


def run_theirs(c, name, steps, batch, seq, extra, timeout):
    out_prefix = os.path.join(c.work, name + ".steps")
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    cmd = [PY, os.path.join(HERE, "torch_gpt.py"), "--mode", "fsdp2", "--device", c.device,
           "--train-bin", os.path.join(ROOT, DATA_DIR, "train.bin"), "--out", out_prefix,
           "--steps", str(steps), "--batch", str(batch), "--seq-len", str(seq)] + extra
    code, out = c.run(cmd, timeout, env=env)
    if code != 0:
        raise RuntimeError(f"torch_gpt.py ({name}) exit {code}:\n{tail(out)}")
    rows = [r for r in read_jsonl(out_prefix + ".0") if "step" in r]
    return rows, out


# ---- Sections ------------------------------------------------------------------------------

def section_env(c):
    r = {"cpu": cpu_description(), "python": platform.python_version(),
         "host": platform.node(), "kernel": platform.release()}
    import torch
    r["torch"] = torch.__version__
    r["torch_cuda"] = torch.version.cuda
    if shutil.which("nvidia-smi"):
        code, out = c.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                           "clocks.max.sm", "--format=csv,noheader"], 30)
        r["nvidia_smi"] = out.strip()
        c.run(["nvidia-smi"], 30)
    if not c.cpu:
        p = torch.cuda.get_device_properties(0)
        r.update(gpu=p.name, capability=f"{p.major}.{p.minor}",
                 multiprocessors=p.multi_processor_count, gpu_memory_bytes=p.total_memory)
        r["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        # A large bf16 matmul: the rate this card reaches on dense random data (the ceiling MFU
        # is also reported against).
        n = 8192
        x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            x @ y
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        reps = 20
        for _ in range(reps):
            x @ y
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / reps
        r["matmul_bf16_8192_tflops"] = round(2 * n ** 3 / seconds / 1e12, 1)
        r["datasheet_bf16_tflops"] = next((v / 1e12 for k, v in DATASHEET_BF16 if k in p.name),
                                          None)
        del x, y
        torch.cuda.empty_cache()
    return r


def parse_gtest(output):
    """Each test's state and time from GoogleTest's output; a test that started and never ended
    (the binary crashed in it) is "crashed"."""
    tests = {}
    for line in output.splitlines():
        line = line.strip()
        for tag, state in (("[ RUN      ]", "crashed"), ("[       OK ]", "passed"),
                           ("[  FAILED  ]", "failed"), ("[  SKIPPED ]", "skipped")):
            if line.startswith(tag):
                rest = line[len(tag):].strip()
                name = rest.split(" (")[0].split(",")[0].strip()
                if "." not in name or " " in name:
                    continue
                ms = rest.rsplit("(", 1)[-1].split(" ms")[0] if "ms)" in rest else None
                entry = tests.setdefault(name, {"state": state, "ms": None})
                entry["state"] = state
                if ms and ms.isdigit():  # the summary's repeated FAILED lines carry no time
                    entry["ms"] = int(ms)
    return tests


def section_cuda_tests(c):
    code, out = c.run([c.cuda_tests], 240, env={"OMP_NUM_THREADS": "1"})
    tests = parse_gtest(out)
    failed = [k for k, v in tests.items() if v["state"] in ("failed", "crashed")]
    r = {"exit": code, "tests": tests, "failed": failed,
         "passed": sum(v["state"] == "passed" for v in tests.values()),
         "skipped": sum(v["state"] == "skipped" for v in tests.values())}
    if failed or code != 0:
        r["output_tail"] = tail(out, 60)
    return r


FSDP2_CASES = [("fp32", False), ("bf16", False), ("fp32", True), ("bf16", True)]


def section_fsdp2(c):
    """Same weights (one Hugging Face directory both read), same batches (torch_gpt.py's sampler
    is fsdp-train's, bit for bit), same AdamW (torch's fused kernel on both sides on a GPU),
    schedule and clipping."""
    import torch_gpt
    if c.cpu and not c.a.full_size:
        preset, (n_layer, n_head, n_embd), batch, seq, steps = "gpt2-tiny", (4, 4, 128), 4, 64, 4
    else:
        preset, (n_layer, n_head, n_embd), batch, seq, steps = "gpt2-small", (6, 6, 384), 8, 256, 20
    lr = 1e-3
    hf_dir = os.path.join(c.work, "init-" + preset)
    torch_gpt.save_gpt(hf_dir, VOCAB, seq, n_layer, n_head, n_embd, seed=1234)
    r = {"model": f"{preset} ({n_layer} layers, width {n_embd}, vocab {VOCAB})",
         "batch": batch, "seq_len": seq, "steps": steps, "lr": lr, "cases": {}}
    for dtype, ac in FSDP2_CASES:
        name = f"{dtype}{'+ac' if ac else ''}"
        ours_extra = [f"--model.preset={preset}", f"--model.init_from={hf_dir}",
                      f"--training.lr={lr}", f"--training.min_lr={lr / 10}",
                      f"--precision.param_dtype={dtype}",
                      f"--fsdp.activation_checkpointing={'full' if ac else 'none'}"]
        theirs_extra = ["--hf-dir", hf_dir, "--lr", str(lr), "--min-lr", str(lr / 10),
                        "--param-dtype", dtype] + (["--ac"] if ac else [])
        case = {}
        try:
            ours, _ = run_ours(c, "fsdp2-ours-" + name, steps, batch, seq, ours_extra, 120)
            theirs, _ = run_theirs(c, "fsdp2-theirs-" + name, steps, batch, seq, theirs_extra, 120)
            a = [row["loss"] for row in ours]
            b = [row["loss"] for row in theirs]
            diffs = [abs(x - y) for x, y in zip(a, b)]
            case = {"ours": a, "fsdp2": b, "max_abs_diff": max(diffs),
                    "max_rel_diff": max(d / abs(y) for d, y in zip(diffs, b)),
                    "steps_compared": len(diffs)}
        except Exception as e:  # noqa: BLE001 - one case failing must not hide the others
            case = {"error": str(e)}
        r["cases"][name] = case
        c.log(f"fsdp2 {name}: {json.dumps({k: v for k, v in case.items() if k != 'ours'})}")
    return r


def model_flops_per_token(arch, n_layer, width, seq, vocab, ffn=0, kv_dim=0):
    """6 x the matmul parameters (the tied head counted once, as a matmul) plus attention's two
    matmuls, 6 x 2 x n_layer x seq x width (PaLM's appendix B: causal masking not discounted)."""
    if arch == "gpt":
        per_block = 12 * width * width
    else:
        per_block = 2 * width * width + 2 * width * kv_dim + 3 * width * ffn
    params = n_layer * per_block + vocab * width
    return 6 * params + 12 * n_layer * seq * width, params


def speed_models(c, memory_gib):
    if c.cpu:
        return [("gpt2-tiny", "gpt", dict(n_layer=4, n_head=4, n_embd=128), 4, 64),
                ("llama-tiny", "llama", dict(n_layer=6, n_head=6, n_kv_head=2, n_embd=192,
                                             ffn=512), 2, 64)]
    # Batches that fill most of the card (measured on an H200 at 12 x 1024 and 8 x 2048: 45 and
    # 31 GiB allocated for fsdp-cpp, 46 and 38 GiB for FSDP2, about half of it activations):
    # on a 141 GB card about 80 GiB each; on an 80 GB one about 45.
    big = memory_gib >= 120
    return [("gpt2-1.5b", "gpt", dict(n_layer=48, n_head=25, n_embd=1600), 32 if big else 12,
             1024),
            ("llama-1b", "llama", dict(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, ffn=8192,
                                       rope_theta=500000.0), 24 if big else 8, 2048)]


def section_speed(c):
    env = c.report["sections"].get("env", {}).get("result", {})
    memory_gib = env.get("gpu_memory_bytes", 0) / 2 ** 30
    peak_measured = env.get("matmul_bf16_8192_tflops")
    peak_sheet = env.get("datasheet_bf16_tflops")
    # Steps warmup+1 .. timed are timed; step `profiled` (after them, not the last: the last
    # one evaluates) records the device's kernels on both sides (kernel_summary).
    steps, warmup, timed, profiled = (6, 2, 5, 0) if c.cpu else (10, 3, 8, 9)
    r = {"steps": steps, "warmup_steps_excluded": warmup, "timed_steps": timed - warmup,
         "kernel_profile_step": profiled, "dtype": "bf16", "models": {}}
    for preset, arch, dims, batch, seq in speed_models(c, memory_gib):
        kv = dims.get("n_kv_head", dims["n_head"]) * dims["n_embd"] // dims["n_head"]
        fpt, params = model_flops_per_token(arch, dims["n_layer"], dims["n_embd"], seq, VOCAB,
                                            dims.get("ffn", 0), kv)
        m = {"batch": batch, "seq_len": seq, "vocab": VOCAB, "matmul_params": params,
             "flops_per_token": fpt}
        ours_extra = ([f"--model.arch={arch}"] if arch != "gpt" else []) + [
            f"--model.preset={preset}", "--precision.param_dtype=bf16", "--training.lr=1e-4",
            "--training.min_lr=1e-5"]
        theirs_extra = ["--init", "random", "--arch", arch, "--param-dtype", "bf16",
                        "--lr", "1e-4", "--min-lr", "1e-5", "--vocab", str(VOCAB)]
        for k, v in dims.items():
            theirs_extra += [f"--{k.replace('_', '-')}", str(v)]
        kernels = {"fsdp-cpp": os.path.join(c.work, f"speed-fsdp-cpp-{preset}", "trace",
                                            "rank0.kernels.json"),
                   "fsdp2": os.path.join(c.work, f"kernels-fsdp2-{preset}.json")}
        if profiled:
            ours_extra = ours_extra + [f"--logging.trace_steps={profiled}"]
            theirs_extra = theirs_extra + ["--kernel-profile-step", str(profiled),
                                           "--kernel-profile-out", kernels["fsdp2"]]
        for side, runner, extra in (("fsdp-cpp", run_ours, ours_extra),
                                    ("fsdp2", run_theirs, theirs_extra)):
            try:
                t0 = time.monotonic()
                profile_error = None
                try:
                    rows, _ = runner(c, f"speed-{side}-{preset}", steps, batch, seq, extra, 240)
                except RuntimeError as e:
                    if not profiled:
                        raise
                    # The kernel profile must not cost the speed figure: once more without it.
                    profile_error = str(e)[-2000:]
                    plain = [x for x in extra if not x.startswith("--logging.trace_steps")]
                    if "--kernel-profile-step" in plain:
                        plain = plain[:plain.index("--kernel-profile-step")]
                    t0 = time.monotonic()
                    rows, _ = runner(c, f"speed-{side}-{preset}", steps, batch, seq, plain, 240)
                wall = time.monotonic() - t0
                times = [row["step_time_s"] for row in rows[warmup:timed]]
                step_s = statistics.median(times)
                tps = batch * seq / step_s
                # The process's whole run against its steps: what start-up (building and
                # initialising the model, CUDA's and NCCL's set-up) and the exit cost.
                s = {"step_time_s": step_s, "tokens_per_s": tps, "run_wall_s": wall,
                     "outside_steps_s": wall - sum(row["step_time_s"] for row in rows),
                     "peak_allocated_bytes": max(row.get("peak_bytes", 0) for row in rows),
                     "peak_reserved_bytes": max(row.get("peak_reserved_bytes", 0) or 0
                                                for row in rows),
                     "losses": [row["loss"] for row in rows]}
                if peak_sheet:
                    s["mfu_datasheet"] = tps * fpt / (peak_sheet * 1e12)
                if peak_measured:
                    s["mfu_measured_matmul"] = tps * fpt / (peak_measured * 1e12)
                if profile_error:
                    s["kernel_profile_error"] = profile_error
                elif os.path.exists(kernels[side]):
                    s["kernels"] = kernel_summary(kernels[side])
            except Exception as e:  # noqa: BLE001
                s = {"error": str(e)}
            m[side] = s
        if "tokens_per_s" in m["fsdp-cpp"] and "tokens_per_s" in m["fsdp2"]:
            m["ratio_fsdp_cpp_over_fsdp2"] = m["fsdp-cpp"]["tokens_per_s"] / m["fsdp2"][
                "tokens_per_s"]
        r["models"][preset] = m
        c.report["sections"]["speed"] = {"result": r, "partial": True}
        c.save()
    return r


# Kernel names by what they do (cuBLAS's and CUTLASS's matmuls, the attention kernels, ...),
# first match wins; the rest is element-wise work (casts, norms, activations, residual adds).
KERNEL_KINDS = [("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "splitKreduce")),
                ("attention", ("flash", "fmha", "attention", "sdpa", "pytorch_flash")),
                ("optimizer", ("adam", "multi_tensor_apply", "multi_tensor")),
                ("communication", ("nccl",)),
                ("copies", ("memcpy", "memset")),
                ("reductions", ("reduce_kernel", "norm")),
                ("loss", ("softmax", "nll", "cross_entropy", "log_softmax"))]


def kernel_kind(name):
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k.lower() in low for k in keys):
            return kind
    return "element-wise and other"


def kernel_summary(path):
    """One profiled step's device time by kind, and the 12 largest kernels (ms a step)."""
    with open(path) as f:
        k = json.load(f)
    steps = max(1, k.get("steps", 1))
    kinds = {}
    for row in k["kernels"]:
        kind = kernel_kind(row["name"])
        kinds[kind] = kinds.get(kind, 0) + row["ns"] / 1e6 / steps
    return {"device_ms_per_step": k["device_ns"] / 1e6 / steps,
            "by_kind_ms": {kk: round(v, 2) for kk, v in sorted(kinds.items(),
                                                               key=lambda kv: -kv[1])},
            "kinds_of_kernels": len(k["kernels"]),
            "largest": [{"name": row["name"][:120], "count": row["count"] // steps,
                         "ms": round(row["ns"] / 1e6 / steps, 3)}
                        for row in k["kernels"][:12]]}


def parse_plan_peak(output):
    """Rank 0's predicted peak from fsdp-plan's table: the row after the "rank  peak ..." header
    reads "0  45.12 GiB  backward h47 ..." (two decimals: 0.01% of a peak in GiB)."""
    units = {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30, "TiB": 2 ** 40}
    lines = output.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.split()[:2] == ["rank", "peak"]:
            words = lines[i + 1].split()
            if len(words) >= 3 and words[0] == "0" and words[2] in units:
                return int(float(words[1]) * units[words[2]])
    return None


def section_plan(c):
    speed = c.report["sections"].get("speed", {}).get("result", {}).get("models", {})
    env = c.report["sections"].get("env", {}).get("result", {})
    gpu = env.get("gpu", "")
    memory_gib = env.get("gpu_memory_bytes", 0) / 2 ** 30
    # The built-in profile nearest the card (src/plan/hardware.cpp); only memory matters here.
    hardware = ("h200" if "H200" in gpu else "a100-40gb" if "A100" in gpu and memory_gib < 60
                else "a100-80gb" if "A100" in gpu else "h100-80gb")
    r = {"hardware_profile": hardware, "models": {}}
    for preset, arch, dims, batch, seq in speed_models(c, memory_gib):
        cmd = [c.plan, os.path.join(ROOT, "configs", "demo.toml"), "--world", "1",
               "--hardware", hardware, f"--data.dir={DATA_DIR}", f"--data.vocab_size={VOCAB}",
               f"--model.preset={preset}", f"--training.batch_size={batch}",
               f"--training.seq_len={seq}", "--precision.param_dtype=bf16",
               "--training.eval_batches=1"] + ([f"--model.arch={arch}"] if arch != "gpt" else [])
        code, out = c.run(cmd, 180)
        m = {"exit": code, "table": tail(out, 40)}
        predicted = parse_plan_peak(out)
        measured = speed.get(preset, {}).get("fsdp-cpp", {})
        m["predicted_peak_bytes"] = predicted
        if predicted and measured.get("peak_allocated_bytes"):
            m["measured_allocated_bytes"] = measured["peak_allocated_bytes"]
            m["measured_reserved_bytes"] = measured.get("peak_reserved_bytes")
            m["allocated_over_predicted"] = measured["peak_allocated_bytes"] / predicted
        r["models"][preset] = m
    return r


def section_offload(c):
    if c.cpu:
        preset, batch, seq, steps = "gpt2-tiny", 4, 64, 4
    else:
        preset, batch, seq, steps = "gpt2-350m", 8, 512, 6
    r = {"model": preset, "batch": batch, "seq_len": seq, "steps": steps, "dtype": "fp32"}
    common = [f"--model.preset={preset}", "--training.lr=3e-4", "--training.min_lr=3e-5",
              "--training.threads=8"]
    runs = {}
    for name, extra in (("device", []), ("offload", ["--fsdp.cpu_offload=true"])):
        try:
            rows, _ = run_ours(c, "offload-" + name, steps, batch, seq, common + extra, 240)
            runs[name] = {"losses": [row["loss"] for row in rows],
                          "step_time_s": statistics.median(row["step_time_s"] for row in rows[2:]),
                          "peak_allocated_bytes": max(row.get("peak_bytes", 0) for row in rows),
                          "peak_reserved_bytes": max(row.get("peak_reserved_bytes", 0) or 0
                                                     for row in rows)}
        except Exception as e:  # noqa: BLE001
            runs[name] = {"error": str(e)}
    r.update(runs)
    if all("losses" in runs[k] for k in runs):
        a, b = runs["device"]["losses"], runs["offload"]["losses"]
        r["max_abs_loss_diff"] = max(abs(x - y) for x, y in zip(a, b))
        r["step_time_ratio"] = runs["offload"]["step_time_s"] / runs["device"]["step_time_s"]
        r["device_bytes_saved"] = (runs["device"]["peak_allocated_bytes"] -
                                   runs["offload"]["peak_allocated_bytes"])
    return r


def section_lora(c):
    """LoRA and QLoRA of SmolLM2 on the device, against the same steps on the CPU: the CPU
    losses come from --lora-reference (recorded on a CPU machine with the same binary), or are
    computed here when none is given."""
    model = c.a.smollm2
    if not model or not os.path.exists(model):
        return {"skipped": f"no SmolLM2 model file (--smollm2 {model!r})"}
    reference = {}
    if c.a.lora_reference and os.path.exists(c.a.lora_reference):
        with open(c.a.lora_reference) as f:
            reference = json.load(f)
    r = {"model": os.path.basename(model), "methods": {}}
    for method in ("lora", "qlora"):
        m = {}
        for device in ([c.device] if c.cpu or method in reference else [c.device, "cpu"]):
            try:
                m[device] = lora_run(c, model, method, device)
            except RuntimeError as e:
                m[device] = {"error": str(e)}
        if method in reference and "cpu" not in m:
            m["cpu"] = reference[method]
        if "losses" in m.get(c.device, {}) and "losses" in m.get("cpu", {}) and not c.cpu:
            m["max_abs_loss_diff_vs_cpu"] = max(
                abs(x - y) for x, y in zip(m[c.device]["losses"], m["cpu"]["losses"]))
        r["methods"][method] = m
    return r


def lora_run(c, model, method, device):
    """8 steps of fsdp-train finetune (configs/smollm2-lora.toml, fp32 compute, one rank) on
    `device`; the held-out loss over the first 4 held-out conversations only."""
    run_dir = os.path.join(c.work, f"{method}-{device}")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    eval_file = os.path.join(run_dir, "eval4.jsonl")
    with open(os.path.join(ROOT, "data", "instruct", "kjv_eval.jsonl")) as f, \
            open(eval_file, "w") as g:
        g.writelines(f.readlines()[:4])
    cmd = [c.train, "finetune", os.path.join(ROOT, "configs", "smollm2-lora.toml"),
           f"--finetune.model={model}", f"--finetune.method={method}", "--training.steps=8",
           "--training.batch_size=4", "--training.eval_every=0", "--logging.plot=false",
           "--precision.param_dtype=fp32", "--logging.progress=lines", "--logging.log_every=1",
           "--finetune.samples=0", f"--finetune.eval_file={eval_file}",
           "--finetune.train_file=data/instruct/kjv_train.jsonl",
           "--finetune.save_adapter=false", f"--logging.run_dir={run_dir}",
           f"--training.device={device}"]
    code, out = c.run(cmd, 240)
    if code != 0:
        raise RuntimeError(f"exit {code}:\n{tail(out)}")
    rows = [x for x in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "loss" in x]
    return {"losses": [x["loss"] for x in rows],
            "tokens_per_s": statistics.median(x["tokens_per_second"] for x in rows[1:] or rows),
            "peak_allocated_bytes": max(x.get("peak_bytes", 0) for x in rows)}


def section_sanitizer(c):
    tool = shutil.which("compute-sanitizer")
    if c.cpu or not tool:
        return {"skipped": "no GPU" if c.cpu else "compute-sanitizer not found"}
    env = {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1", "OMP_NUM_THREADS": "1"}
    r = {}
    for test in ("Nccl.FullShardStepsWithClippingEqualOneCpuProcess",
                 "Nccl.CpuOffloadStepsEqualOneCpuProcess"):
        # API errors are not memory errors: NCCL probes its kernels for other architectures
        # at start-up and gets cudaErrorNoKernelImageForDevice 8 times (seen on an H200).
        code, out = c.run([tool, "--tool", "memcheck", "--target-processes", "all",
                           "--error-exitcode", "3", "--leak-check", "no",
                           "--report-api-errors", "no", c.cuda_tests,
                           f"--gtest_filter={test}"], 150, env=env)
        errors = [l for l in out.splitlines() if "========= ERROR SUMMARY" in l]
        r[test] = {"exit": code, "error_summaries": errors,
                   "passed": "[  PASSED  ] 1 test" in out}
        if code != 0:
            r[test]["output_tail"] = tail(out, 40)
    return r


SECTIONS = [("env", section_env, 20), ("cuda_tests", section_cuda_tests, 60),
            ("fsdp2", section_fsdp2, 60), ("speed", section_speed, 90),
            ("plan", section_plan, 20), ("offload", section_offload, 40),
            ("lora", section_lora, 40), ("sanitizer", section_sanitizer, 60)]


# ---- The report ----------------------------------------------------------------------------

def fmt_bytes(b):
    return "-" if not b else f"{b / 2 ** 30:.2f} GiB"


def markdown(rep):
    s = rep["sections"]
    lines = ["# fsdp-cpp GPU check" + (" (DRY RUN on the CPU)" if rep["dry_run_on_cpu"] else ""),
             "", f"Started {rep['started']}, {rep.get('elapsed_s', 0)} s in all.", ""]
    for name, sec in s.items():
        lines.append(f"## {name} ({sec.get('seconds', '?')} s)")
        if "error" in sec:
            lines += ["", "```", sec["error"][-3000:], "```", ""]
            continue
        if "not_run" in sec:
            lines += ["", f"Not run: {sec['not_run']}", ""]
            continue
        res = sec.get("result", {})
        lines.append("")
        if name == "env":
            for k, v in res.items():
                lines.append(f"- {k}: {v}")
        elif name == "cuda_tests":
            lines.append(f"{res.get('passed')} passed, {len(res.get('failed', []))} failed, "
                         f"{res.get('skipped')} skipped (exit {res.get('exit')})")
            lines.append("")
            for t, v in res.get("tests", {}).items():
                lines.append(f"- {t}: {v['state']} ({v['ms']} ms)")
            if res.get("output_tail"):
                lines += ["", "```", res["output_tail"], "```"]
        elif name == "fsdp2":
            lines.append(f"{res.get('model')}, batch {res.get('batch')} x {res.get('seq_len')}, "
                         f"{res.get('steps')} steps, lr {res.get('lr')}")
            lines += ["", "| case | max abs loss diff | max rel | fsdp-cpp last loss | FSDP2 last loss |",
                      "| --- | --- | --- | --- | --- |"]
            for k, v in res.get("cases", {}).items():
                if "error" in v:
                    lines.append(f"| {k} | error: {v['error'][:200]!r} | | | |")
                else:
                    lines.append(f"| {k} | {v['max_abs_diff']:.3g} | {v['max_rel_diff']:.3g} | "
                                 f"{v['ours'][-1]:.6f} | {v['fsdp2'][-1]:.6f} |")
        elif name == "speed":
            lines += ["| model | side | batch x seq | tokens/s | MFU (sheet) | MFU (matmul) | "
                      "peak alloc | peak reserved | run / outside steps |",
                      "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
            for p, m in res.get("models", {}).items():
                for side in ("fsdp-cpp", "fsdp2"):
                    v = m.get(side, {})
                    if "error" in v:
                        lines.append(f"| {p} | {side} | | error: {v['error'][:200]!r} | | | | | |")
                        continue
                    lines.append(
                        f"| {p} | {side} | {m['batch']} x {m['seq_len']} | "
                        f"{v.get('tokens_per_s', 0):,.0f} | {v.get('mfu_datasheet', 0):.3f} | "
                        f"{v.get('mfu_measured_matmul', 0):.3f} | "
                        f"{fmt_bytes(v.get('peak_allocated_bytes'))} | "
                        f"{fmt_bytes(v.get('peak_reserved_bytes'))} | "
                        f"{v.get('run_wall_s', 0):.1f} / {v.get('outside_steps_s', 0):.1f} s |")
                if "ratio_fsdp_cpp_over_fsdp2" in m:
                    lines.append(f"| {p} | ratio | | {m['ratio_fsdp_cpp_over_fsdp2']:.3f}x | | | | | |")
            for p, m in res.get("models", {}).items():
                for side in ("fsdp-cpp", "fsdp2"):
                    k = m.get(side, {}).get("kernels")
                    if k:
                        lines.append(f"\n{p}, {side}: device time of step "
                                     f"{res.get('kernel_profile_step')} "
                                     f"{k['device_ms_per_step']:.1f} ms: " +
                                     ", ".join(f"{kk} {v:.1f}" for kk, v in k["by_kind_ms"].items()))
        else:
            lines += ["```json", json.dumps(res, indent=1)[:6000], "```"]
        lines.append("")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", required=True, help="build directory (trainer/, tests/)")
    p.add_argument("--out", required=True)
    p.add_argument("--deadline", type=float, default=480,
                   help="seconds: a section that would start later is not run")
    p.add_argument("--grace", type=float, default=60,
                   help="seconds past --deadline after which a running command is stopped")
    p.add_argument("--only", default="", help="comma-separated sections to run, in this order")
    p.add_argument("--cpu-dry-run", action="store_true")
    p.add_argument("--full-size", action="store_true",
                   help="--cpu-dry-run: section fsdp2 at the GPU's sizes (the CPU's bf16 bound)")
    p.add_argument("--smollm2", default="", help="SmolLM2 GGUF for section lora")
    p.add_argument("--lora-reference", default="",
                   help="JSON of the CPU run's losses for section lora (else run here)")
    p.add_argument("--record-lora-reference", default="",
                   help="run section lora's CPU runs only and write their JSON here")
    a = p.parse_args()
    if a.record_lora_reference:
        a.cpu_dry_run = True
        a.deadline = 1e9  # a slow CPU takes minutes; nothing here runs on a lease
        c = Check(a)
        ref = {m: lora_run(c, a.smollm2, m, "cpu") for m in ("lora", "qlora")}
        ref["recorded_on"] = cpu_description()
        with open(a.record_lora_reference, "w") as f:
            json.dump(ref, f, indent=1)
        shutil.rmtree(c.work, ignore_errors=True)
        print(json.dumps(ref, indent=1))
        return 0
    if not a.cpu_dry_run:
        import torch
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device visible (torch.cuda.is_available() is False); "
                  "--cpu-dry-run runs every section on the CPU instead", file=sys.stderr)
            return 1
    c = Check(a)
    only = [x for x in a.only.split(",") if x]
    unknown = set(only) - {name for name, _, _ in SECTIONS}
    if unknown:
        print(f"gpu_check: --only: unknown sections {sorted(unknown)}", file=sys.stderr)
        return 2
    failures = 0
    # --only runs its sections in the order it names them (the most wanted first).
    chosen = sorted((x for x in SECTIONS if x[0] in only), key=lambda x: only.index(x[0])) \
        if only else SECTIONS
    for name, fn, estimate in chosen:
        if c.elapsed() + estimate > a.deadline:
            c.report["sections"][name] = {"not_run": f"{c.elapsed():.0f} s spent, ~{estimate} s "
                                                    f"more would pass --deadline {a.deadline:.0f}"}
            c.save()
            continue
        t0 = time.monotonic()
        print(f"gpu_check: {name} ...", flush=True)
        try:
            c.report["sections"][name] = {"result": fn(c)}
        except Exception:  # noqa: BLE001 - a broken section is reported, the next one runs
            failures += 1
            c.report["sections"][name] = {"error": traceback.format_exc()}
        c.report["sections"][name]["seconds"] = round(time.monotonic() - t0, 1)
        c.log(f"== section {name}: {json.dumps(c.report['sections'][name])[:4000]}")
        c.save()
        print(f"gpu_check: {name} done in {time.monotonic() - t0:.0f} s", flush=True)
    c.save()
    shutil.rmtree(c.work, ignore_errors=True)
    print(open(os.path.join(c.out, "report.md")).read())
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
