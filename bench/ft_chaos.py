"""Chaos for fault-tolerant training (fsdp.fault_tolerant, docs/multi-node.md): 3 emulated hosts
x 2 ranks (scripts/hosts.sh --launcher fsdp-train: one fsdp-train launcher per host, host 0's
serving the store), one replica per host, 400 steps of the demo's model, while this script
injects 20 random faults one after another, each into a job whose 3 replicas are all training:

  kill   SIGKILL of a random rank (any host)
  stop   SIGSTOP of a random rank, SIGCONT after a random delay (1-6 s)
  cut    a random host's link down (ip link set ... down), up again after the delay
  host   a random host lost: every process in its namespace killed (its launcher too), its
         launcher started again after the delay (<logs>/host<h>.sh), into the running job

Host 0 is never cut off or lost: its launcher serves the store, the job's arbiter (as torchft's
lighthouse); its ranks are killed and stopped like the others.

    sudo python3 bench/ft_chaos.py [--steps 400] [--faults 20] [--seed 1] [--timeout-s 5]

Bounds (the script exits non-zero if one is not met): the job ends with exit 0; training never
stopped (steps completed in every 20 s window); no checkpoint exists; at each fault the other
replicas' processes are the same before and after it (no surviving process restarted); the
losses of all steps and the held-out losses equal, bit for bit, those of a run on loopback
given the membership schedule the chaos run wrote (membership.jsonl). It prints the machine,
each fault (kind, target, step, time until the survivors' next completed step, the step its
replica came back at and how long that took), writes bench/results/ft_chaos.json and
ft_chaos.svg (steps completed per 10 s over time, faults marked) and the loss curves of the
chaos run and of an uninterrupted run.
"""
import argparse
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "build", "trainer", "fsdp-train")
HOSTS, NPROC = 3, 2
TAG = f"FSDP_FT_CHAOS={os.getpid()}"


def job_args(run_dir, steps, timeout_s):
    return [os.path.join(ROOT, "configs", "demo.toml"), f"--training.steps={steps}",
            "--training.batch_size=4", "--training.seq_len=128", "--training.eval_every=100",
            "--logging.plot=false", "--logging.progress=lines", "--logging.log_every=50",
            "--generate.tokens=0", f"--logging.run_dir={run_dir}",
            "--fsdp.strategy=hybrid_shard", f"--fsdp.hybrid_shard_size={NPROC}",
            "--fsdp.fault_tolerant=true", f"--fsdp.timeout_s={timeout_s}",
            "--fsdp.max_restarts=100"]


def lines(path):
    try:
        with open(path) as f:
            out = []
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # a line being written
            return out
    except OSError:
        return []


