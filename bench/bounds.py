#!/usr/bin/env python3
"""Bounds: how close fsdp-cpp's training step comes to what this machine allows (issue 28).

One command, from the repository root after the build (it writes docs/bounds.md; needs root for
the emulated-link setting, which it skips otherwise):

    ~/.cache/fsdp-cpp/torch-$(cat .torch-version)/bin/python bench/bounds.py

The settings are bench/vs_pytorch.py's (same model, weights, data, batches and optimizer); per
setting and strategy (full_shard, shard_grad_op and no_shard on 2 ranks, hybrid_shard on 4 ranks
in shard groups of 2) it measures, in interleaved rounds:

- scaling efficiency = tokens/s at N ranks / the summed tokens/s of N independent
  single-process runs (fsdp-train --nproc 1, the same per-rank batch) running at the same time:
  what this machine computes with its shared caches and memory bandwidth and no communication.
  Also the same against N x one process running alone.
- overlap efficiency = max(compute-only step, communication-only step) / measured step.
  Compute-only: the same training step with every collective replaced by a local copy of the
  same size (fsdp.bench_local_collectives). Communication-only: the step's collectives alone, as
  the measured run issued them (order, sizes, groups, what was in flight together; from its
  flight-recorder dumps), replayed by `bench_collectives --replay` with the same Gloo lanes and
  buckets, over the same link.

Step times are medians after the warm-up steps; a concurrent run's median is taken over its
steps that lie inside the window in which all N runs were in their timed steps (the flight
recorder's timestamps of each step's end say which).
"""
import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vs_pytorch as vp  # noqa: E402
from machine import cpu_description  # noqa: E402

BENCH = os.path.join(os.environ.get("FSDP_BUILD_DIR", os.path.join(vp.ROOT, "build")), "bench",
                     "bench_collectives")
# (strategy, world size): hybrid_shard on 4 ranks (2 shard groups of 2, replicated across).
STRATEGIES = [("full_shard", 2), ("shard_grad_op", 2), ("no_shard", 2), ("hybrid_shard", 4)]
HYBRID_SIZE = 2
# Steps per run and warm-up steps left out, per setting: a run's timed part lasts several
# seconds even at batch 1 x 64, so that concurrent single-process runs overlap well.
STEPS = {"compute": (20, 5), "demo": (60, 10), "comm": (200, 20), "link": (200, 20)}
LANES, BUCKET_MIB = 2, 4  # fsdp.gloo_lanes and fsdp.all_gather_bucket_mb: the trainer's defaults
GOALS = "scaling efficiency (full_shard) >= 0.97 compute-bound and >= 0.95 at the demo; " \
        "overlap efficiency >= 0.9 at batch 1 (comm) and over the link"


def setting_named(name):
    return next(s for s in vp.SETTINGS if s[0] == name)


def without_link(setting):
    return setting[:6] + (None,) + setting[7:]


def train_command(setting, world, strategy, hf_dir, out, steps, local=False):
    """fsdp-train as bench/vs_pytorch.py runs it, with this strategy."""
    args = vp.command("fsdp-cpp" if world == 1 else "full_shard", setting, world, hf_dir, out,
                      steps)
    args = [a for a in args if not a.startswith("--fsdp.strategy=")]
    args += [f"--fsdp.strategy={strategy}", "--logging.flight_recorder=200000"]
    if strategy == "hybrid_shard":
        args.append(f"--fsdp.hybrid_shard_size={HYBRID_SIZE}")
    if local:
        args.append("--fsdp.bench_local_collectives=true")
    return args


def environment(out):
    tmp = os.path.join(out, "tmp")
    os.makedirs(tmp, exist_ok=True)
    # Every rank dumps its flight recorder when it exits: the step ends' timestamps, and the
    # collectives the replay issues.
    return dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=tmp, FSDP_FLIGHT_RECORDER_DUMP_AT_EXIT="1")


def run_all(commands, outs, what):
    """Starts every command at once (each in its own run directory) and waits for all."""
    procs = []
    for args, out in zip(commands, outs):
        os.makedirs(out, exist_ok=True)
        log = open(os.path.join(out, "output.txt"), "w")
        procs.append((subprocess.Popen(args, cwd=vp.ROOT, env=environment(out), stdout=log,
                                       stderr=subprocess.STDOUT), log, out))
    failed = []
    for p, log, out in procs:
        p.wait()
        log.close()
        if p.returncode != 0:
            failed.append(out)
    if failed:
        with open(os.path.join(failed[0], "output.txt")) as f:
            tail = f.read()[-3000:]
        sys.exit(f"bounds: {what} failed (see {failed[0]}/output.txt):\n{tail}")


