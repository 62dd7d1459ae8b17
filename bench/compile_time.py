"""Where the compiler's time goes: per object, from a build directory's .ninja_log.

    python3 bench/compile_time.py [BUILD_DIR] [--top 5] [--json OUT]

For the demo's target (fsdp-train and what it links: `ninja -t commands`) and for everything the
build holds: the number of objects (precompiled headers counted apart), their seconds summed, and
the slowest. Each object's seconds are its wall time in the log; a build at -j N on N cores
(scripts/setup.sh: -j 2 on 2) gives each compile a core, so they are its CPU time to within the
noise. Only a build whose log holds every object from one cold run (no ccache hits: an empty
FSDP_CACHE's ccache, or CCACHE_DISABLE=1) measures the compiler; the report says how many
objects look like cache hits (under a second).
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from machine import cpu_description  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_log(build):
    """{output: seconds} of the last build step that wrote each output (.ninja_log v5+)."""
    seconds = {}
    with open(os.path.join(build, ".ninja_log")) as f:
        for line in f:
            if line.startswith("#"):
                continue
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 4:
                continue
            seconds[parts[3]] = (int(parts[1]) - int(parts[0])) / 1000.0
    return seconds


def objects_of(build, target):
    """The objects (and precompiled headers) the build of `target` compiles."""
    out = subprocess.run(["ninja", "-C", build, "-t", "commands", target], capture_output=True,
                         text=True, check=True).stdout
    found = set()
    for command in out.splitlines():
        words = command.split()
        if "-c" in words and "-o" in words:
            found.add(words[words.index("-o") + 1])
    return found


def summary(name, outputs, seconds, top):
    timed = {o: seconds[o] for o in outputs if o in seconds}
    pch = {o: s for o, s in timed.items() if o.endswith(".gch")}
    objs = {o: s for o, s in timed.items() if not o.endswith(".gch")}
    slowest = sorted(objs.items(), key=lambda kv: -kv[1])[:top]
    return {
        "what": name,
        "objects": len(objs),
        "object_seconds": round(sum(objs.values()), 1),
        "precompiled_headers": len(pch),
        "pch_seconds": round(sum(pch.values()), 1),
        "under_1s": sum(1 for s in objs.values() if s < 1.0),
        "missing_from_log": len(outputs) - len(timed),
        "slowest": [[o, round(s, 1)] for o, s in slowest],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build", nargs="?", default=os.path.join(ROOT, "build"))
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    seconds = read_log(args.build)
    everything = {o for o in seconds if o.endswith((".o", ".gch"))}
    report = {
        "machine": cpu_description(),
        "build": os.path.abspath(args.build),
        "demo": summary("fsdp-train and what it links", objects_of(args.build, "fsdp-train"),
                        seconds, args.top),
        "all": summary("every target", everything, seconds, args.top),
    }
    print(f"machine: {report['machine']}")
    for key in ("demo", "all"):
        r = report[key]
        print(f"{r['what']}: {r['objects']} objects, {r['object_seconds']:.0f} s; "
              f"{r['precompiled_headers']} precompiled headers, {r['pch_seconds']:.0f} s"
              f" ({r['under_1s']} objects under 1 s: cache hits?"
              f"{'; ' + str(r['missing_from_log']) + ' not in the log' if r['missing_from_log'] else ''})")
        for o, s in r["slowest"]:
            print(f"  {s:6.1f} s  {o}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
