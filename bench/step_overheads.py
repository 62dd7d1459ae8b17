#!/usr/bin/env python3
"""Per-step overheads at the demo setting (issue 42, item 5): what each mechanism that runs on
every step costs, and how close no_shard and full_shard come to the machine's bound.

    python3 bench/step_overheads.py [--rounds 5] [--steps 60] [--out FILE]

Every run is `fsdp-train --nproc 2 configs/demo.toml` (gpt2-tiny, batch 8 x 128 per rank, fp32,
one intra-op thread per rank) for --steps steps without evaluation; its figure is the median
tokens/s over its steps after the first 10 (warm-up) and before the last 5 (a concurrent run
may be alone by then). Each round runs every variant once, in an order that alternates between
rounds, so that a slow phase of the machine hits every variant alike; ratios are paired within
a round and reported as the median over rounds with the min-max range.

Variants (full_shard, the demo's strategy, unless named):
- default: everything on, as a user runs it.
- default again: the same run a second time; its ratio to the first is the noise floor.
- one mechanism off, the rest on: the flight recorder (logging.flight_recorder = 0), the
  caching allocator (training.cpu_cache = false), the peer progress reports to the store
  (FSDP_PEER_PROGRESS=0), the collective accounting (FSDP_COMM_STATS=0).
- all four off.
- no_shard, default and all four off.
- Gloo's event loops under the default scheduling policy (FSDP_GLOO_LOOP_BATCH=0), full_shard
  and no_shard: fsdp-cpp runs them under SCHED_BATCH (src/distributed/gloo_loop_policy.h), and
  this is what that is worth.
- training.bind_cores = true (each rank pinned to its own core; off by default), full_shard and
  no_shard.
- the bound: two `--nproc 1` runs of the same per-rank batch at the same time (no communication
  at all: what the two cores compute with their shared caches and memory bandwidth).

A mechanism's share of the step = 1 - default / (that mechanism off), in tokens/s.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_description  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("FSDP_BUILD_DIR", os.path.join(ROOT, "build"))
TRAIN = os.path.join(BUILD, "trainer", "fsdp-train")

ALL_OFF = (["--logging.flight_recorder=0", "--training.cpu_cache=false"],
           {"FSDP_PEER_PROGRESS": "0", "FSDP_COMM_STATS": "0"})
# name -> (strategy, extra arguments, environment)
VARIANTS = {
    "default": ("full_shard", [], {}),
    "default again": ("full_shard", [], {}),
    "flight recorder off": ("full_shard", ["--logging.flight_recorder=0"], {}),
    "caching allocator off": ("full_shard", ["--training.cpu_cache=false"], {}),
    "peer progress off": ("full_shard", [], {"FSDP_PEER_PROGRESS": "0"}),
    "collective accounting off": ("full_shard", [], {"FSDP_COMM_STATS": "0"}),
    "all four off": ("full_shard", *ALL_OFF),
    "no_shard": ("no_shard", [], {}),
    "no_shard, all four off": ("no_shard", *ALL_OFF),
    # Gloo's event loops under the default policy instead of SCHED_BATCH
    # (src/distributed/gloo_loop_policy.h): not an overhead, the remedy for one of Gloo's.
    "gloo loop batch off": ("full_shard", [], {"FSDP_GLOO_LOOP_BATCH": "0"}),
    "no_shard, gloo loop batch off": ("no_shard", [], {"FSDP_GLOO_LOOP_BATCH": "0"}),
    # training.bind_cores (off by default): each rank pinned to its own core.
    "cores bound": ("full_shard", ["--training.bind_cores=true"], {}),
    "no_shard, cores bound": ("no_shard", ["--training.bind_cores=true"], {}),
}
MECHANISMS = [
    ("flight recorder", "flight recorder off"),
    ("caching allocator", "caching allocator off"),
    ("peer progress reports", "peer progress off"),
    ("collective accounting", "collective accounting off"),
    ("all four", "all four off"),
]


def tokens_per_second(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        m = [json.loads(line) for line in f if '"tokens_per_second"' in line]
    timed = m[10:-5]
    if len(timed) < 5:
        sys.exit(f"{run_dir}: only {len(timed)} timed steps; raise --steps")
    return statistics.median(x["tokens_per_second"] for x in timed)


def start(work, tag, nproc, strategy, extra, env, steps):
    run_dir = os.path.join(work, tag)
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [TRAIN, "--nproc", str(nproc), os.path.join(ROOT, "configs", "demo.toml"),
           f"--training.steps={steps}", "--training.eval_every=0", "--logging.plot=false",
           "--logging.progress=none", f"--logging.run_dir={run_dir}",
           f"--fsdp.strategy={strategy}"] + extra
    log = open(os.path.join(work, tag + ".log"), "w")
    return run_dir, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, **env))


def finish(run_dir, proc):
    if proc.wait() != 0:
        sys.exit(f"fsdp-train failed; see {run_dir}.log")
    return tokens_per_second(run_dir)


def children(pid):
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:  # the process has ended
        return out
    for f in tasks:
        try:
            with open(f"/proc/{pid}/task/{f}/children") as c:
                out += [int(x) for x in c.read().split()]
        except OSError:
            pass
    return out


def thread_cpu(pids, seen):
    """Records each thread's time on a CPU so far (schedstat, ns) in seen[(pid, tid)] =
    (kind, seconds)."""
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    ns = int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            kind = ("compute (each rank's main thread)" if str(pid) == tid else
                    "Gloo (gloo_tcp_loop, pt_gloo_runloop)" if name.startswith(("gloo", "pt_gloo"))
                    else "peer progress reports (fsdp_progress)" if name == "fsdp_progress"
                    else "other threads")
            seen[(pid, tid)] = (kind, ns / 1e9)


def steps_done(run_dir):
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def cpu_by_thread(work, name, steps):
    """Runs `name` (a strategy on 2 ranks, or "bound": two 1-rank runs at once) and reads its
    ranks' threads in /proc every 0.1 s. Returns the CPU seconds of each kind of thread between
    the end of the 10th step and of step N-5 (of the first run), and the wall time between."""
    if name == "bound":
        runs = [start(work, f"cpu{i}", 1, "full_shard", [], {}, steps) for i in range(2)]
    else:
        runs = [start(work, "cpu", 2, name, [], {}, steps)]
    seen, marks = {}, {}
    done = threading.Event()

    def poll():
        while not done.is_set():
            pids = [p for _, proc in runs for p in (children(proc.pid) or [proc.pid])]
            thread_cpu(pids, seen)
            n = steps_done(runs[0][0])
            if n >= 10 and "start" not in marks:
                marks["start"] = (time.monotonic(), dict(seen))
            if 10 <= n <= steps - 5:
                marks["end"] = (time.monotonic(), dict(seen))
            time.sleep(0.1)
    poller = threading.Thread(target=poll)
    poller.start()
    for r in runs:
        finish(*r)
    done.set()
    poller.join()
    if "end" not in marks:
        sys.exit("the CPU reading missed the timed steps; raise --steps")
    (t0, a), (t1, b) = marks["start"], marks["end"]
    kinds = {}
    for key, (kind, sec) in b.items():
        kinds[kind] = kinds.get(kind, 0.0) + sec - a.get(key, (kind, 0.0))[1]
    return kinds, t1 - t0


# Where each mechanism runs on the compute thread, for the profile: symbol -> what it is.
PROFILED = [
    ("fsdp::FlightRecorder::issue", "flight recorder: a collective's entry"),
    ("fsdp::FlightRecorder::transition", "flight recorder: its state changes"),
    ("std::chrono::_V2::steady_clock::now", "clock reads, every caller (bounds the accounting's "
     "wait timing)"),
    ("fsdp::memory::(anonymous namespace)::CachingAllocator::allocate",
     "caching allocator: allocate"),
    ("fsdp::memory::(anonymous namespace)::cached_delete", "caching allocator: free"),
    ("malloc", "malloc, every caller"),
    ("fsdp::detail::PeerProgress", "peer progress (any method)"),
]


def profile(work, steps, seconds):
    """perf record (DWARF call graphs) of rank 0 of a default full_shard run for `seconds` in its
    timed steps: the share of the rank's samples inside each PROFILED symbol and its callees."""
    if shutil.which("perf") is None:
        return None
    run_dir, proc = start(work, "perf", 2, "full_shard", [], {}, steps)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    while proc.poll() is None:  # past the warm-up steps
        if os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 12:
            break
        time.sleep(0.2)
    ranks = children(proc.pid)
    data = os.path.join(work, "perf.data")
    rec = subprocess.run(["perf", "record", "-q", "-p", str(min(ranks)), "--call-graph",
                          "dwarf,16384", "-F", "999", "-o", data, "--", "sleep", str(seconds)],
                         capture_output=True, text=True)
    finish(run_dir, proc)
    if rec.returncode != 0:
        print(f"perf record failed, no profile: {rec.stderr.strip()[:200]}", file=sys.stderr)
        return None
    out = subprocess.run(["perf", "report", "-i", data, "--children", "--stdio", "--no-inline",
                          "-g", "none", "--sort", "sym"], capture_output=True, text=True,
                         env=dict(os.environ, DEBUGINFOD_URLS="")).stdout
    shares = {}
    for line in out.splitlines():
        parts = line.split(None, 3)
        if len(parts) == 4 and parts[0].endswith("%") and parts[2] == "[.]":
            for sym, _ in PROFILED:
                name = parts[3].strip()
                if name == sym or (sym.endswith("PeerProgress") and name.startswith(sym)):
                    shares[sym] = shares.get(sym, 0.0) + float(parts[0].rstrip("%"))
    return shares


