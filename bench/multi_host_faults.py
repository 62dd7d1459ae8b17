"""Faults of a multi-host job, each injected into a real 2-host x 2-rank fsdp-train run over
scripts/hosts.sh, with the time to a clear error, the messages, and the processes left.

    sudo python3 bench/multi_host_faults.py [--timeout-s 10] [--only link-cut,stall,lossy]

  link-cut  host 1's link goes down mid-training (ip link set down): every rank on both sides
            must fail within fsdp.timeout_s (plus the diagnosis: at most 5 s), its error naming
            the ranks and host it lost; host 1's ranks, cut off from the store, end their torchrun
            agent (which would wait on the store for ever) before they exit; every process of
            the job, the agents included, must be gone within fsdp.timeout_s + 30 s.
  stall     one rank of host 1 is stopped (SIGSTOP): the others must name it (rank and host),
            not only say that a collective timed out; fr-analyze on the dumps names it too.
  lossy     2% of every packet dropped, 20 ms added to every packet between the hosts (hosts.sh
            --delay: tc netem, or its delay line in user space where the kernel has no netem)
            and the links shaped to 100 Mbit/s: training goes on, exits 0, and the losses equal
            those of the clean run bitwise. The delay is checked to be real: the median round
            trip of 20 small TCP messages between the hosts must be at least 2 x 20 ms (it is
            printed for the clean run too). Without netem or /dev/net/tun it runs without delay.

Bounds are checked and printed; the script exits non-zero if one is not met.
"""
import argparse
import gzip
import json
import os
import re
import shutil
import signal
import statistics
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


def pids_in(ns, wanted):
    """The pids in namespace `ns` whose argv (a list of bytes) `wanted` accepts."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    pids = []
    for p in out.split():
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if wanted(f.read().split(b"\0")):
                    pids.append(int(p))
        except OSError:
            pass
    return sorted(pids)


def rank_pids(ns):
    return pids_in(ns, lambda argv: os.path.basename(argv[0].decode()) == "fsdp-train")


def agent_pids(ns):
    return pids_in(ns, lambda argv: any(b"torchrun" in a for a in argv))


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
                if "fsdp-train:" in line and ("failed" in line or "timed out" in line
                                              or "torchrun agent" in line):
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
    # When each host's ranks and torchrun agent were gone (seconds after the cut).
    gone = {}
    probes = {"host 0's ranks": lambda: rank_pids(env["HOST0"]),
              "host 1's ranks": lambda: rank_pids(env["HOST1"]),
              "host 0's agent": lambda: agent_pids(env["HOST0"]),
              "host 1's agent": lambda: agent_pids(env["HOST1"])}
    while time.time() - t0 < args.timeout_s + 90 and len(gone) < len(probes):
        for what, probe in probes.items():
            if what not in gone and not probe():
                gone[what] = time.time() - t0
        time.sleep(0.1)
    agents = end_job(p, grace_s=5)
    errors = error_lines(logs)
    ranks_failed = {m.group(1) for _, l in errors for m in [re.search(r"\[rank (\d)\]", l)] if m}
    named = all(re.search(r"rank \d \(host host\d", l) or "store did not answer" in l
                or "agent" in l for _, l in errors)
    all_gone = max(gone.values()) if len(gone) == len(probes) else None
    told = sum("torchrun agent" in l and "is told to end" in l for _, l in errors)
    # Host 1's ranks, cut off, end their agent before they exit: 2 s to see that the store is
    # still out of reach, SIGTERM, and SIGKILL after 5 s if it has not ended.
    ok = (p.returncode != 0 and gone.get("host 0's ranks", 1e9) <= args.timeout_s + 5 + 3
          and gone.get("host 1's ranks", 1e9) <= args.timeout_s + 5 + 3 + 2 + 5
          and all_gone is not None and all_gone <= args.timeout_s + 30 and told >= 1
          and len(ranks_failed) == 4 and named)
    when = ", ".join(f"{what} {t:.1f} s" for what, t in sorted(gone.items(), key=lambda x: x[1]))
    return ok, f"link cut: gone after the cut: {when or 'nothing'} (fsdp.timeout_s = " \
               f"{args.timeout_s}; bounds: host 0's ranks within timeout + 5 s diagnosis + 3 s, " \
               f"host 1's 7 s later (they end their agent first), every process within " \
               f"timeout + 30 s); {told} rank(s) told their torchrun agent to end; the agents " \
               f"{agents}; ranks with an error: {sorted(ranks_failed)}", errors


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


def delay_available():
    """Whether hosts.sh can add a delay here: netem, else its delay line (needs /dev/net/tun)."""
    if os.path.isdir("/sys/module/sch_netem") or os.path.exists("/dev/net/tun"):
        return True
    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            return any(re.match(r"CONFIG_NET_SCH_NETEM=[ym]", l) for l in f)
    except OSError:
        return False


# A TCP echo between two hosts: the server (host 0) echoes one connection; the client (host 1)
# sends `n` 32-byte messages one at a time and prints each round trip in ms. Small messages
# with TCP_NODELAY, so that each round trip is the link's latency, not its rate. Both give up
# after 60 s, so that nothing outlives the job (hosts.sh waits for its hosts' processes).
ECHO_SERVER = """
import socket
s = socket.create_server(("10.79.0.1", 29555)); s.settimeout(60)
c, _ = s.accept(); c.settimeout(60); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (d := c.recv(64)):
    c.sendall(d)
