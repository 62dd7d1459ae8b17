"""tests/python/forkserver.py and its client (tests/harness/forkserver_client.cpp): a script run
through the server sees what it would see in a Python of its own (arguments, working directory,
environment, stdin, stdout and stderr apart) and its client exits with its status; a killed client takes the script and its children with it; without
a server the client runs the script itself, with the same results. With a test binary's path
(tests/harness/zygote.h): the same of a run through the binary's zygote, and a zygote whose
binary changed refuses (the client runs the binary itself) and ends. With fsdp_trainer_tests' and
fsdp-train's paths: that zygote serves fsdp-train (tests/trainer/serve_programs.cpp) with
fsdp-train's own output and exit code, in a copy (the client's CPU is not fsdp-train's start),
and leaves to fsdp-train a request whose environment differs in a variable read at start.
Exits non-zero on a mismatch.

    check_forkserver.py CLIENT [FSDP_TESTS [FSDP_TRAINER_TESTS FSDP_TRAIN]]
"""
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SERVER = os.path.join(HERE, "forkserver.py")
CLIENT = None  # the client's path (the first argument)

SCRIPT = r'''
import os, sys
print("argv=%s cwd=%s env=%s served=%s" % (sys.argv[1:], os.getcwd(),
      os.environ.get("FORKSERVER_CHECK"), os.environ.get("FSDP_FORKSERVED")))
print("stdin=" + sys.stdin.readline().strip(), file=sys.stderr)
if sys.argv[1] == "raise":
    raise RuntimeError("raised on purpose")
sys.exit(int(sys.argv[1]))
'''

SLEEPER = r'''
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
time.sleep(120)
'''


def check(cond, what):
    if not cond:
        sys.exit("FAILED: " + what)


def client(sock, script, *args, stdin="", cwd=None, env=None):
    env = env or dict(os.environ, FORKSERVER_CHECK="seen")
    return subprocess.run([CLIENT, sock, script, *args], input=stdin, capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=60)


