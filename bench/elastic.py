"""An elastic job that loses a host and gets it back: 2 emulated hosts x 2 ranks under torchrun
with --nnodes=1:2 (scripts/hosts.sh), checkpointing every few steps with
checkpoint.resume = auto.

    sudo python3 bench/elastic.py [--steps 300] [--lose-at 100] [--back-at 200]

  1. At step --lose-at, host 1 is lost: every process in its namespace (its torchrun agent
     and its two ranks) is SIGKILLed.
  2. Host 0's ranks fail on their next collective; its agent restarts them (a restart counted
     against --max-restarts), the rendezvous closes with host 0 alone, and its 2 ranks resume
     from the newest checkpoint, which 4 ranks wrote (resharded 4 -> 2).
  3. At step --back-at, host 1's agent starts again (the host came back). Host 0's agent sees
     a host waiting at the rendezvous and restarts its ranks (a membership change, not counted
     as a failure); 4 ranks resume from the newest checkpoint, written by 2 (resharded 2 -> 4).
  4. The job ends at --steps.

Prints the machine, each phase's world size, steps and timing, and the loss curve next to the
same job run on 4 ranks without faults; writes the curve as a PNG with gnuplot (--plot).
Bounds checked: host 0's agent and host 1's second agent exit 0, the world shrinks to 2
after the loss and grows back to 4, each resume names the checkpoint it continued from, and
the mean loss of the last 50 steps is within 5% of the uninterrupted job's (the 2-rank phase
trains on a half-size global batch, so the curves differ after the loss: the same job, not
the same numbers).
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from machine import cpu_description  # noqa: E402
from multi_host_faults import hosts_env, live_trainers  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "build", "trainer", "fsdp-train")
HOSTS = os.path.join(ROOT, "scripts", "hosts.sh")


def job(run_dir, args, logs, elastic):
    shutil.rmtree(run_dir, ignore_errors=True)
    hosts = ["--logs", logs, "--store-timeout", "30", "--last-call", "3"]
    if elastic:
        hosts += ["--nnodes", "1:2", "--max-restarts", "3"]
    cmd = [HOSTS, *hosts, "--", TRAIN, os.path.join(ROOT, "configs", "demo.toml"),
           f"--training.steps={args.steps}", "--training.eval_every=0", "--logging.plot=false",
           "--logging.progress=lines", "--logging.log_every=25", "--generate.tokens=0",
           f"--logging.run_dir={run_dir}", f"--checkpoint.every={args.every}",
           "--checkpoint.resume=auto", f"--fsdp.timeout_s={args.timeout_s}"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)


def metrics(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                m = json.loads(line)
            except ValueError:
                continue  # a line being written
            if "loss" in m and "step" in m:
                out.append(m)
    return out


def wait_for_step(run_dir, step, p, deadline_s=1800):
    t0 = time.time()
    while time.time() - t0 < deadline_s:
        m = metrics(run_dir)
        if m and m[-1]["step"] >= step:
            return
        if p.poll() is not None:
            raise SystemExit(f"elastic.py: the job ended before step {step}")
        time.sleep(0.1)
    raise SystemExit(f"elastic.py: step {step} not reached within {deadline_s} s")


def lose_host(ns):
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                          text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def world_of(m, per_rank_tokens):
    return round(m["tokens"] / per_rank_tokens)


def wait_for_world(run_dir, ranks, per_rank_tokens, p, what):
    """Until the newest metrics line is a step trained by `ranks` ranks; returns the lines."""
    while True:
        m = metrics(run_dir)
        if m and world_of(m[-1], per_rank_tokens) == ranks:
            return m
        if p.poll() is not None:
            raise SystemExit(f"elastic.py: the job ended instead of {what}")
        time.sleep(0.1)


def plot(path, curves):
    """curves: [(title, [(step, loss)])]; one PNG through gnuplot."""
    data = []
    plots = []
    for i, (title, points) in enumerate(curves):
        data.append("\n".join(f"{s} {loss}" for s, loss in points))
        plots.append(f"'-' using 1:2 with lines lw 2 title '{title}'")
    script = (f"set terminal pngcairo size 900,500\nset output '{path}'\n"
              "set xlabel 'step'\nset ylabel 'training loss'\nset grid\n"
              "plot " + ", ".join(plots) + "\n" + "\ne\n".join(data) + "\ne\n")
    subprocess.run(["gnuplot"], input=script, text=True, check=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--lose-at", type=int, default=100)
    ap.add_argument("--back-at", type=int, default=200)
    ap.add_argument("--timeout-s", type=float, default=10)
    ap.add_argument("--plot", default="")
    args = ap.parse_args()
    print(f"machine: {cpu_description()}")

    # The uninterrupted job, 2 hosts x 2 ranks.
    ref_run, ref_logs = "/tmp/elastic-reference", "/tmp/elastic-reference-logs"
    p = job(ref_run, args, ref_logs, elastic=False)
    p.communicate()
    reference = metrics(ref_run)
    per_rank_tokens = reference[0]["tokens"] / 4
    print(f"uninterrupted on 4 ranks: exit {p.returncode}, {len(reference)} steps, final loss "
          f"{reference[-1]['loss']:.4f}")

    run, logs = "/tmp/elastic-run", "/tmp/elastic-logs"
    t0 = time.time()
    p = job(run, args, logs, elastic=True)
    wait_for_step(run, args.lose_at, p)
    env = hosts_env(logs)
    lost_at_step = metrics(run)[-1]["step"]
    t_lost = time.time()
    killed = lose_host(env["HOST1"])
    print(f"\nstep {lost_at_step}: host1 lost ({killed} processes SIGKILLed: its agent and ranks)")
    # Until host 0 trains again, on its own: a step after the loss recorded by 2 ranks.
    m = wait_for_world(run, 2, per_rank_tokens, p, "shrinking")
    shrunk_s = time.time() - t_lost
    print(f"  {shrunk_s:.1f} s later host0 trains on its 2 ranks alone, from step "
          f"{m[-1]['step']}")
    wait_for_step(run, args.back_at, p)
    back_at_step = metrics(run)[-1]["step"]
    t_back = time.time()
    agent1 = subprocess.Popen([os.path.join(logs, "host1.sh")])
    print(f"step {back_at_step}: host1 back (its agent started again)")
    m = wait_for_world(run, 4, per_rank_tokens, p, "growing")
    grown_s = time.time() - t_back
    print(f"  {grown_s:.1f} s later 4 ranks train again, from step {m[-1]['step']}")
    out, _ = p.communicate()
    agent1.wait(timeout=120)
    took = time.time() - t0

    with open(os.path.join(logs, "agents.exit")) as f:
        agent_exit = dict(line.strip().split("=") for line in f if "=" in line)
    host0_exit = int(agent_exit.get("host0", -1))
    final = metrics(run)
    host0 = open(os.path.join(logs, "host0.log"), errors="replace").read()
    resumes = re.findall(r"resumed from (\S+) \(step (\d+), saved on (\d+) rank", host0)
    worlds = [world_of(m, per_rank_tokens) for m in final]
    phases = []
    for m, w in zip(final, worlds):
        if not phases or phases[-1][0] != w:
            phases.append([w, m["step"], m["step"]])
        phases[-1][2] = m["step"]
    print(f"\nelastic job: host0's agent exit {host0_exit}, host1's first agent "
          f"{agent_exit.get('host1')} (killed), its second {agent1.returncode}; "
          f"{len(final)} steps, {took:.0f} s in all")
    for w, a, b in phases:
        print(f"  steps {a}-{b}: {w} ranks")
    for d, step, saved_on in resumes:
        print(f"  resumed from {os.path.basename(d)} (step {step}), saved on {saved_on} ranks")
    ref_loss = {m["step"]: m["loss"] for m in reference}
    print("  loss every 25 steps (elastic | uninterrupted):")
    for m, w in zip(final, worlds):
        if m["step"] % 25 == 0:
            print(f"    step {m['step']:4d}  {m['loss']:.4f} ({w} ranks) | {ref_loss[m['step']]:.4f}")
    # One step's loss is noisy (a 2-rank step sees half the batch): the last 50 steps' mean.
    tail = [m["loss"] for m in final[-50:]]
    ref_tail = [m["loss"] for m in reference[-50:]]
    mean, ref_mean = sum(tail) / len(tail), sum(ref_tail) / len(ref_tail)
    rel = (mean - ref_mean) / ref_mean
    ok = (host0_exit == 0 and agent1.returncode == 0 and [w for w, _, _ in phases] == [4, 2, 4]
          and len(final) == args.steps and len(resumes) >= 2 and abs(rel) < 0.05)
    print(f"  mean loss of the last 50 steps {mean:.4f} against {ref_mean:.4f} uninterrupted "
          f"({rel * 100:+.2f}%; bound 5%)")
    if args.plot:
        plot(args.plot, [("4 ranks, no fault", [(m["step"], m["loss"]) for m in reference]),
                         ("elastic: 4, host lost -> 2, host back -> 4",
                          [(m["step"], m["loss"]) for m in final])])
        print(f"  loss curves: {args.plot}")
    left = live_trainers()
    print(f"processes left: {len(left)}")
    print(f"[{'PASS' if ok and not left else 'FAIL'}] elastic shrink and grow")
    sys.exit(0 if ok and not left else 1)


if __name__ == "__main__":
    main()
