"""Chaos and soak: a 2,000-step fsdp-train job under torchrun, checkpointing every 50 steps,
while this script kills a random rank at random moments 10 times; against the same job run
without faults, watched from /proc.

    python3 bench/chaos.py [--steps 2000] [--kills 10] [--seed 1] [--timeout-s 5]

  soak   the uninterrupted job (torchrun --max-restarts 0): each rank's resident memory, open
         file descriptors and threads read from /proc at steps 100, 300, 500, 1000, 1500 and
         10 steps before the end. Bounds: resident memory grows < 1% from step 100 to the end
         (and from step 500), descriptors and threads the same at every reading. The caching
         CPU allocator (training.cpu_cache, on by default) is what keeps resident memory flat:
         with glibc alone it grew 5-7% (docs/multi-node.md).
  chaos  the same job with --max-restarts 30 and checkpoint.resume = auto. Each kill picks a
         rank at random and either SIGKILLs it or SIGSTOPs it (the others time out after
         fsdp.timeout_s and exit; torchrun's agent then kills the stopped one), at a random
         step or while a checkpoint is being written (its step-N.tmp directory exists).
         torchrun restarts every rank; they resume from the newest complete checkpoint.
         Bounds: the job ends with exit 0; the final checkpoint's rank files are byte for byte
         those of the uninterrupted job (parameters and optimizer state) and so are the losses
         of every step; every checkpoint ever left in the directory resumes on one rank.

The script exits non-zero if a bound is not met, and prints the machine, each kill (signal,
rank, step, how long until the job trained again) and the /proc figures.
"""
import argparse
import filecmp
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from machine import cpu_description  # noqa: E402
from multi_host_faults import live_trainers, trainer_processes  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "build", "trainer", "fsdp-train")
VENV = os.path.join(os.environ.get("FSDP_CACHE", os.path.expanduser("~/.cache/fsdp-cpp")),
                    "torch-" + open(os.path.join(ROOT, ".torch-version")).read().strip())
TORCHRUN = os.path.join(VENV, "bin", "torchrun")
EVERY = 50


def job_args(run_dir, steps, timeout_s, every=EVERY, resume="auto"):
    """The job: the demo's model and data, a smaller batch so that 2,000 steps take minutes."""
    return [os.path.join(ROOT, "configs", "demo.toml"), f"--training.steps={steps}",
            "--training.batch_size=4", "--training.seq_len=64", "--training.eval_every=0",
            "--logging.plot=false", "--logging.progress=lines", "--logging.log_every=500",
            "--generate.tokens=0", f"--logging.run_dir={run_dir}",
            f"--checkpoint.every={every}", "--checkpoint.keep=1000", f"--checkpoint.resume={resume}",
            f"--fsdp.timeout_s={timeout_s}"]


def start(run_dir, steps, timeout_s, restarts, log, preload="", extra=()):
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node=2", f"--max-restarts={restarts}",
           "--monitor-interval=0.2", "--no-python", "--", TRAIN,
           *job_args(run_dir, steps, timeout_s), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if preload:
        env["LD_PRELOAD"] = preload
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            cwd=ROOT, start_new_session=True)