"""
ECHO_CLIENT = """
import socket, sys, time
deadline = time.monotonic() + 60
while True:
    try:
        c = socket.create_connection(("10.79.0.1", 29555), timeout=10); break
    except OSError:
        if time.monotonic() > deadline: raise
        time.sleep(0.1)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(int(sys.argv[1])):
    t = time.monotonic(); c.sendall(b"x" * 32); got = 0
    while got < 32: got += len(c.recv(64))
    print((time.monotonic() - t) * 1e3)
"""


def round_trips(logs, n=20, deadline_s=60):
    """Round trips (ms) of n small TCP messages from host 1 to host 0, once both hosts are up."""
    start = time.time()
    while True:
        try:
            env = hosts_env(logs)
        except (OSError, ValueError):
            env = {}
        if "ADDR1" in env:
            break
        if time.time() - start > deadline_s:
            raise SystemExit(f"the hosts were not up within {deadline_s} s")
        time.sleep(0.1)
    server = subprocess.Popen(["ip", "netns", "exec", env["HOST0"], sys.executable, "-c", ECHO_SERVER])
    try:
        out = subprocess.run(["ip", "netns", "exec", env["HOST1"], sys.executable, "-c", ECHO_CLIENT, str(n)],
                             capture_output=True, text=True, timeout=120)
        server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    if out.returncode != 0:
        raise SystemExit(f"the round-trip client failed: {out.stderr}")
    return [float(x) for x in out.stdout.split()]


def lossy(args):
    delay_ms = 20 if delay_available() else 0
    shaping = ("--loss", "2", "--rate", "100mbit") + (("--delay", f"{delay_ms}ms") if delay_ms else ())
    results = {}
    for name, extra in (("clean", ()), ("lossy", shaping)):
        run, logs = f"/tmp/fault-{name}", f"/tmp/fault-{name}-logs"
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(logs, ignore_errors=True)
        t0 = time.time()
        p = job(run, 40, args.timeout_s, logs, extra_hosts=extra)
        rtts = sorted(round_trips(logs))
        out, _ = p.communicate(timeout=1800)
        took = time.time() - t0
        with open(os.path.join(run, "metrics.jsonl")) as f:
            losses = [json.loads(l)["loss"] for l in f if '"loss"' in l and '"step"' in l]
        results[name] = (p.returncode, losses, took, rtts,
                         [l for l in out.splitlines() if l.startswith("hosts.sh: host")])
    same = results["clean"][1] == results["lossy"][1] and len(results["clean"][1]) == 40
    rtt = {k: statistics.median(v[3]) for k, v in results.items()}
    delayed = rtt["lossy"] >= 2 * delay_ms
    ok = same and results["lossy"][0] == 0 and delayed
    what = f"2% loss, {delay_ms} ms delay, 100 Mbit/s" if delay_ms else "2% loss, 100 Mbit/s, no delay here"
    return ok, f"lossy link ({what}): round trip between the hosts {rtt['lossy']:.1f} ms (median of " \
               f"{len(results['lossy'][3])}, min {results['lossy'][3][0]:.1f}, max " \
               f"{results['lossy'][3][-1]:.1f}; bound >= {2 * delay_ms} ms), {rtt['clean']:.2f} ms " \
               f"clean; exit {results['lossy'][0]}, 40 steps in {results['lossy'][2]:.1f} s against " \
               f"{results['clean'][2]:.1f} s clean; losses " \
               f"{'bitwise equal' if same else 'DIFFER'} to the clean run", \
        [(None, f"  {name}: {l}") for name in results for l in results[name][4]]


def trainer_processes(hosts_only=True):
    """This build's fsdp-train processes still alive, as (pid, parent pid): zombies waiting to
    be reaped by init are gone, and other builds' runs on the machine are not ours to count.
    With hosts_only, only those on emulated hosts: not runs in this machine's own network
    namespace (a concurrent single-host job of this build: every rank of ours runs in a host's
    namespace, and keeps it if it outlives hosts.sh). bench/chaos.py's jobs run on this
    machine's own namespace: it passes hosts_only=False."""
    own_netns = os.readlink("/proc/self/ns/net")
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            exe = os.readlink(f"/proc/{pid}/exe")
            netns = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        state, ppid = stat[stat.rfind(")") + 2:].split()[:2]
        if exe == TRAIN and state != "Z" and (not hosts_only or netns != own_netns):
            out.append((int(pid), int(ppid)))
    return out


def live_trainers(hosts_only=True):
    return [pid for pid, _ in trainer_processes(hosts_only)]


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
