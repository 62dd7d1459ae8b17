#!/usr/bin/env python3
"""fsdp-cpp against PyTorch itself: FSDP2 (fully_shard) and DDP, same model, same data.

One command, from the repository root after the build (it writes docs/benchmarks.md and
docs/benchmarks.png; needs root for the emulated-link setting, which it skips otherwise):

    ~/.cache/fsdp-cpp/torch-$(cat .torch-version)/bin/python bench/vs_pytorch.py

For each setting it writes one set of initial weights (a Hugging Face GPT-2 directory:
config.json + model.safetensors), which fsdp-train reads through model.init_from and
bench/torch_gpt.py through safetensors; both read the same token file in the same order
(torch_gpt.py reimplements fsdp-train's sampler), with the same AdamW, schedule and clipping, one
intra-op thread per rank. Then it runs every method once per round, rounds interleaved
(A, B, C, A, B, C...), so that a burst of load from elsewhere hits all methods alike.

Per run: the median step time after --warmup steps (tokens/s = global tokens / that), the peak
RSS of the worst rank (VmHWM), fsdp-cpp's tracked tensor peak and collective bytes and waits
(metrics.jsonl), and every step's loss. Across rounds: the median of the runs' tokens/s and
their spread (min-max).
"""
import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_shapes import gpt_param_shapes, padded  # noqa: E402
from machine import cpu_description  # noqa: E402
import torch_gpt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(os.environ.get("FSDP_BUILD_DIR", os.path.join(ROOT, "build")), "trainer",
                     "fsdp-train")
LINK = os.path.join(ROOT, "bench", "emulated_link.sh")
PY = sys.executable
TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")
DATA_DIR = "data/kjv-2048"
VOCAB = 2048
PRESETS = {"gpt2-tiny": (4, 4, 128), "gpt2-small": (6, 6, 384)}  # n_layer, n_head, n_embd

# name, what it stresses, preset, batch per rank, seq_len, world sizes, link rate, peak lr.
# gpt2-small trains at 1e-3: at the demo's 3e-3 its loss spikes from step 6 on, and the spikes
# amplify rounding differences between any two implementations to 1e-3 within 25 steps.
SETTINGS = [
    ("compute", "compute-bound: a larger model", "gpt2-small", 4, 256, [1, 2], None, 1e-3),
    ("demo", "the demo's setting", "gpt2-tiny", 8, 128, [1, 2, 4], None, 3e-3),
    ("comm", "communication-bound: batch 1 x 64", "gpt2-tiny", 1, 64, [2], None, 3e-3),
    ("link", "batch 1 x 64 over an emulated 1 Gbit/s link", "gpt2-tiny", 1, 64, [2], "1gbit",
     3e-3),
]
AGREE_STEPS = 20  # loss agreement is reported over the first 20 steps, and over all of them
OURS = ["full_shard", "shard_grad_op", "no_shard"]
THEIRS = ["fsdp2", "ddp"]
# Where communication is the bottleneck, full_shard also runs with its best communication
# settings: int8 all-gathers and int8 gradient reduce-scatters with error feedback (fp32
# compute). The losses are then within int8's tolerance of FSDP2's, not fp32 rounding.
BEST = {"full_shard_int8": ["--precision.gather_format=int8", "--precision.reduce_format=int8"]}
BEST_IN = {"link"}
TORCH_GLOO_LOOP_BATCH = False  # --torch-gloo-loop-batch


def methods(world, setting=None):
    if world == 1:
        return ["fsdp-cpp", "torch"]
    best = list(BEST) if setting in BEST_IN else []
    return OURS + best + THEIRS


def is_ours(method):
    return method in OURS or method in BEST or method == "fsdp-cpp"