def last_step(run_dir):
    """The last step metrics.jsonl records (-1 before the first)."""
    try:
        with open(os.path.join(run_dir, "metrics.jsonl"), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return -1
    for line in reversed(lines):
        try:
            return json.loads(line)["step"]
        except (ValueError, KeyError):
            continue
    return -1


def ranks(agent_pid):
    """The fsdp-train processes torchrun's agent runs now (its children), alive ones only."""
    return sorted(pid for pid, parent in trainer_processes(hosts_only=False)
                  if parent == agent_pid)


def proc_figures(pid):
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":", 1) for line in f)
    return {"rss_kib": int(status["VmRSS"].split()[0]), "threads": int(status["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def wait_until(pred, deadline_s, what):
    t0 = time.time()
    while time.time() - t0 < deadline_s:
        v = pred()
        if v:
            return v
        time.sleep(0.005)
    raise SystemExit(f"chaos.py: {what} did not happen within {deadline_s} s")


def settled_figures(pid):
    """Resident memory, and the fewest descriptors and threads over a few readings 20 ms
    apart: a checkpoint being written holds one more file open for a moment."""
    readings = []
    for _ in range(5):
        readings.append(proc_figures(pid))
        time.sleep(0.02)
    return {"rss_kib": readings[-1]["rss_kib"], "fds": min(r["fds"] for r in readings),
            "threads": min(r["threads"] for r in readings)}


def soak(args):
    run, log = "/tmp/chaos-reference", "/tmp/chaos-reference.log"
    t0 = time.time()
    p = start(run, args.steps, args.timeout_s, 0, log, preload=args.preload,
              extra=[f"--training.cpu_cache={args.cpu_cache}"])
    at_steps = [100, 300, 500, 1000, 1500, args.steps - 10]
    samples = {}
    for at in at_steps:
        wait_until(lambda: last_step(run) >= at or p.poll() is not None, 1800, f"step {at}")
        samples[at] = {pid: settled_figures(pid) for pid in ranks(p.pid)}
    p.wait()
    took = time.time() - t0
    ok = p.returncode == 0
    print(f"\nsoak: {args.steps} steps without faults in {took:.0f} s, exit {p.returncode}; "
          f"each rank's resident memory (MiB), descriptors and threads from /proc:")
    print("  " + " | ".join(f"step {a:>5}" for a in at_steps))
    first, last = samples[100], samples[at_steps[-1]]
    for pid in sorted(first):
        row = [samples[a].get(pid) for a in at_steps]
        if any(r is None for r in row):
            ok = False
            print(f"  pid {pid}: gone before the end")
            continue
        print("  " + " | ".join(f"{r['rss_kib'] / 1024:6.1f} {r['fds']:3d} {r['threads']:3d}"
                                for r in row) + f"   (pid {pid})")
        growth_100 = (row[-1]["rss_kib"] - row[0]["rss_kib"]) / row[0]["rss_kib"]
        growth_500 = (row[-1]["rss_kib"] - row[2]["rss_kib"]) / row[2]["rss_kib"]
        constant = all(r["fds"] == row[0]["fds"] and r["threads"] == row[0]["threads"]
                       for r in row)
        ok &= growth_100 < 0.01 and growth_500 < 0.01 and constant
        print(f"    resident memory {growth_100 * 100:+.2f}% from step 100 to the end, "
              f"{growth_500 * 100:+.2f}% from step 500; descriptors and threads "
              f"{'constant' if constant else 'CHANGED'}")
    print(f"[{'PASS' if ok else 'FAIL'}] soak (bounds: resident memory < 1% growth from step "
          f"100 and from step 500 to the end, descriptors and threads constant)")
    return ok, run


def saving(run):
    return glob.glob(os.path.join(run, "checkpoints", "step-*.tmp"))


def chaos(args, reference):
    rnd = random.Random(args.seed)
    run, log = "/tmp/chaos-run", "/tmp/chaos-run.log"
    t0 = time.time()
    p = start(run, args.steps, args.timeout_s, 3 * args.kills, log)
    # Random steps spread over the run, one kill each; alternately at that step and at the
    # next checkpoint write after it. Signals: SIGSTOP for a third of them.
    targets = sorted(rnd.sample(range(30, args.steps - 2 * EVERY), args.kills))
    signals = [signal.SIGSTOP if i % 3 == 2 else signal.SIGKILL for i in range(args.kills)]
    rnd.shuffle(signals)
    events = []
    for i, target in enumerate(targets):
        wait_until(lambda: last_step(run) >= target or p.poll() is not None, 1800,
                   f"step {target}")
        if p.poll() is not None:
            break
        if i % 2 == 1:
            wait_until(lambda: saving(run) or p.poll() is not None, 600, "a checkpoint write")
        else:
            time.sleep(rnd.uniform(0, 0.05))
        pids = ranks(p.pid)
        if not pids:
            continue
        victim = rnd.choice(pids)
        rank = pids.index(victim)
        step = last_step(run)
        killed_at = time.time()
        os.kill(victim, signals[i])
        # Whether the kill caught a save half-way: its .tmp directory outlives the kill.
        time.sleep(0.05)
        half = saving(run)
        moment = f"mid-save of {os.path.basename(half[0])}" if half else "mid-step"
        # Trained again: new rank processes and a step recorded after they started.
        wait_until(lambda: (set(ranks(p.pid)) & set(pids)) == set() and len(ranks(p.pid)) == 2
                   or p.poll() is not None, 600, "the restart")
        restarted = time.time()
        # Resuming rewrites metrics.jsonl up to the checkpoint's step; the next line is a step
        # trained again.
        resumed_at = None
        metrics = os.path.join(run, "metrics.jsonl")
        while p.poll() is None and time.time() - restarted < 600:
            if os.path.getmtime(metrics) > restarted:
                resumed_at = last_step(run)
                break
            time.sleep(0.005)
        while p.poll() is None and resumed_at is not None and last_step(run) <= resumed_at:
            time.sleep(0.005)
        events.append((signals[i].name, rank, victim, step, moment, restarted - killed_at,
                       time.time() - killed_at, resumed_at))
    p.wait()
    took = time.time() - t0
    print(f"\nchaos: {len(events)} kills, job exit {p.returncode}, {took:.0f} s in all")
    for sig, rank, pid, step, moment, restart_s, train_s, resumed in events:
        print(f"  {sig:7} rank {rank} (pid {pid}) at step {step}, {moment}: ranks restarted "
              f"after {restart_s:.1f} s, resumed at step {resumed}, trained its next step "
              f"{train_s:.1f} s after the kill")
    ok = p.returncode == 0 and len(events) == args.kills

    # The final state, against the uninterrupted job: the rank files hold the parameters and
    # the optimizer state, written in the same order from the same layout.
    final = f"step-{args.steps:08d}"
    same = True
    for rank_file in sorted(glob.glob(os.path.join(reference, "checkpoints", final, "rank-*"))):
        mine = os.path.join(run, "checkpoints", final, os.path.basename(rank_file))
        equal = os.path.exists(mine) and filecmp.cmp(rank_file, mine, shallow=False)
        same &= equal
        print(f"  {final}/{os.path.basename(rank_file)}: "
              f"{'byte for byte equal' if equal else 'DIFFERS'} to the uninterrupted job's")

    def losses(d):
        with open(os.path.join(d, "metrics.jsonl")) as f:
            return [(m["step"], m["loss"]) for m in map(json.loads, f) if "loss" in m]
    same_losses = losses(run) == losses(reference) and len(losses(run)) == args.steps
    print(f"  losses of all {args.steps} steps: "
          f"{'bitwise equal' if same_losses else 'DIFFER'} to the uninterrupted job's")
    ok &= same and same_losses

    # Every checkpoint left behind resumes (one rank, resharded from two: every tensor piece,
    # its checksums, the optimizer state, the sampler and random state are read).
    left = sorted(d for d in glob.glob(os.path.join(run, "checkpoints", "*")))
    unloadable = []
    for d in left:
        name = os.path.basename(d)
        if not name.startswith("step-") or not name[5:].isdigit():
            print(f"  left in the checkpoint directory: {name} (not a checkpoint name: "
                  f"'latest' never picks it)")
            continue
        step = int(name[5:])
        r = subprocess.run([TRAIN, *job_args("/tmp/chaos-verify", step + 1, args.timeout_s,
                                             every=0, resume=d)],
                           capture_output=True, text=True, cwd=ROOT,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        if r.returncode != 0 or f"resumed from {d}" not in r.stdout:
            unloadable.append((name, (r.stdout + r.stderr).strip().splitlines()[-1:]))
    print(f"  checkpoints left: {len(left)}; each resumed on 1 rank: "
          f"{len(left) - len(unloadable)} did, {len(unloadable)} did not {unloadable or ''}")
    ok &= not unloadable
    print(f"[{'PASS' if ok else 'FAIL'}] chaos")
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=5)
    ap.add_argument("--preload", default="",
                    help="a malloc for the soak run's ranks (LD_PRELOAD), e.g. Debian's "
                         "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    ap.add_argument("--cpu-cache", choices=["true", "false"], default="true",
                    help="training.cpu_cache of the soak run (false: glibc's malloc alone)")
    ap.add_argument("--soak-only", action="store_true")
    args = ap.parse_args()
    print(f"machine: {cpu_description()}")
    print(f"soak run's malloc: {args.preload or 'glibc'}, training.cpu_cache = {args.cpu_cache}")
    ok, reference = soak(args)
    if not args.soak_only:
        ok &= chaos(args, reference)
    left = live_trainers(hosts_only=False)
    for _ in range(50):  # the last ranks may take a moment to be gone
        if not left:
            break
        time.sleep(0.1)
        left = live_trainers(hosts_only=False)
    print(f"\nprocesses left: {len(left)}")
    sys.exit(0 if ok and not left else 1)


if __name__ == "__main__":
    main()