def wait_while(condition, seconds=10):
    deadline = time.monotonic() + seconds
    while condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose; one reaped between the kill and the read (the open
    # succeeds, the read finds no process) is dead too.
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def cases(sock, tmp, script, sleeper, served):
    for code in ("0", "3"):
        r = client(sock, script, code, "two words", stdin="line in\n", cwd=tmp)
        check(r.returncode == int(code), "exit code %s, got %d: %s" % (code, r.returncode, r))
        check(r.stdout == "argv=['%s', 'two words'] cwd=%s env=seen served=%s\n" %
              (code, tmp, served), 
              "stdout: %r" % r.stdout)
        check(r.stderr == "stdin=line in\n", "stderr: %r" % r.stderr)
    r = client(sock, script, "raise", stdin="x\n", cwd=tmp)
    check(r.returncode == 1 and "RuntimeError: raised on purpose" in r.stderr, "raise: %s" % r)
    # An environment JSON cannot carry (a value not UTF-8): the client runs the script itself.
    odd = dict(os.environb, FORKSERVER_CHECK=b"seen", FSDP_ODD=b"\xff")
    r = client(sock, script, "4", "x", stdin="y\n", cwd=tmp, env=odd)
    check(r.returncode == 4 and r.stdout.startswith("argv=['4', 'x'] cwd=%s env=seen served=None" %
                                                     tmp), "not UTF-8: %r" % r)
    if not served:
        return  # a Python of its own: a killed one leaves its children, as any Python does
    # A client killed (a test's time-out) takes its script and the script's children with it.
    env = dict(os.environ)
    p = subprocess.Popen([CLIENT, sock, sleeper], stdout=subprocess.PIPE, text=True, env=env)
    grandchild = int(p.stdout.readline())
    check(alive(grandchild), "the script's child runs")
    p.kill()
    p.wait()
    wait_while(lambda: alive(grandchild))
    check(not alive(grandchild), "the script's child outlived its killed client")


def check_zygote(binary, tmp):
    """A test binary's zygote: runs are what the binary run directly gives."""
    copy = os.path.join(tmp, "test-binary")
    shutil.copy2(binary, copy)
    sock = os.path.join(tmp, "z.sock")
    through = [CLIENT, sock, copy]

    def both(args, env=None):
        env = dict(os.environ, **(env or {}))
        direct = subprocess.run([copy] + args, capture_output=True, text=True, env=env,
                                timeout=60)
        served = subprocess.run(through + args, capture_output=True, text=True, env=env,
                                timeout=60)
        return direct, served

    subprocess.run([sys.executable, SERVER, "start", sock, copy], check=True, timeout=30)
    for args, env in ((["--gtest_list_tests"], None),
                      (["--gtest_filter=Harness.AbsentRanksAreNotLaunched"], None),
                      ([], {"FSDP_TEST_WORKER": "no_such_worker"})):
        direct, served = both(args, env)
        check(os.path.exists(sock), "the zygote listens")
        lines = lambda r: [l for l in r.stdout.splitlines() if "ms" not in l]  # noqa: E731
        check(served.returncode == direct.returncode and lines(served) == lines(direct) and
              served.stderr == direct.stderr,
              "%s: through the zygote %r, directly %r" % (args or env, served, direct))
    check(direct.returncode == 2, "an unknown worker exits with 2: %r" % direct)
    # A killed client takes its run with it.
    env = dict(os.environ, FSDP_TEST_WORKER="harness_hang")
    p = subprocess.Popen(through, stdout=subprocess.PIPE, text=True, env=env)
    line = p.stdout.readline()  # "rank 0 hangs (pid N)"
    check("hangs (pid " in line, "the hanging run started: %r" % line)
    run = int(line.split("pid ")[1].rstrip(")\n"))
    check(run != p.pid and alive(run), "the run is a process of the zygote's")
    p.kill()
    p.wait()
    wait_while(lambda: alive(run))
    check(not alive(run), "the run outlived its killed client")
    # The binary changed (rebuilt): refused, run directly instead, and the zygote ends.
    os.utime(copy, (time.time() + 10, time.time() + 10))
    direct, served = both(["--gtest_list_tests"])
    check(served.returncode == 0 and served.stdout == direct.stdout, "rebuilt: %r" % served)
    wait_while(lambda: os.path.exists(sock))
    check(not os.path.exists(sock), "a zygote whose binary changed ends")
    print("a test binary's zygote: OK")


def child_cpu(cmd, env):
    """The command's result and the CPU seconds of the process it started (and its children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def check_served_program(trainer_tests, fsdp_train, tmp):
    """fsdp_trainer_tests' zygote serves fsdp-train as fsdp-train runs."""
    copy = os.path.join(tmp, "trainer-tests")
    shutil.copy2(trainer_tests, copy)
    sock = os.path.join(tmp, "t.sock")
    through = [CLIENT, sock, fsdp_train]
    bad = os.path.join(tmp, "bad.toml")
    with open(bad, "w") as f:
        f.write("[training]\nsteps = -1\n")
    subprocess.run([sys.executable, SERVER, "start", sock, copy], check=True, timeout=30)
    wait_while(lambda: not os.path.exists(sock), 30)
    env = dict(os.environ)
    for args in (["--version"], [bad]):
        direct, direct_cpu = child_cpu([fsdp_train] + args, env)
        served, served_cpu = child_cpu(through + args, env)
        check(served.returncode == direct.returncode and served.stdout == direct.stdout and
              served.stderr == direct.stderr,
              "fsdp-train %s: through the zygote %r, directly %r" % (args, served, direct))
        # Served, the client's process starts in a millisecond; directly, a new fsdp-train pays
        # LibTorch's static initialisers.
        check(served_cpu < 0.5 * direct_cpu,
              "fsdp-train %s served: %.3f s of CPU against %.3f s directly" %
              (args, served_cpu, direct_cpu))
    check(direct.returncode == 2 and "steps" in direct.stderr, "a bad config: %r" % direct)
    # A variable read at start that differs: run by fsdp-train itself, with the same result.
    other = dict(env, OMP_NUM_THREADS=str(int(env.get("OMP_NUM_THREADS", "1")) + 1))
    direct, direct_cpu = child_cpu([fsdp_train, "--version"], other)
    refused, refused_cpu = child_cpu(through + ["--version"], other)
    check(refused.returncode == 0 and refused.stdout == direct.stdout, "refused: %r" % refused)
    check(refused_cpu >= 0.5 * direct_cpu,
          "OMP_NUM_THREADS differs, yet served: %.3f s of CPU against %.3f s directly" %
          (refused_cpu, direct_cpu))
    subprocess.run([sys.executable, SERVER, "stop", sock], check=True, timeout=30)
    print("fsdp-train through the trainer tests' zygote: OK")


def main():
    global CLIENT
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    CLIENT = sys.argv.pop(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = os.path.realpath(tmp)
        script = os.path.join(tmp, "script.py")
        sleeper = os.path.join(tmp, "sleeper.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        with open(sleeper, "w") as f:
            f.write(SLEEPER)
        sock = os.path.join(tmp, "s.sock")
        # No server: the client runs the script in a Python of its own.
        cases(sock, tmp, script, sleeper, None)
        print("without a server: OK")
        env = dict(os.environ, FSDP_FORKSERVER_PRELOAD="json")
        subprocess.run([sys.executable, SERVER, "start", sock], check=True, env=env, timeout=30)
        cases(sock, tmp, script, sleeper, "1")
        check(os.path.exists(sock), "the server still listens")
        subprocess.run([sys.executable, SERVER, "stop", sock], check=True, timeout=30)
        wait_while(lambda: os.path.exists(sock))
        check(not os.path.exists(sock), "the server removes its socket when stopped")
        print("through the server: OK")
        if len(sys.argv) > 1:
            check_zygote(sys.argv[1], tmp)
        if len(sys.argv) > 3:
            check_served_program(sys.argv[2], sys.argv[3], tmp)


if __name__ == "__main__":
    main()