def command(method, setting, world, hf_dir, out, steps):
    _, _, preset, batch, seq, _, link, lr = setting
    if is_ours(method):
        strategy = "full_shard" if method == "fsdp-cpp" or method in BEST else method
        args = [TRAIN] + ([] if link else ["--nproc", str(world)]) + [
            os.path.join(ROOT, "configs", "demo.toml"), f"--model.preset={preset}",
            f"--model.init_from={hf_dir}", f"--data.dir={DATA_DIR}",
            f"--data.vocab_size={VOCAB}", f"--training.batch_size={batch}",
            f"--training.seq_len={seq}", f"--training.steps={steps}",
            "--training.eval_every=0", "--training.eval_batches=1", "--generate.tokens=0",
            "--logging.plot=false", "--logging.progress=none", f"--logging.run_dir={out}",
            f"--fsdp.strategy={strategy}", f"--training.lr={lr}",
            f"--training.min_lr={lr / 10}"] + BEST.get(method, [])
    else:
        mode = "single" if method == "torch" else method
        script = [os.path.join(ROOT, "bench", "torch_gpt.py"), "--mode", mode,
                  "--hf-dir", hf_dir, "--train-bin", os.path.join(DATA_DIR, "train.bin"),
                  "--out", os.path.join(out, "steps"), "--steps", str(steps),
                  "--batch", str(batch), "--seq-len", str(seq), "--lr", str(lr),
                  "--min-lr", str(lr / 10)]
        if TORCH_GLOO_LOOP_BATCH and mode != "single":
            script.append("--gloo-loop-batch")
        # One process per rank: torchrun starts them, or emulated_link.sh (below), one per host.
        launcher = [TORCHRUN, "--standalone", f"--nproc-per-node={world}"]
        args = ([PY] if link or world == 1 else launcher) + script
    if link:
        args = [LINK, "--rate", link, "--nproc", str(world), "--"] + args
    return args


