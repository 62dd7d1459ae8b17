"""One traced step of fsdp-train as a PNG timeline: a band per rank and thread (Gloo lanes
included), spans drawn at their nesting depth inside the band, coloured by kind. Reads the
Chrome traces logging.trace_steps writes (<run_dir>/trace/rank<R>.json) and draws with gnuplot
(what trainer/observe/plot.cpp uses; matplotlib is not in the project's venv).

    python3 bench/trace_png.py RUN_DIR/trace --step 20 --out docs/trace_demo.png
    python3 bench/trace_png.py --run [--step 20]   # runs the demo config on 2 ranks first

Prints the machine, the file sizes and event counts, and per rank what the step's time went to.
"""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from machine import cpu_description  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "build", "trainer", "fsdp-train")

# Colour per kind; a transfer takes its collective's colour (a lighter shade).
COLOURS = {
    "step": "#e0e0e0",
    "data": "#17becf",
    "forward_pass": "#c6dbef",
    "backward_pass": "#fdd0a2",
    "forward": "#1f77b4",
    "backward": "#ff7f0e",
    "recompute": "#9467bd",
    "all_gather_issue": "#98df8a",
    "all_gather_wait": "#2ca02c",
    "reduce_scatter_issue": "#ff9896",
    "reduce_scatter_wait": "#d62728",
    "all_reduce_issue": "#c49c94",
    "all_reduce_wait": "#8c564b",
    "optimizer_phase": "#dbdb8d",
    "optimizer": "#bcbd22",
    "post_reduce_hook": "#bcbd22",
    "metrics": "#e377c2",
    "eval": "#7f7f7f",
}
TRANSFER = {"all-gather": "#74c476", "reduce-scatter": "#fb6a4a", "all-reduce": "#a0785a"}
LEGEND = [("forward", "forward (unit)"), ("backward", "backward (unit)"),
          ("recompute", "recompute"), ("all_gather_wait", "all-gather wait"),
          ("all_gather_issue", "all-gather issue"), ("reduce_scatter_wait", "reduce-scatter wait"),
          ("reduce_scatter_issue", "reduce-scatter issue"), ("all_reduce_wait", "all-reduce wait"),
          ("optimizer", "optimizer"), ("data", "data"), ("metrics", "metrics")]


def colour(e):
    kind = e["args"].get("kind", "")
    if kind == "transfer":
        for prefix, c in TRANSFER.items():
            if e["name"].startswith(prefix):
                return c
        return "#aaaaaa"
    return COLOURS.get(kind, "#aaaaaa")


def load(trace_dir, step):
    """Per (rank, tid): (row name, spans of `step` with their depth)."""
    rows, files = {}, []
    for path in sorted(glob.glob(os.path.join(trace_dir, "rank*.json"))):
        with open(path) as f:
            doc = json.load(f)
        rank = doc["distributedInfo"]["rank"]
        events = doc["traceEvents"]
        names = {e["tid"]: e["args"]["name"] for e in events
                 if e["ph"] == "M" and e["name"] == "thread_name"}
        spans = [e for e in events if e["ph"] == "X"]
        files.append((path, os.path.getsize(path), len(events), len(spans)))
        for tid, name in names.items():
            mine = sorted((e for e in spans if e["tid"] == tid and e["args"].get("step") == step),
                          key=lambda e: (e["ts"], -e["dur"]))
            stack, placed = [], []
            for e in mine:
                while stack and stack[-1] <= e["ts"]:
                    stack.pop()
                placed.append((len(stack), e))
                stack.append(e["ts"] + e["dur"])
            if placed:
                rows[(rank, tid)] = (f"rank {rank} {name}", placed)
    return rows, files


def summary(rows):
    """Per rank: milliseconds of the main thread's top-level kinds and of the waits."""
    out = {}
    for (rank, _), (name, placed) in rows.items():
        tot = out.setdefault(rank, {})
        if not name.endswith("main"):
            for _, e in placed:  # a lane: how long its transfers ran, by collective
                k = "lanes " + e["name"].split(" ")[0]
                tot[k] = tot.get(k, 0) + e["dur"] / 1000
            continue
        for _, e in placed:
            k = e["args"]["kind"]
            if k in ("step", "forward_pass", "backward_pass", "optimizer_phase", "data",
                     "all_gather_wait", "reduce_scatter_wait", "recompute"):
                tot[k] = tot.get(k, 0) + e["dur"] / 1000
    return out