# ---- what a run left ---------------------------------------------------------------------------


def read_metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def read_dump(out, rank=0):
    with open(os.path.join(out, "flight_recorder", f"rank{rank}.json")) as f:
        return json.load(f)


def step_ends(dump):
    """Unix time at which each step ended: its "step metrics" all-reduce is issued right after."""
    return [r["issued"] for r in dump["records"] if r["context"] == "step metrics"]


def median_step(out, warmup):
    return statistics.median(m["step_time_s"] for m in read_metrics(out)[warmup:])


def concurrent_steps(outs, warmup):
    """Per run: the median step time over its timed steps that lie inside the window in which
    every run was in its timed steps; and the fraction of the timed steps inside it."""
    runs = []
    for out in outs:
        times = [m["step_time_s"] for m in read_metrics(out)]
        ends = step_ends(read_dump(out))
        assert len(ends) >= len(times), f"{out}: {len(ends)} step ends for {len(times)} steps"
        runs.append([(e - t, e, t) for e, t in zip(ends, times)][warmup:])
    lo = max(r[0][0] for r in runs)
    hi = min(r[-1][1] for r in runs)
    medians, inside = [], []
    for r in runs:
        kept = [t for s, e, t in r if s >= lo and e <= hi]
        inside.append(len(kept) / len(r))
        medians.append(statistics.median(kept if len(kept) >= 5 else [t for _, _, t in r]))
    return medians, min(inside)


# ---- the communication-only step ---------------------------------------------------------------


def parse_op(record):
    """(reduce op, root) from a record's description ("all-reduce, 8 B sum Double for ...")."""
    words = record["description"].split()
    reduce, root = "-", -1
    if record["kind"] in ("all-reduce", "reduce-scatter"):
        reduce = words[words.index("B") + 1]
    if record["kind"] == "broadcast":
        root = int(re.search(r"from group rank (\d+)", record["description"]).group(1))
    return reduce, root


def write_plans(run_out, world, warmup, plan_dir):
    """One replay plan per rank (bench_collectives --replay; its format is described there):
    every group of the run in creation order, then the timed steps' collectives, each with the
    earlier collectives of its step that the run had finished waiting for before issuing it."""
    os.makedirs(plan_dir, exist_ok=True)
    dumps = [read_dump(run_out, r) for r in range(world)]
    groups = {}
    for d in dumps:
        groups.update(d["groups"])
        assert d["records_dropped"] == 0, f"{run_out}: the flight recorder dropped records"
    order = sorted((g for g in groups if g != "world"),
                   key=lambda g: [int(x) for x in g.split("/")[1:]])
    counts = []
    for rank, d in enumerate(dumps):
        recs = sorted(d["records"], key=lambda r: r["id"])
        ends = [i for i, r in enumerate(recs) if r["context"] == "step metrics"]
        lines = [f"# replay plan of rank {rank}, from {run_out}"]
        lines += [f"group {g} " + " ".join(str(r) for r in groups[g]) for g in order]
        n_ops = 0
        for k in range(warmup, len(ends)):
            step = [r for r in recs[ends[k - 1] + 1:ends[k]] if r["kind"] not in ("send", "recv")]
            lines.append(f"step  # step {k + 1}")
            waited = set()
            for i, r in enumerate(step):
                waits = [j for j in range(i) if j not in waited
                         and 0 < step[j]["completed"] <= r["issued"]]
                waited.update(waits)
                reduce, root = parse_op(r)
                lines.append(f"op {r['group']} {r['kind']} {r['bytes']} {r['dtype'] or '-'} "
                             f"{reduce} {root} " + " ".join(map(str, waits)))
            n_ops += len(step)
        counts.append(n_ops)
        with open(os.path.join(plan_dir, f"rank{rank}.plan"), "w") as f:
            f.write("\n".join(lines) + "\n")
    assert len(set(counts)) == 1, f"{run_out}: ranks issued different numbers of collectives"