def processes():
    """{pid: env} of this run's fsdp-train processes (launchers and ranks)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        if env.get(TAG.split("=")[0].encode()) == TAG.split("=")[1].encode():
            out[int(pid)] = {k.decode(): v.decode(errors="replace") for k, v in env.items()}
    return out


def rank_pids():
    """{rank: pid} of the ranks running now."""
    return {int(env["RANK"]): pid for pid, env in processes().items() if "RANK" in env}


def live_replicas(run_dir):
    changes = lines(os.path.join(run_dir, "membership.jsonl"))
    return changes[-1]["live"] if changes else []


def svg_plot(samples, faults, path, title):
    """Steps completed per 10 s over time, a vertical line at each fault."""
    t_end = samples[-1][0] if samples else 1
    buckets = []
    for b in range(int(t_end // 10) + 1):
        inside = [s for t, s in samples if b * 10 <= t < (b + 1) * 10]
        before = [s for t, s in samples if t < b * 10]
        buckets.append(max(inside or [0]) - max(before or [0]))
    w, h, pad = 900, 300, 40
    top = max(buckets + [1])
    x = lambda t: pad + (w - 2 * pad) * t / max(t_end, 1)  # noqa: E731
    y = lambda v: h - pad - (h - 2 * pad) * v / top  # noqa: E731
    pts = " ".join(f"{x(b * 10 + 5):.1f},{y(v):.1f}" for b, v in enumerate(buckets))
    marks = "".join(
        f'<line x1="{x(f["t"]):.1f}" y1="{pad}" x2="{x(f["t"]):.1f}" y2="{h - pad}" '
        f'stroke="red" stroke-dasharray="3,3"/><text x="{x(f["t"]) + 2:.1f}" y="{pad + 10}" '
        f'font-size="9" fill="red">{f["kind"]}</text>' for f in faults)
    with open(path, "w") as f:
        f.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}">'
                f'<text x="{pad}" y="20" font-size="13">{title}</text>'
                f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>'
                f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>'
                f'<text x="{w / 2}" y="{h - 8}" font-size="11">seconds ({t_end:.0f} in all)</text>'
                f'<text x="4" y="{pad - 6}" font-size="11">steps per 10 s (max {top})</text>'
                f'<polyline fill="none" stroke="blue" points="{pts}"/>{marks}</svg>')


def inject(kind, target, delay, hosts_env, logs):
    """Starts a fault; returns what restores it (None when nothing is to be restored)."""
    if kind == "kill":
        os.kill(rank_pids()[target], signal.SIGKILL)
        return None
    if kind == "stop":
        pid = rank_pids()[target]
        os.kill(pid, signal.SIGSTOP)
        return lambda: os.kill(pid, signal.SIGCONT)
    if kind == "cut":
        link = hosts_env[f"LINK{target}"]
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        return lambda: subprocess.run(["ip", "link", "set", link, "up"], check=True)
    ns = hosts_env[f"HOST{target}"]
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    for p in pids.split():
        try:
            os.kill(int(p), signal.SIGKILL)
        except ProcessLookupError:
            pass
    return lambda: subprocess.Popen([os.path.join(logs, f"host{target}.sh")],
                                    start_new_session=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--faults", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=5)
    ap.add_argument("--work", default="/tmp/fsdp-ft-chaos")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("ft_chaos.py: needs root (scripts/hosts.sh)")
    # SIGTERM (timeout, kill) ends this script through its finally: the job goes with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rng = random.Random(a.seed)
    print("machine:", cpu_description(), flush=True)
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    run_dir, logs = os.path.join(a.work, "chaos"), os.path.join(a.work, "logs")
    job = subprocess.Popen(
        [os.path.join(ROOT, "scripts", "hosts.sh"), "--hosts", str(HOSTS), "--nproc-per-host",
         str(NPROC), "--launcher", "fsdp-train", "--logs", logs, "--", "env", TAG, TRAIN,
         *job_args(run_dir, a.steps, a.timeout_s)],
        stdout=open(os.path.join(a.work, "hosts.log"), "w"), stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        return run(a, rng, job, run_dir, logs)
    finally:
        if job.poll() is None:  # this script stopped early: hosts.sh's cleanup ends the job
            job.terminate()
            job.wait()


def run(a, rng, job, run_dir, logs):
    metrics = os.path.join(run_dir, "metrics.jsonl")
    t0 = time.time()
    samples = []  # (seconds, steps logged)
    first_seen = {}  # step -> seconds when its line was first seen
    faults = []
    active = []  # faults not yet resolved
    next_at = 8.0
    violations = []
    while job.poll() is None:
        now = time.time() - t0
        ms = lines(metrics)
        for m in ms:
            first_seen.setdefault(m["step"], now)
        last = ms[-1]["step"] if ms else 0
        samples.append((now, last))
        live = live_replicas(run_dir)
        pids = rank_pids()
        for f in list(active):
            if f["restore"] and now >= f["t"] + f["delay"]:
                f["restore"]()
                f["restore"] = None
                f["restored_t"] = now
            f["dropped"] = f["dropped"] or f["replica"] not in live
            back = f["replica"] in live and all(
                r in pids for r in range(f["replica"] * NPROC, (f["replica"] + 1) * NPROC))
            stepped = any(t > f.get("restored_t", 1e9) + 1 for t in first_seen.values())
            if f["restore"] is None and back and (f["dropped"] or stepped):
                # The replicas no fault touched meanwhile kept their processes.
                for r, pid in f["others"].items():
                    if r // NPROC not in f["touched"] and pids.get(r) != pid:
                        violations.append(f"fault {faults.index(f) + 1}: rank {r} of an untouched "
                                          f"replica changed process ({pid} -> {pids.get(r)})")
                f["resolved_t"] = now
                active.remove(f)
        # The next fault: into a replica that is training with all its ranks, keeping at least
        # one other replica untouched and settled (training for the last 5 steps: one being
        # admitted fails with a fault's collectives, and if every replica is faulted or joining
        # at once, no copy of the state is left); host 0 (the store's) is never cut off or lost.
        busy = {f["replica"] for f in active}
        changes = lines(os.path.join(run_dir, "membership.jsonl"))

        def live_at(step):
            return next((c["live"] for c in reversed(changes) if c["step"] <= step), [])
        settled = {q for q in live if q in live_at(last - 5) and all(
            q in c["live"] for c in changes if c["step"] > last - 5)}
        candidates = [q for q in live if q not in busy and
                      all(r in pids for r in range(q * NPROC, (q + 1) * NPROC))]
        if (len(faults) < a.faults and now >= next_at and 10 < last < a.steps - 30
                and len(candidates) >= 2 and len(settled - busy) >= 2):
            replica = rng.choice(candidates)
            kinds = ["kill", "stop"] + (["cut", "host"] if replica != 0 else [])
            kind = rng.choice(kinds)
            target = replica * NPROC + rng.randrange(NPROC) if kind in ("kill", "stop") else replica
            delay = rng.uniform(2, 12)
            hosts_env = dict(kv.split("=", 1) for kv in
                             open(os.path.join(logs, "hosts.env")).read().split())
            # The others whose processes must stay: the settled replicas.
            f = {"kind": kind, "target": target, "replica": replica, "step": last, "t": now,
                 "delay": delay, "dropped": False, "touched": {replica},
                 "others": {r: p for r, p in pids.items()
                            if r // NPROC != replica and r // NPROC in settled}}
            for g in active:  # overlapping faults: each one's window covers the other's replica
                g["touched"].add(replica)
                f["touched"].add(g["replica"])
            f["restore"] = inject(kind, target, delay, hosts_env, logs)
            print(f"[{now:6.1f} s] fault {len(faults) + 1}: {kind} "
                  f"{'rank' if kind in ('kill', 'stop') else 'host'} {target} at step {last} "
                  f"(restored after {delay:.1f} s; {len(active)} other fault(s) unresolved)",
                  flush=True)
            faults.append(f)
            active.append(f)
            next_at = now + rng.uniform(2, 7)
        time.sleep(0.05)
    for f in active:
        if f["restore"]:
            f["restore"]()
            f["restore"] = None
    code = job.returncode
    total = time.time() - t0
    print(f"chaos run: exit {code} after {total:.0f} s", flush=True)

    changes = lines(os.path.join(run_dir, "membership.jsonl"))
    schedule = {}
    for c in changes[1:]:
        schedule[c["step"]] = c["live"]
    # Per fault: the survivors' next completed step after it; the first change after it that
    # drops its replica, and the first after that which has it back.
    for f in faults:
        nxt = [t for t in first_seen.values() if t > f["t"]]
        f["next_step_s"] = min(nxt) - f["t"] if nxt else None
        drop = next((c for c in changes[1:] if c["step"] >= f["step"] and
                     f["replica"] not in c["live"]), None) if f["dropped"] else None
        back = next((c for c in changes[1:] if drop and changes.index(c) > changes.index(drop)
                     and f["replica"] in c["live"]), None)
        f["dropped_at"] = drop["step"] if drop else None
        f["back_at"] = back["step"] if back else None
        f["back_s"] = (first_seen.get(back["step"], total) - f["t"]) if back else None
        f.pop("touched", None)
    ok = True
    # hosts.sh's code is its first agents': a lost host's was SIGKILLed. The job succeeded when
    # host 0's launcher (the store's) ended with 0 and every step was logged.
    agents = dict(kv.split("=") for kv in open(os.path.join(logs, "agents.exit")).read().split())
    print("first launchers' exit codes:", agents, "| hosts.sh:", code)
    if agents.get("host0") != "0" or len(lines(metrics)) != a.steps:
        ok = False
        print("BOUND: the job did not end with exit 0 and every step logged")
    if len(faults) < a.faults:
        ok = False
        print(f"BOUND: only {len(faults)} faults were injected")
    for t0w in range(0, int(total) - 20, 20):
        done = [s for t, s in samples if t0w <= t < t0w + 20]
        if done and max(done) == min(done) and max(done) < a.steps:
            ok = False
            print(f"BOUND: no step completed between {t0w} and {t0w + 20} s")
    if os.path.exists(os.path.join(run_dir, "checkpoints")):
        ok = False
        print("BOUND: a checkpoint directory exists")
    for v in violations:
        ok = False
        print("BOUND:", v)

    # The reference: the same job on loopback, told the schedule; and one without faults.
    text = ";".join(f"{s}:{','.join(map(str, live))}" for s, live in sorted(schedule.items()))
    reference, plain = os.path.join(a.work, "reference"), os.path.join(a.work, "plain")
    for d, extra in ((reference, [f"--fsdp.membership_schedule={text}"] if text else []),
                     (plain, [])):
        r = subprocess.run([TRAIN, *job_args(d, a.steps, a.timeout_s), "--nproc",
                            str(HOSTS * NPROC), *extra], capture_output=True, text=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        if r.returncode != 0:
            ok = False
            print(f"BOUND: the run in {d} failed: {r.stderr[-2000:]}")
    ma, mb, mp = lines(metrics), lines(os.path.join(reference, "metrics.jsonl")), \
        lines(os.path.join(plain, "metrics.jsonl"))
    same = len(ma) == len(mb) == a.steps and all(
        x["step"] == y["step"] and x["loss"] == y["loss"] and x.get("eval_loss") == y.get("eval_loss")
        for x, y in zip(ma, mb))
    if not same:
        ok = False
        print("BOUND: the losses differ from the schedule run's")
    print(f"losses of all {len(ma)} steps and the held-out losses equal the schedule run's: {same}")
    evals = lambda ms: [(m["step"], m["eval_loss"]) for m in ms if "eval_loss" in m]  # noqa: E731
    print("held-out loss, chaos run:        ", evals(ma))
    print("held-out loss, uninterrupted run:", evals(mp))

    print("\n| # | fault | target | at step | survivors' next step after | dropped at | back at "
          "| back after |")
    print("|---|---|---|---|---|---|---|---|")
    for i, f in enumerate(faults):
        fmt = lambda v, u="": "" if v is None else (f"{v:.2f}{u}" if isinstance(v, float) else f"{v}{u}")  # noqa: E731,E501
        print(f"| {i + 1} | {f['kind']} ({f['delay']:.1f} s) | "
              f"{'rank' if f['kind'] in ('kill', 'stop') else 'host'} {f['target']} | {f['step']} | "
              f"{fmt(f['next_step_s'], ' s')} | {fmt(f['dropped_at'])} | {fmt(f['back_at'])} | "
              f"{fmt(f['back_s'], ' s')} |")
    os.makedirs(a.out, exist_ok=True)
    svg_plot(samples, faults, os.path.join(a.out, "ft_chaos.svg"),
             f"fsdp-train, 3 hosts x 2 ranks, {len(faults)} faults: steps completed per 10 s")
    with open(os.path.join(a.out, "ft_chaos.json"), "w") as out:
        json.dump({"machine": cpu_description(), "seconds": total, "exit": code,
                   "schedule": text, "same_losses": same,
                   "faults": [{k: v for k, v in f.items() if k not in ("restore", "others",
                                                                       "touched")}
                              for f in faults],
                   "samples": samples[::10], "chaos_losses": [m["loss"] for m in ma],
                   "plain_losses": [m["loss"] for m in mp]}, out, indent=1)
    print("bounds met" if ok else "BOUNDS NOT MET")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