def one_round(work, steps, order):
    result = {}
    for name in order:
        if name == "bound":
            runs = [start(work, f"bound{i}", 1, "full_shard", [], {}, steps) for i in range(2)]
            result[name] = sum(finish(*r) for r in runs)
        else:
            strategy, extra, env = VARIANTS[name]
            result[name] = finish(*start(work, "run", 2, strategy, extra, env, steps))
    return result


def summary(values):
    return f"**{statistics.median(values):.3f}** ({min(values):.3f}-{max(values):.3f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--profile-seconds", type=int, default=8,
                    help="length of the perf profile of rank 0 (needs perf; skipped without)")
    ap.add_argument("--out", help="also write the report (markdown) to this file")
    args = ap.parse_args()
    if args.rounds < 1 or args.steps < 30:
        sys.exit("--rounds must be at least 1 and --steps at least 30")
    if not os.path.exists(TRAIN):
        sys.exit(f"{TRAIN} not found: build fsdp-train first (scripts/run.sh demo)")
    names = list(VARIANTS) + ["bound"]
    rounds = []
    with tempfile.TemporaryDirectory(prefix="step-overheads-") as work:
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            rounds.append(one_round(work, args.steps, order))
            print(f"round {r + 1}/{args.rounds}: " +
                  ", ".join(f"{k} {v:.0f}" for k, v in rounds[-1].items()), file=sys.stderr,
                  flush=True)
        cpu = {s: cpu_by_thread(work, s, args.steps) for s in ("full_shard", "no_shard", "bound")}
        shares = profile(work, args.steps * 2, args.profile_seconds)

    def ratios(a, b):
        return [x[a] / x[b] for x in rounds]

    lines = [
        "# Per-step overheads at the demo setting",
        "",
        f"- Machine: {cpu_description()}",
        f"- Command: `python3 bench/step_overheads.py --rounds {args.rounds} --steps "
        f"{args.steps}`; fsdp-train --nproc 2 configs/demo.toml, full_shard unless named; "
        "tokens/s = median over steps 11..N-5 of a run; ratios paired within a round, median "
        "over rounds (min-max).",
        "",
        "| variant | tokens/s (median over rounds) |",
        "| --- | --- |",
    ]
    for name in names:
        lines.append(f"| {name} | {statistics.median(x[name] for x in rounds):,.0f} |")
    lines += ["", "| mechanism | share of the step: 1 - default / off |", "| --- | --- |"]
    for label, off in MECHANISMS:
        lines.append(f"| {label} | " + summary([1 - x for x in ratios("default", off)]) + " |")
    lines.append("| noise floor: 1 - default / default again | " +
                 summary([1 - x for x in ratios("default", "default again")]) + " |")
    lines += ["", "| strategy | tokens/s / bound (two concurrent 1-rank runs) |", "| --- | --- |"]
    for name in ["default", "all four off", "gloo loop batch off", "cores bound", "no_shard",
                 "no_shard, all four off", "no_shard, gloo loop batch off",
                 "no_shard, cores bound"]:
        label = name if name.startswith("no_shard") else f"full_shard, {name}"
        lines.append(f"| {label} | " + summary(ratios(name, "bound")) + " |")
    lines += ["", "Where the two cores' time goes in the timed steps (steps 11..N-5) of one more run "
              "each, from each thread's time on a CPU (/proc/<pid>/task/<tid>/schedstat); idle = "
              "2 cores x wall time - the threads' total:", "",
              "| thread | full_shard | no_shard | bound (two 1-rank runs) |",
              "| --- | --- | --- | --- |"]
    kinds = sorted({k for c, _ in cpu.values() for k in c}) + ["idle"]
    for kind in kinds:
        cells = []
        for s in ("full_shard", "no_shard", "bound"):
            threads, wall = cpu[s]
            v = threads.get(kind, 0.0) if kind != "idle" else 2 * wall - sum(threads.values())
            cells.append(f"{v:.3f} s ({100 * v / (2 * wall):.2f}%)")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    if shares is not None:
        lines += ["", f"Profile of rank 0 of a default full_shard run, {args.profile_seconds} s "
                  "of its timed steps (`perf record --call-graph dwarf -F 999`): share of the "
                  "rank's samples (every thread) inside each function and what it calls:", "",
                  "| function | what | share |", "| --- | --- | --- |"]
        for sym, what in PROFILED:
            lines.append(f"| `{sym}` | {what} | {shares.get(sym, 0.0):.2f}% |")
    lines += ["", "Per round (tokens/s):", ""]
    lines += ["| round | " + " | ".join(names) + " |", "|" + " --- |" * (len(names) + 1)]
    for i, x in enumerate(rounds):
        lines.append(f"| {i + 1} | " + " | ".join(f"{x[n]:.0f}" for n in names) + " |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