def replay_command(setting, world, plan_dir, result):
    bench = [BENCH, "--replay", plan_dir, "--replay-out", result, "--replay-lanes", str(LANES),
             "--replay-bucket-mib", str(BUCKET_MIB)]
    if setting[6]:
        return [vp.LINK, "--rate", setting[6], "--nproc", str(world), "--"] + bench
    return [vp.TORCHRUN, "--standalone", "--no-python", f"--nproc-per-node={world}"] + bench


# ---- one round ---------------------------------------------------------------------------------


def baseline_key(setting):
    """Runs without communication depend on the model and the per-rank batch only: comm and
    link share theirs."""
    return setting[2:5]


def run_round(rnd, settings, workdir, hf_dirs, dry):
    """Every job of one round, in a fixed order; returns nothing (the runs stay in workdir)."""
    done_baselines = set()
    for s in settings:
        name = s[0]
        steps, _ = STEPS[name]
        hf = hf_dirs[name]
        base = os.path.join(workdir, "baseline", "-".join(map(str, baseline_key(s))), f"round{rnd}")
        if baseline_key(s) not in done_baselines:
            done_baselines.add(baseline_key(s))
            quiet = without_link(s)
            for n in [1] + sorted({w for _, w in STRATEGIES}):
                outs = [os.path.join(base, f"x{n}" if n > 1 else "alone", f"run{i}")
                        for i in range(n)]
                if not dry:
                    run_all([train_command(quiet, 1, "full_shard", hf, o, steps) for o in outs],
                            outs, f"{name}: {n} single-process run(s)")
                    print(f"round {rnd + 1} {name:8} {n} concurrent single-process run(s) done",
                          flush=True)
        for strategy, world in STRATEGIES:
            d = os.path.join(workdir, name, strategy, f"round{rnd}")
            measured, local = os.path.join(d, "measured"), os.path.join(d, "local")
            if dry:
                continue
            run_all([train_command(s, world, strategy, hf, measured, steps)], [measured],
                    f"{name} {strategy}")
            run_all([train_command(s, world, strategy, hf, local, steps, local=True)], [local],
                    f"{name} {strategy} (local collectives)")
            plans = os.path.join(d, "replay")
            write_plans(measured, world, STEPS[name][1], plans)
            result = os.path.join(d, "replay.json")
            run_all([replay_command(s, world, plans, result)], [os.path.join(d, "replay-run")],
                    f"{name} {strategy} (replay)")
            with open(result) as f:
                comm = json.load(f)["median_s"]
            warmup = STEPS[name][1]
            print(f"round {rnd + 1} {name:8} {strategy:13} measured "
                  f"{median_step(measured, warmup) * 1e3:7.1f} ms  compute-only "
                  f"{median_step(local, warmup) * 1e3:7.1f} ms  comm-only {comm * 1e3:7.1f} ms",
                  flush=True)


# ---- figures -----------------------------------------------------------------------------------


def figures(rounds, settings, workdir):
    """Per (setting, strategy): a list over rounds of dicts of figures."""
    out = {}
    for s in settings:
        name, batch, seq = s[0], s[3], s[4]
        warmup = STEPS[name][1]
        tokens = batch * seq  # per rank and step
        for rnd in range(rounds):
            base = os.path.join(workdir, "baseline", "-".join(map(str, baseline_key(s))),
                                f"round{rnd}")
            alone = tokens / median_step(os.path.join(base, "alone", "run0"), warmup)
            conc = {}
            for n in sorted({w for _, w in STRATEGIES}):
                meds, inside = concurrent_steps(
                    [os.path.join(base, f"x{n}", f"run{i}") for i in range(n)], warmup)
                conc[n] = (sum(tokens / m for m in meds), inside)
            for strategy, world in STRATEGIES:
                d = os.path.join(workdir, name, strategy, f"round{rnd}")
                step = median_step(os.path.join(d, "measured"), warmup)
                compute = median_step(os.path.join(d, "local"), warmup)
                with open(os.path.join(d, "replay.json")) as f:
                    comm = json.load(f)["median_s"]
                tps = tokens * world / step
                out.setdefault((name, strategy), []).append({
                    "world": world, "tokens_per_s": tps, "concurrent": conc[world][0],
                    "inside": conc[world][1], "alone": alone, "step": step, "compute": compute,
                    "comm": comm, "scaling": tps / conc[world][0],
                    "scaling_alone": tps / (world * alone),
                    "compute_scaling": tokens * world / compute / conc[world][0],
                    "overlap": max(compute, comm) / step})
    return out