def draw(rows, step, out_png):
    t0 = min(e["ts"] for _, placed in rows.values() for _, e in placed)
    order = sorted(rows)  # rank, then threads before tracks (tids of tracks come later)
    lines = [
        "set terminal pngcairo size 1400,560 noenhanced font ',9'",
        f"set output '{out_png}'",
        f"set title 'fsdp-train demo config, 2 ranks, full_shard: step {step} "
        f"(rows: rank and thread; nested spans stacked downwards)'",
        "set xlabel 'ms from the start of the step'",
        "set style fill solid 1.0 noborder",
        "set key outside right top vertical samplen 1 font ',8'",
        "unset ytics",
    ]
    y, ytics, obj = 0.0, [], 1
    xmax = 0
    for key in reversed(order):
        name, placed = rows[key]
        depth = max(d for d, _ in placed) + 1
        band = max(1.0, 0.35 * depth)  # deep rows a little taller
        h = band / depth
        for d, e in placed:
            x0 = (e["ts"] - t0) / 1000
            x1 = x0 + max(e["dur"] / 1000, 0.01)
            xmax = max(xmax, x1)
            top = y + band - d * h
            lines.append(f"set object {obj} rect from {x0:.3f},{top - h * 0.92:.3f} to "
                         f"{x1:.3f},{top:.3f} fc rgb '{colour(e)}' fs solid 1.0 noborder")
            obj += 1
        ytics.append(f"'{name}' {y + band / 2:.3f}")
        y += band + 0.25
    lines.append(f"set ytics ({', '.join(ytics)}) nomirror font ',8'")
    lines.append(f"set yrange [-0.2:{y:.3f}]")
    lines.append(f"set xrange [0:{xmax * 1.01:.3f}]")
    plots = [f"NaN with boxes fc rgb '{COLOURS[k]}' title '{t}'" for k, t in LEGEND]
    plots.append(f"NaN with boxes fc rgb '{TRANSFER['all-gather']}' title 'all-gather (lane)'")
    plots.append(f"NaN with boxes fc rgb '{TRANSFER['reduce-scatter']}' "
                 "title 'reduce-scatter (lane)'")
    lines.append("plot " + ", ".join(plots))
    with tempfile.NamedTemporaryFile("w", suffix=".gp", delete=False) as f:
        f.write("\n".join(lines) + "\n")
        script = f.name
    try:
        subprocess.run(["gnuplot", script], check=True)
    finally:
        os.unlink(script)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace_dir", nargs="?", help="a run's trace/ directory")
    ap.add_argument("--run", action="store_true",
                    help="run fsdp-train --nproc 2 configs/demo.toml first, tracing --step")
    ap.add_argument("--step", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "trace_demo.png"))
    args = ap.parse_args()
    print(f"machine: {cpu_description()}")
    run_dir = None
    if args.run:
        run_dir = tempfile.mkdtemp(prefix="trace-demo-")
        subprocess.run([TRAIN, "--nproc", "2", os.path.join(ROOT, "configs", "demo.toml"),
                        # One step more: the last step evaluates, which is not the picture.
                        f"--training.steps={args.step + 1}", "--training.eval_every=0",
                        "--logging.plot=false", "--logging.progress=none",
                        f"--logging.run_dir={run_dir}", f"--logging.trace_steps={args.step}"],
                       check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        args.trace_dir = os.path.join(run_dir, "trace")
    if not args.trace_dir:
        ap.error("give a trace directory or --run")
    rows, files = load(args.trace_dir, args.step)
    for path, size, events, spans in files:
        print(f"{os.path.basename(path)}: {size} bytes, {events} events ({spans} spans)")
    for rank, tot in sorted(summary(rows).items()):
        print(f"rank {rank} (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(tot.items())))
    draw(rows, args.step, args.out)
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)")
    if run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
