"""Two emulated hosts x two ranks (scripts/hosts.sh: network namespaces, torchrun multi-node
rendezvous) against the same job on one host (fsdp-train --nproc 4): the losses, and the bytes
that crossed the link between the hosts against what each strategy should send.

    sudo python3 bench/multi_host.py [--steps 20] [--rate none] [--only parallel.tp]

Per strategy it runs the job both ways (the two-host job at two lengths, steps/3 and steps: the
difference is what the steps themselves send) and reports: whether every step's loss is bitwise equal
(both use the same reduction order: Gloo moves the bytes, our reduce-scatter sums them in rank
order), and the TCP payload each host sent over its link per step (interface bytes minus 66 B
of Ethernet/IP/TCP headers per packet) next to the prediction from the step's collective sizes
(metrics.jsonl), assuming Gloo's algorithms: ring all-gather (rank r sends N-1 blocks to r+1:
with ranks 0,1 on host 0 and 2,3 on host 1, one sender per host crosses, 3/4 of the output),
all-to-all reduce-scatter (each rank sends 1/4 of its input to each of the 2 ranks on the other
host) and, for hybrid_shard, a 2-rank ring all-reduce of the gradient shards between the hosts
(each rank sends the whole shard once), and nothing else of the model's across. With
parallel.tp = 2 the tp groups are the hosts (ranks 0,1 and 2,3) and FSDP's dp groups (0,2 and
1,3) cross: each dp collective has one rank per host, so each rank sends half its all-gather's
output and half its reduce-scatter's input across (per host: the whole of both), and none of
the tp groups' all-reduces (tp_bytes in metrics.jsonl, shown beside) may cross.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from machine import cpu_description  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "build", "trainer", "fsdp-train")

CASES = [
    ("full_shard", ["--fsdp.strategy=full_shard"]),
    ("hybrid_shard (group = host)", ["--fsdp.strategy=hybrid_shard", "--fsdp.hybrid_shard_size=2"]),
    ("full_shard, reshard_after_forward_size = 2",
     ["--fsdp.strategy=full_shard", "--fsdp.reshard_after_forward_size=2"]),
    ("full_shard on dp, parallel.tp = 2 (tp group = host)",
     ["--fsdp.strategy=full_shard", "--parallel.tp=2"]),
]


def common(steps, run_dir):
    return [os.path.join(ROOT, "configs", "demo.toml"), f"--training.steps={steps}",
            "--training.eval_every=0", "--logging.plot=false", "--logging.progress=none",
            f"--logging.run_dir={run_dir}"]


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if '"loss"' in line and '"step"' in line]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rate", default="none")
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    args = ap.parse_args()
    print(f"machine: {cpu_description()}")
    rows = []
    for name, extra in CASES:
        if args.only not in name:
            continue
        one = f"/tmp/mh-one-{os.getpid()}"
        two = f"/tmp/mh-two-{os.getpid()}"
        for d in (one, two):
            shutil.rmtree(d, ignore_errors=True)
        subprocess.run([TRAIN, "--nproc", "4"] + common(args.steps, one) + extra, check=True,
                       stdout=subprocess.DEVNULL)
        # Two lengths: the difference is what the steps send, without the start (the initial
        # broadcast, the rendezvous) and the end (the sample's generation).
        sent_by_length = {}
        for steps in (args.steps // 3, args.steps):
            shutil.rmtree(two, ignore_errors=True)
            r = subprocess.run([os.path.join(ROOT, "scripts", "hosts.sh"), "--hosts", "2",
                                "--nproc-per-host", "2", "--rate", args.rate, "--"] +
                               [TRAIN] + common(steps, two) + extra,
                               capture_output=True, text=True)
            if r.returncode != 0:
                print(r.stdout, r.stderr)
                raise SystemExit(f"{name}: the two-host run failed")
            sent_by_length[steps] = {
                int(m.group(1)): int(m.group(2)) - 66 * int(m.group(3))
                for m in re.finditer(r"host(\d) sent (\d+) B in (\d+) packets",
                                     r.stdout + r.stderr)}
        m1, m2 = metrics(one), metrics(two)
        same = len(m1) == len(m2) == args.steps and all(
            a["loss"] == b["loss"] for a, b in zip(m1, m2))
        worst = max(abs(a["loss"] - b["loss"]) for a, b in zip(m1, m2))
        short, full = sent_by_length[args.steps // 3], sent_by_length[args.steps]
        steps_between = args.steps - args.steps // 3
        ag = m2[-1]["allgather_bytes"]
        rs = m2[-1]["reducescatter_bytes"]
        ar = m2[-1]["allreduce_bytes"]
        tp = m2[-1].get("tp_bytes", 0)
        if name.startswith("hybrid"):
            predicted = 2 * ar  # two ranks per host, each sends its shard once
        elif "parallel.tp" in name:
            predicted = ag + rs  # two ranks per host, each sends half of each across
        elif "reshard" in name:
            # Forward gathers every unit once over the 4 ranks (the model's bytes, which in fp32
            # are the reduce-scatter's input: every parameter's gradient); backward regathers
            # from the copy kept inside the host, which does not cross.
            predicted = 0.75 * rs + rs
        else:
            predicted = 0.75 * ag + rs
        per_step = {h: (full[h] - short[h]) / steps_between for h in full}
        rows.append((name, same, worst, per_step, predicted, ag, rs, ar, tp))
        for d in (one, two):
            shutil.rmtree(d, ignore_errors=True)
    print(f"\n2 hosts x 2 ranks vs 1 host x 4 ranks, demo model (gpt2-tiny), {args.steps} steps, "
          f"link rate {args.rate}")
    print("| strategy | losses | max abs diff | host0 sent / step | host1 sent / step | predicted |"
          " ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, same, worst, per_step, predicted, ag, rs, ar, tp in rows:
        h0, h1 = per_step.get(0, 0), per_step.get(1, 0)
        print(f"| {name} | {'bitwise equal' if same else 'DIFFER'} | {worst:.3g} | "
              f"{h0 / 2**20:.3f} MiB | {h1 / 2**20:.3f} MiB | {predicted / 2**20:.3f} MiB | "
              f"{(h0 + h1) / 2 / predicted:.3f} |")
    print("\n(collective sizes per rank and step from metrics.jsonl: "
          + "; ".join(f"{n}: all-gather {ag / 2**20:.2f} MiB, reduce-scatter {rs / 2**20:.2f} MiB,"
                      f" all-reduce {ar / 2**20:.3f} MiB"
                      + (f", tensor parallel {tp / 2**20:.2f} MiB (inside the hosts)" if tp else "")
                      for n, _, _, _, _, ag, rs, ar, tp in rows)
          + ")")


if __name__ == "__main__":
    main()