def rng(values, fmt):
    v = sorted(values)
    med = statistics.median(v)
    return f"**{format(med, fmt)}** ({format(v[0], fmt)}-{format(v[-1], fmt)})" if len(v) > 1 \
        else f"**{format(med, fmt)}**"


def build_description():
    """Which source the measured binaries were built from: the commit of the tree holding the
    build directory, and whether that tree had uncommitted changes to tracked files."""
    build = os.path.dirname(os.path.dirname(vp.TRAIN))
    def git(*args):
        return subprocess.run(["git", "-C", build] + list(args), capture_output=True,
                              text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return f"{build} (not in a git tree)"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    where = os.path.relpath(build, vp.ROOT) if build.startswith(vp.ROOT) else build
    return (f"fsdp-train and bench_collectives of {where}, commit {commit}"
            + (" with uncommitted changes" if dirty else ""))


def report(a, settings, figs):
    import torch
    lines = []
    put = lines.append
    put("# Bounds: scaling and overlap efficiency\n")
    put(f"Produced by `bench/bounds.py` (the command below) on {datetime.date.today().isoformat()}"
        "; every figure comes from that one invocation.\n")
    put(f"- Machine: {cpu_description()}; "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB; torch "
        f"{torch.__version__}; Gloo ({LANES} lanes, {BUCKET_MIB} MiB all-gather buckets), one "
        "intra-op thread per rank, fp32, FusedAdamW. Settings, weights and batches: "
        "bench/vs_pytorch.py's.")
    put(f"- Build: {build_description()}.")
    put(f"- Command: `~/.cache/fsdp-cpp/torch-$(cat .torch-version)/bin/python bench/bounds.py "
        f"--rounds {a.rounds}" + (f" --settings {a.settings}" if a.settings != "all" else "")
        + "`")
    put(f"- {a.rounds} interleaved rounds; figures are the median over rounds with the min-max "
        "range; ratios are paired (computed within each round). Steps per run (warm-up left "
        "out): " + ", ".join(f"{s[0]} {STEPS[s[0]][0]} ({STEPS[s[0]][1]})" for s in settings)
        + ". A step time is the median over the timed steps (the replay: of the slowest rank "
        "per step).")
    put("- **Scaling efficiency** = tokens/s at N ranks / the summed tokens/s of N independent "
        "`fsdp-train --nproc 1` runs of the same per-rank batch running at the same time (no "
        "communication: what the machine computes with shared caches and memory bandwidth). "
        "*vs alone*: against N x one process running alone. *compute-only scaling*: the "
        "compute-only step's tokens/s over the same concurrent runs (the sharded step's own "
        "arithmetic, communication aside).")
    put("- **Overlap efficiency** = max(compute-only step, communication-only step) / measured "
        "step. Compute-only: the same run with `fsdp.bench_local_collectives = true` (every "
        "collective a local copy of the same size). Communication-only: the measured run's "
        "timed steps' collectives, from its flight-recorder dumps, replayed alone in the same "
        "order and sizes on the same groups, Gloo lanes and buckets (and link), each waited for "
        "where the run had waited for it (`bench_collectives --replay`). 1.0 means the step is "
        "as short as its longer part alone: perfect overlap.")
    put(f"- hybrid_shard: 4 ranks (shard groups of {HYBRID_SIZE}, replicated across), "
        "oversubscribed on this machine's cores when it has fewer than 4 (its baseline: 4 "
        "concurrent single-process runs, as oversubscribed); over the link every rank is its "
        "own emulated host (bench/emulated_link.sh, one network namespace each).\n")
    put(f"Goals (issue 28): {GOALS}.\n")
    put("| setting | strategy | ranks | tokens/s | concurrent 1-rank runs, tokens/s | N x alone "
        "| **scaling efficiency** | vs alone | compute-only scaling | measured step ms "
        "| compute-only ms | comm-only ms | **overlap efficiency** |")
    put("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in settings:
        for strategy, world in STRATEGIES:
            rs = figs[(s[0], strategy)]
            col = lambda k: [r[k] for r in rs]  # noqa: E731
            put(f"| {s[0]} | {strategy} | {world} | {rng(col('tokens_per_s'), ',.0f')} "
                f"| {rng(col('concurrent'), ',.0f')} "
                f"| {rng([world * x for x in col('alone')], ',.0f')} "
                f"| {rng(col('scaling'), '.2f')} | {rng(col('scaling_alone'), '.2f')} "
                f"| {rng(col('compute_scaling'), '.2f')} "
                f"| {rng([x * 1e3 for x in col('step')], '.1f')} "
                f"| {rng([x * 1e3 for x in col('compute')], '.1f')} "
                f"| {rng([x * 1e3 for x in col('comm')], '.1f')} "
                f"| {rng(col('overlap'), '.2f')} |")
    put("")
    worst = min(min(r["inside"] for r in v) for v in figs.values())
    put(f"Concurrent single-process runs: in the worst round, {worst:.0%} of a run's timed steps "
        "lay inside the window in which all of them were running (the medians use those "
        "steps).\n")
    text = "\n".join(lines) + "\n"
    notes = ""
    if os.path.exists(a.out):
        with open(a.out) as f:
            old = f.read()
        if NOTES_MARKER in old:
            notes = old[old.index(NOTES_MARKER) + len(NOTES_MARKER):]
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        f.write(text + "\n" + NOTES_MARKER + (notes if notes else "\n"))
    os.replace(tmp, a.out)
    print(text)
    print(f"written: {a.out}")


NOTES_MARKER = "<!-- Notes below this line are kept when bench/bounds.py rewrites the file. -->"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--settings", default="all",
                   help="comma-separated subset of " + ", ".join(s[0] for s in vp.SETTINGS))
    p.add_argument("--out", default=os.path.join(vp.ROOT, "docs", "bounds.md"))
    p.add_argument("--keep", help="keep every run's output in this directory")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rewrite the report from the runs kept in --keep")
    p.add_argument("--quick", action="store_true",
                   help="a few steps per run: checks the tooling, the figures mean little")
    a = p.parse_args()
    if a.quick:
        STEPS.update(compute=(8, 3), demo=(16, 5), comm=(30, 10), link=(30, 10))
    if a.report_only and not a.keep:
        sys.exit("bounds: --report-only needs --keep DIR")
    names = [s[0] for s in vp.SETTINGS] if a.settings == "all" else a.settings.split(",")
    unknown = [n for n in names if n not in STEPS]
    if unknown:
        sys.exit(f"bounds: unknown setting(s) {', '.join(unknown)} "
                 f"(known: {', '.join(s[0] for s in vp.SETTINGS)})")
    settings = [setting_named(n) for n in names]
    if any(s[6] for s in settings) and os.geteuid() != 0:
        print("bounds: not root, skipping the emulated-link setting", file=sys.stderr)
        settings = [s for s in settings if not s[6]]
    for path in (vp.TRAIN, BENCH):
        if not os.path.exists(path):
            sys.exit(f"bounds: {path} not found: build first (cmake --build build)")
    print(f"bounds: {cpu_description()}", flush=True)
    workdir = a.keep or tempfile.mkdtemp(prefix="bounds.")
    hf_dirs = {s[0]: os.path.join(workdir, s[0], "init") for s in settings}
    if not a.report_only:
        subprocess.run([vp.TRAIN, "--nproc", "1", "configs/demo.toml", f"--data.dir={vp.DATA_DIR}",
                        f"--data.vocab_size={vp.VOCAB}", "--training.steps=1",
                        "--generate.tokens=0", "--training.eval_batches=1",
                        "--logging.plot=false", "--logging.progress=none",
                        f"--logging.run_dir={workdir}/prepare"],
                       cwd=vp.ROOT, check=True, stdout=subprocess.DEVNULL)
        for s in settings:
            n_layer, n_head, n_embd = vp.PRESETS[s[2]]
            vp.torch_gpt.save_gpt(hf_dirs[s[0]], vp.VOCAB, s[4], n_layer, n_head, n_embd,
                                  seed=1234)
        for rnd in range(a.rounds):
            run_round(rnd, settings, workdir, hf_dirs, dry=False)
    report(a, settings, figures(a.rounds, settings, workdir))
    if not a.keep:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