def run(method, setting, world, hf_dir, out, steps):
    os.makedirs(out, exist_ok=True)
    # torchrun leaves a torchelastic_* directory in TMPDIR per run: keep them in the run's own.
    tmp = os.path.join(out, "tmp")
    os.makedirs(tmp, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=tmp)
    # One retry: a baseline run over the emulated link has died once in Gloo's socket setup
    # ("terminate called without an active exception", 2026-11-27) after dozens of good runs, and
    # a whole invocation is too long to lose to that. The retry is reported, never hidden.
    for attempt in (1, 2):
        proc = subprocess.run(command(method, setting, world, hf_dir, out, steps), cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode == 0:
            return
        tail = proc.stdout[-3000:]
        if attempt == 1:
            print(f"vs_pytorch: {method} on {setting[0]} (world {world}) failed, retrying once; "
                  f"its output ended:\n{tail}", flush=True)
    sys.exit(f"vs_pytorch: {method} on {setting[0]} (world {world}) failed twice:\n" + tail)


def load(method, setting, world, out, warmup):
    """One run's figures, from what it wrote in `out`."""
    batch, seq = setting[3], setting[4]
    if is_ours(method):
        with open(os.path.join(out, "metrics.jsonl")) as f:
            steps_m = [json.loads(line) for line in f]
        peak_rss = max(m["peak_rss_bytes"] for m in steps_m)
    else:
        steps_m, peak_rss = None, 0
        for r in range(world):
            with open(os.path.join(out, f"steps.{r}")) as f:
                lines = [json.loads(line) for line in f]
            peak_rss = max(peak_rss, lines[-1]["peak_rss_bytes"])
            if r == 0:
                steps_m = lines[:-1]
    timed = steps_m[warmup:]
    step_s = statistics.median(m["step_time_s"] for m in timed)
    res = {"tokens_per_s": batch * seq * world / step_s, "step_s": step_s,
           "peak_rss": peak_rss, "losses": [m["loss"] for m in steps_m]}
    if is_ours(method):
        mean = lambda k: statistics.mean(m[k] for m in timed)  # noqa: E731
        res.update(
            peak_bytes=max(m["peak_bytes"] for m in timed),
            comm_bytes=statistics.median(m["allgather_bytes"] + m["reducescatter_bytes"]
                                         + m["allreduce_bytes"] for m in timed),
            ag_wait=mean("time_allgather_wait_s"), reduce_wait=mean("time_reducescatter_wait_s"),
            mean_step=mean("step_time_s"), optimizer_s=mean("time_optimizer_s"))
    return res


# ---- analytic figures -------------------------------------------------------------------------


def param_shapes(preset, seq):
    """(rows, cols) of every parameter of a block, and of the root unit."""
    return gpt_param_shapes(PRESETS[preset][2], VOCAB, seq)


def analytic_peak(method, setting, world):
    """Bytes of fsdp-cpp's tracked peak if nothing but the necessary were alive, fp32, no
    checkpointing (bench/memory_table.py derives each term): at the loss's backward, the sharded
    parameters and AdamW's two moments, every block's saved activations, three logit-sized
    tensors, and what the strategy holds gathered then (full_shard: the root; shard_grad_op:
    every unit; no_shard: nothing more, its parameters are whole). At small batches the peak
    is in the optimizer step instead: parameters, gradients and moments, 16 bytes per element
    held. In-flight communication buffers are not counted: they are what this leaves out."""
    preset, batch, seq = setting[2:5]
    n_layer, n_head, c = PRESETS[preset]
    block, root = param_shapes(preset, seq)
    n = 1 if method in ("no_shard", "fsdp-cpp") else world
    method = "full_shard" if method in BEST else method
    shard = padded(block, n) * n_layer + padded(root, n)
    tokens = batch * seq
    per_block = 16 * c * 4 + 2 * 2 * 4 + n_head * 4
    acts = tokens * (n_layer * per_block + 2 * c * 4 + 3 * VOCAB * 4)
    gathered = {"full_shard": world * padded(root, world),
                "shard_grad_op": world * (padded(block, world) * n_layer + padded(root, world))
                }.get(method, 0)
    return max(12 * shard + acts + 4 * gathered, 16 * shard)


def analytic_comm(method, setting, world):
    """Unsharded bytes moved per step by a PyTorch method, with fsdp-cpp's definition (what the
    collectives carry before sharding: FSDP2 gathers every unit in forward and the blocks again
    in backward, the root staying gathered; reduce-scatters every unit; DDP all-reduces all)."""
    preset, seq = setting[2], setting[4]
    n_layer = PRESETS[preset][0]
    block, root = param_shapes(preset, seq)
    b = 4 * world * padded(block, world)
    r = 4 * world * padded(root, world)
    if method == "fsdp2":
        return (n_layer * b + r) + n_layer * b + (n_layer * b + r)
    full = 4 * (sum(x * y for x, y in block) * n_layer + sum(x * y for x, y in root))
    return full + 8  # + the loss average


# ---- report -----------------------------------------------------------------------------------


def mib(b):
    return f"{b / 2**20:.0f}"


def summarize(runs):
    tps = [r["tokens_per_s"] for r in runs]
    return statistics.median(tps), min(tps), max(tps)


def chart(rows, path):
    """A bar chart of tokens/s relative to FSDP2, per setting (gnuplot, as fsdp-train's plots)."""
    if not shutil.which("gnuplot"):
        print("vs_pytorch: gnuplot not found, no chart", file=sys.stderr)
        return False
    with tempfile.TemporaryDirectory() as d:
        data = os.path.join(d, "ratios.dat")
        with open(data, "w") as f:
            for label, ratios in rows:
                f.write(f'"{label}" ' + " ".join(f"{ratios[m]:.3f}" for m in OURS + ["ddp"])
                        + "\n")
        script = f"""
set terminal pngcairo size 1000,520 font ",11"
set output "{path}"
set title "tokens/s relative to PyTorch FSDP2 (fully\\\\_shard), same model, data and machine"
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.85 border -1
set boxwidth 0.9
set key outside right top
set xrange [-0.6:{len(rows) - 0.4}]
set yrange [0:*]
set grid ytics
set ylabel "x FSDP2's tokens/s"
set arrow from graph 0, first 1 to graph 1, first 1 nohead dt 2 lw 2 lc rgb "black"
plot "{data}" using 2:xtic(1) title "fsdp-cpp full\\\\_shard", \\
     "" using 3 title "fsdp-cpp shard\\\\_grad\\\\_op", \\
     "" using 4 title "fsdp-cpp no\\\\_shard", \\
     "" using 5 title "PyTorch DDP"
"""
        sp = os.path.join(d, "chart.gp")
        with open(sp, "w") as f:
            f.write(script)
        subprocess.run(["gnuplot", sp], check=True)
    return True


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--settings", default=",".join(s[0] for s in SETTINGS))
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks.md"))
    p.add_argument("--keep", help="keep every run's output in this directory")
    p.add_argument("--torch-gloo-loop-batch", action="store_true",
                   help="PyTorch's ranks make Gloo's event loops under SCHED_BATCH, as fsdp-cpp "
                        "does (bench/torch_gpt.py --gloo-loop-batch): the comparison on equal "
                        "terms; without it, PyTorch as it is")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rewrite the report from the runs kept in --keep")
    a = p.parse_args()
    global TORCH_GLOO_LOOP_BATCH
    TORCH_GLOO_LOOP_BATCH = a.torch_gloo_loop_batch
    if a.report_only and not a.keep:
        sys.exit("vs_pytorch: --report-only needs --keep DIR")
    if a.steps < 20 or a.warmup >= a.steps:
        sys.exit("vs_pytorch: --steps must be >= 20 (loss agreement) and > --warmup")
    wanted = a.settings.split(",")
    settings = [s for s in SETTINGS if s[0] in wanted]
    if len(settings) != len(wanted):
        sys.exit(f"vs_pytorch: unknown setting in {a.settings!r} "
                 f"(known: {', '.join(s[0] for s in SETTINGS)})")
    if any(s[6] for s in settings) and os.geteuid() != 0:
        print("vs_pytorch: not root, skipping the emulated-link setting", file=sys.stderr)
        settings = [s for s in settings if not s[6]]
    if not os.path.exists(TRAIN):
        sys.exit(f"vs_pytorch: {TRAIN} not found: build first (cmake --build build)")

    workdir = a.keep or tempfile.mkdtemp(prefix="vs_pytorch.")
    init_dir = lambda s: os.path.join(workdir, s[0], "init")  # noqa: E731
    if not a.report_only:
        # The token files: fsdp-train prepares them once (1 step), both sides then read them.
        subprocess.run([TRAIN, "--nproc", "1", "configs/demo.toml", f"--data.dir={DATA_DIR}",
                        f"--data.vocab_size={VOCAB}", "--training.steps=1",
                        "--generate.tokens=0", "--training.eval_batches=1",
                        "--logging.plot=false", "--logging.progress=none",
                        f"--logging.run_dir={workdir}/prepare"],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        for s in settings:
            n_layer, n_head, n_embd = PRESETS[s[2]]
            torch_gpt.save_gpt(init_dir(s), VOCAB, s[4], n_layer, n_head, n_embd, seed=1234)
    jobs = [(s, w, m) for s in settings for w in s[5] for m in methods(w, s[0])]
    results = {}
    for rnd in range(a.rounds):
        for s, w, m in jobs:
            out = os.path.join(workdir, s[0], f"w{w}", m, f"round{rnd}")
            if not a.report_only:
                run(m, s, w, init_dir(s), out, a.steps)
            r = load(m, s, w, out, a.warmup)
            results.setdefault((s[0], w, m), []).append(r)
            if not a.report_only:
                print(f"round {rnd + 1}/{a.rounds} {s[0]:8} world {w} {m:14} "
                      f"{r['tokens_per_s']:9.0f} tokens/s  peak RSS {mib(r['peak_rss'])} MiB",
                      flush=True)
    report(a, settings, results)
    if not a.keep:
        shutil.rmtree(workdir, ignore_errors=True)


NOTES_MARKER = "<!-- Notes below this line are kept when bench/vs_pytorch.py rewrites the file. -->"


def report(a, settings, results):
    """Writes a.out (and the chart beside it): the tables above NOTES_MARKER are regenerated,
    the hand-written notes below it kept."""
    import torch
    lines = []
    put = lines.append

    def paired(name, w, x, y):
        """Median over rounds of tokens/s(x) / tokens/s(y), both from the same round: the
        interleaving makes each round's pair see the same machine."""
        r = [p["tokens_per_s"] / q["tokens_per_s"]
             for p, q in zip(results[(name, w, x)], results[(name, w, y)])]
        return statistics.median(r), min(r), max(r)

    def agree(name, w, x, y, steps=None):
        p, q = results[(name, w, x)][0]["losses"], results[(name, w, y)][0]["losses"]
        return max(abs(u - v) for u, v in list(zip(p, q))[:steps])

    def fmt_ratio(t):
        return f"**{t[0]:.2f}x** ({t[1]:.2f}-{t[2]:.2f})"

    put("# fsdp-cpp against PyTorch FSDP2 and DDP\n")
    put("Produced by `bench/vs_pytorch.py` (the command below) on "
        f"{datetime.date.today().isoformat()}; every figure above the notes comes from that one "
        "invocation.\n")
    put(f"- Machine: {cpu_description()}; "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB.")
    put(f"- torch {torch.__version__} (fsdp-cpp links the same wheel's LibTorch); Gloo on "
        "loopback, one intra-op thread per rank, fp32, AdamW (fsdp-cpp: FusedAdamW; PyTorch: "
        "torch.optim.AdamW(fused=True)), gradient clipping at 1.0, warm-up 20 steps.")
    put("- Gloo's event loops: fsdp-cpp's under SCHED_BATCH (docs/design.md); PyTorch's "
        + ("under SCHED_BATCH too (--torch-gloo-loop-batch)." if a.torch_gloo_loop_batch
           else "under the default policy, as PyTorch makes them."))
    flag = " --torch-gloo-loop-batch" if a.torch_gloo_loop_batch else ""
    put(f"- Command: `~/.cache/fsdp-cpp/torch-$(cat .torch-version)/bin/python "
        f"bench/vs_pytorch.py --rounds {a.rounds} --steps {a.steps} --warmup {a.warmup}{flag}`")
    put(f"- {a.rounds} interleaved rounds; each run trains {a.steps} steps from the same "
        "weights on the same batches. tokens/s: the global batch over the median step time "
        f"after {a.warmup} warm-up steps (a step lasts as long as the slowest rank's); the "
        "median over rounds, with the min-max range. Ratios are paired: the median over rounds "
        "of the two methods' ratio in the same round (min-max in parentheses). World size 4 "
        "runs 4 ranks on 2 cores (oversubscribed): a scaling probe, not a speed.")
    put("- Peak RSS: the highest VmHWM of any rank. Tracked peak: fsdp-cpp's count of live "
        "tensor bytes (PyTorch has none on CPU), beside its analytic minimum "
        "(`analytic_peak()`). MiB moved: what the step's collectives carry, unsharded "
        "(PyTorch's: analytic, same definition). Exposed comm: fsdp-cpp's all-gather and "
        "gradient-reduction waits that compute did not hide, as a share of the step. Loss "
        f"agreement: the largest |difference| of the rank-averaged loss over the first "
        f"{AGREE_STEPS} steps (and over all {a.steps}), round 1.\n")

    # The goals of issue 14, side by side.
    put("## Summary (world size 2)\n")
    put("| setting | full_shard / FSDP2 | no_shard / DDP | full_shard / no_shard "
        "| RSS full_shard / FSDP2 | tracked / analytic (full_shard) | exposed (full_shard) "
        f"| loss vs FSDP2, {AGREE_STEPS} steps |")
    put("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in settings:
        name = s[0]
        if 2 not in s[5]:
            continue
        fs = results[(name, 2, "full_shard")]
        rss = statistics.median(r["peak_rss"] for r in fs) / statistics.median(
            r["peak_rss"] for r in results[(name, 2, "fsdp2")])
        tracked = statistics.median(r["peak_bytes"] for r in fs) / analytic_peak(
            "full_shard", s, 2)
        exposed = statistics.median((r["ag_wait"] + r["reduce_wait"]) / r["mean_step"]
                                    for r in fs)
        put(f"| {name} | {fmt_ratio(paired(name, 2, 'full_shard', 'fsdp2'))} "
            f"| {fmt_ratio(paired(name, 2, 'no_shard', 'ddp'))} "
            f"| {fmt_ratio(paired(name, 2, 'full_shard', 'no_shard'))} | {rss:.2f}x "
            f"| {tracked:.2f}x | {exposed:.1%} "
            f"| {agree(name, 2, 'full_shard', 'fsdp2', AGREE_STEPS):.1e} |")
    put("\nGoals (issue 14): full_shard / FSDP2 >= 1.3x compute-bound and >= 2x "
        "communication-bound; no_shard / DDP >= 1.1x; full_shard / no_shard >= 0.95x; RSS <= "
        "0.5x FSDP2's; tracked peak within 10% of the analytic minimum; exposed communication "
        "<= 5% at the demo setting; losses equal to fp32 rounding over 20 steps.\n")

    chart_rows = []
    for s in settings:
        name, what, preset, batch, seq, worlds, link, lr = s
        n_layer, n_head, n_embd = PRESETS[preset]
        block, root = param_shapes(preset, seq)
        n_params = sum(r * c for r, c in block) * n_layer + sum(r * c for r, c in root)
        put(f"## {name}: {what}\n")
        put(f"GPT {preset} ({n_layer} layers, width {n_embd}, vocab {VOCAB}, {n_params:,} "
            f"parameters), batch {batch} x {seq} tokens per rank, peak learning rate {lr:g}"
            + (f"; every rank in its own network namespace, its link shaped to {link} "
               "(bench/emulated_link.sh)" if link else "") + ".\n")
        for w in worlds:
            base_name = "torch" if w == 1 else "fsdp2"
            put(f"### world size {w}" + (" (4 ranks on 2 cores)" if w > 2 else "") + "\n")
            put("| method | tokens/s (min-max) | vs " + ("PyTorch" if w == 1 else "FSDP2")
                + " | peak RSS MiB | tracked peak MiB (analytic) | MiB moved per step "
                "| exposed comm | loss at step " + str(a.steps) + " |")
            put("| --- | --- | --- | --- | --- | --- | --- | --- |")
            for m in methods(w, name):
                runs = results[(name, w, m)]
                med, lo, hi = summarize(runs)
                rss = statistics.median(r["peak_rss"] for r in runs)
                if is_ours(m):
                    tracked = (f"{mib(statistics.median(r['peak_bytes'] for r in runs))} "
                               f"({mib(analytic_peak(m, s, w))})")
                    moved = mib(statistics.median(r["comm_bytes"] for r in runs)) \
                        if w > 1 else "0"
                    exposed = statistics.median((r["ag_wait"] + r["reduce_wait"]) / r["mean_step"]
                                                for r in runs)
                    exposed = f"{exposed:.1%}"
                else:
                    tracked, exposed = "n/a", "n/a"
                    moved = mib(analytic_comm(m, s, w)) if w > 1 else "0"
                label = {"fsdp2": "PyTorch FSDP2", "ddp": "PyTorch DDP",
                         "torch": "PyTorch, one process", "fsdp-cpp": "fsdp-cpp, one process",
                         "full_shard_int8": "fsdp-cpp full_shard, int8 gather + int8 reduce"
                         }.get(m, f"fsdp-cpp {m}")
                vs = paired(name, w, m, base_name)[0]
                put(f"| {label} | {med:,.0f} ({lo:,.0f}-{hi:,.0f}) | {vs:.2f}x | "
                    f"{mib(rss)} | {tracked} | {moved} | {exposed} "
                    f"| {runs[0]['losses'][-1]:.6f} |")
            put("")
            if w == 1:
                put(f"- Loss agreement with PyTorch: {agree(name, 1, 'fsdp-cpp', 'torch', AGREE_STEPS):.1e}"
                    f" over {AGREE_STEPS} steps ({agree(name, 1, 'fsdp-cpp', 'torch'):.1e} over "
                    f"{a.steps}).\n")
                continue
            put(f"- full_shard / FSDP2: {fmt_ratio(paired(name, w, 'full_shard', 'fsdp2'))}; "
                f"no_shard / DDP: {fmt_ratio(paired(name, w, 'no_shard', 'ddp'))}; "
                f"full_shard / no_shard: {fmt_ratio(paired(name, w, 'full_shard', 'no_shard'))}.")
            if name in BEST_IN:
                put(f"- full_shard with int8 gather and reduce / FSDP2: "
                    f"{fmt_ratio(paired(name, w, 'full_shard_int8', 'fsdp2'))}; its loss vs FSDP2 "
                    f"{agree(name, w, 'full_shard_int8', 'fsdp2', AGREE_STEPS):.1e} over "
                    f"{AGREE_STEPS} steps ({agree(name, w, 'full_shard_int8', 'fsdp2'):.1e} over "
                    f"{a.steps}).")
            put("- Loss agreement: " + ", ".join(
                f"{x} vs {y} {agree(name, w, x, y, AGREE_STEPS):.1e} "
                f"({agree(name, w, x, y):.1e} over {a.steps})"
                for x, y in (("full_shard", "fsdp2"), ("shard_grad_op", "fsdp2"),
                             ("no_shard", "ddp"))) + ".")
            for m in OURS:
                rs = results[(name, w, m)]
                mean = lambda k: 1e3 * statistics.mean(r[k] for r in rs)  # noqa: E731
                put(f"- {m}'s step, mean over rounds: {mean('mean_step'):.1f} ms; exposed "
                    f"all-gather wait {mean('ag_wait'):.1f} ms, gradient-reduction wait "
                    f"{mean('reduce_wait'):.1f} ms, optimizer {mean('optimizer_s'):.1f} ms.")
            put("")
            if w == 2:
                chart_rows.append(
                    (name, {m: paired(name, w, m, "fsdp2")[0] for m in OURS + ["ddp"]}))
    png = os.path.splitext(a.out)[0] + ".png"
    if chart_rows and chart(chart_rows, png):
        lines.insert(2, f"![tokens/s relative to FSDP2]({os.path.basename(png)})\n")
    notes = ""
    if os.path.exists(a.out):
        with open(a.out) as f:
            old = f.read()
        if NOTES_MARKER in old:
            notes = old[old.index(NOTES_MARKER) + len(NOTES_MARKER):]
    text = "\n".join(lines) + "\n" + NOTES_MARKER + (notes if notes else "\n")
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, a.out)
    print("\n".join(lines))
    print(f"\nwritten: {a.out}" + (f", {png}" if chart_rows else ""))


if __name__ == "__main__":
    main()
