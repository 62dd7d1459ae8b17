"""Faults of a multi-host job, each injected into a real 2-host x 2-rank fsdp-train run over
scripts/hosts.sh, with the time to a clear error, the messages, and the processes left.

    sudo python3 bench/multi_host_faults.py [--timeout-s 10] [--only link-cut,stall,lossy]

  link-cut  host 1's link goes down mid-training (ip link set down): every rank on both sides
            must exit non-zero within fsdp.timeout_s (plus the diagnosis: at most 5 s), its
            error naming the ranks and host it lost.
  stall     one rank of host 1 is stopped (SIGSTOP): the others must name it (rank and host),
            not only say that a collective timed out; fr-analyze on the dumps names it too.
  lossy     2% of every packet dropped and the links shaped to 100 Mbit/s: training goes on
            and the losses equal those of the clean run bitwise. (A 20 ms delay needs the
            kernel's netem; hosts.sh refuses --delay where it is missing, as on our machines.)

Bounds are checked and printed; the script exits non-zero if one is not met.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "build", "trainer", "fsdp-train")
HOSTS = os.path.join(ROOT, "scripts", "hosts.sh")


def job(run_dir, steps, timeout_s, logs, extra_hosts=(), extra=()):
    cmd = [HOSTS, "--logs", logs, *extra_hosts, "--", TRAIN, os.path.join(ROOT, "configs", "demo.toml"),
           f"--training.steps={steps}", "--training.eval_every=0", "--logging.plot=false",
           "--logging.progress=lines", f"--logging.run_dir={run_dir}",
           f"--fsdp.timeout_s={timeout_s}", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_training(run_dir, deadline_s=60):
    """Until metrics.jsonl has a step: the job is past its rendezvous and training."""
    path = os.path.join(run_dir, "metrics.jsonl")
    start = time.time()
    while time.time() - start < deadline_s:
        if os.path.exists(path) and os.path.getsize(path) > 0:
            return
        time.sleep(0.2)
    raise SystemExit(f"the job did not start training within {deadline_s} s")


def hosts_env(logs):
    env = {}
    with open(os.path.join(logs, "hosts.env")) as f:
        for line in f:
            for kv in line.split():
                k, v = kv.split("=", 1)
                env[k] = v
    return env


def rank_pids(ns):
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    pids = []
    for p in out.split():
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if os.path.basename(argv[0].decode()) == "fsdp-train":
                pids.append(int(p))
        except OSError:
            pass
    return sorted(pids)


def end_job(p, grace_s=30):
    """Waits for the agents up to grace_s, then ends hosts.sh (which removes everything).
    Returns how the agents ended."""
    try:
        p.wait(timeout=grace_s)
        return "exited on their own"
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
        return f"still waiting on the rendezvous store after {grace_s} s, removed by hosts.sh"


def error_lines(logs):
    lines = []
    for h in (0, 1):
        with open(os.path.join(logs, f"host{h}.log"), errors="replace") as f:
            for line in f:
                if "fsdp-train:" in line and ("failed" in line or "timed out" in line):
                    lines.append((h, line.strip()))
    return lines


def training_job(run, logs, args):
    """A long job, a couple of seconds into training: the moment to inject a fault."""
    shutil.rmtree(run, ignore_errors=True)
    p = job(run, 100000, args.timeout_s, logs)
    wait_for_training(run)
    time.sleep(2)
    return p, hosts_env(logs)


def link_cut(args):
    run, logs = "/tmp/fault-cut", "/tmp/fault-cut-logs"
    p, env = training_job(run, logs, args)
    t0 = time.time()
    subprocess.run(["ip", "link", "set", env["LINK1"], "down"], check=True)
    # The ranks' exit is the bound; the agents (torchrun's) linger up to their store timeout.
    ranks_gone = None
    while time.time() - t0 < args.timeout_s * 3 + 60:
        if not rank_pids(env["HOST0"]) and not rank_pids(env["HOST1"]):
            ranks_gone = time.time() - t0
            break
        time.sleep(0.1)
    agents = end_job(p)
    took = time.time() - t0
    errors = error_lines(logs)
    ranks_failed = {m.group(1) for _, l in errors for m in [re.search(r"\[rank (\d)\]", l)] if m}
    named = all(re.search(r"rank \d \(host host\d", l) or "store did not answer" in l
                for _, l in errors)
    ok = (p.returncode != 0 and ranks_gone is not None and ranks_gone <= args.timeout_s + 5 + 3
          and len(ranks_failed) == 4 and named)
    gone = f"{ranks_gone:.1f} s" if ranks_gone is not None else "NEVER"
    return ok, f"link cut: every rank exited {gone} after the cut (fsdp.timeout_s = " \
               f"{args.timeout_s}; bound: timeout + 5 s diagnosis + 3 s); torchrun's agents " \
               f"{agents} ({took:.1f} s); ranks with an error: " \
               f"{sorted(ranks_failed)}", errors


def stall(args):
    run, logs = "/tmp/fault-stall", "/tmp/fault-stall-logs"
    p, env = training_job(run, logs, args)
    victim = rank_pids(env["HOST1"])[-1]
    t0 = time.time()
    os.kill(victim, signal.SIGSTOP)
    named_after = None
    while time.time() - t0 < args.timeout_s * 3 + 60 and named_after is None:
        if any(f"pid {victim})" in l for _, l in error_lines(logs)):
            named_after = time.time() - t0
        time.sleep(0.1)
    agents = end_job(p, grace_s=60)
    took = time.time() - t0
    errors = error_lines(logs)
    others = [l for h, l in errors if f"pid {victim})" in l]
    analysis = subprocess.run([TRAIN, "fr-analyze", os.path.join(run, "flight_recorder")],
                              capture_output=True, text=True)
    ok = (len(others) >= 1 and named_after is not None
          and named_after <= args.timeout_s + 5 + 3)
    named = f"{named_after:.1f} s" if named_after is not None else "NEVER"
    return ok, f"stall: SIGSTOP of pid {victim} on host1; first error naming it {named} later; " \
               f"torchrun's agents {agents} ({took:.1f} s); {len(others)} " \
               f"error(s) name that pid", \
        errors + [(None, "fr-analyze:\n" + analysis.stdout + analysis.stderr)]


def lossy(args):
    results = {}
    for name, extra in (("clean", ()), ("lossy", ("--loss", "2", "--rate", "100mbit"))):
        run, logs = f"/tmp/fault-{name}", f"/tmp/fault-{name}-logs"
        shutil.rmtree(run, ignore_errors=True)
        t0 = time.time()
        p = job(run, 40, args.timeout_s, logs, extra_hosts=extra)
        p.wait(timeout=1800)
        took = time.time() - t0
        with open(os.path.join(run, "metrics.jsonl")) as f:
            losses = [json.loads(l)["loss"] for l in f if '"loss"' in l and '"step"' in l]
        results[name] = (p.returncode, losses, took)
    same = results["clean"][1] == results["lossy"][1] and len(results["clean"][1]) == 40
    ok = same and results["lossy"][0] == 0
    return ok, f"lossy link (2% loss, 100 Mbit/s): exit {results['lossy'][0]}, 40 steps in " \
               f"{results['lossy'][2]:.1f} s against {results['clean'][2]:.1f} s clean; losses " \
               f"{'bitwise equal' if same else 'DIFFER'} to the clean run", []


def trainer_processes():
    """This build's fsdp-train processes still alive, as (pid, parent pid): zombies waiting to
    be reaped by init are gone, and other builds' runs on the machine are not ours to count."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            continue
        state, ppid = stat[stat.rfind(")") + 2:].split()[:2]
        if exe == TRAIN and state != "Z":
            out.append((int(pid), int(ppid)))
    return out


def live_trainers():
    return [pid for pid, _ in trainer_processes()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout-s", type=float, default=10)
    ap.add_argument("--only", default="link-cut,stall,lossy")
    args = ap.parse_args()
    print(f"machine: {cpu_description()}")
    failed = False
    for name in args.only.split(","):
        ok, summary, lines = {"link-cut": link_cut, "stall": stall, "lossy": lossy}[name](args)
        print(f"\n[{'PASS' if ok else 'FAIL'}] {summary}")
        for host, line in lines:
            print(f"  host{host}: {line}" if host is not None else line)
        failed |= not ok
    left = live_trainers()
    for _ in range(50):  # killed ranks may take a moment to be gone
        if not left:
            break
        time.sleep(0.1)
        left = live_trainers()
    print(f"\nprocesses left: {len(left)}")
    sys.exit(1 if failed or left else 0)


if __name__ == "__main__":
    main()
