"""tests/python/forkserver.py: a script run through the server sees what it would see in a Python
of its own (arguments, working directory, environment, stdin, stdout and stderr apart) and its
client exits with its status; a killed client takes the script and its children with it; without
a server the client runs the script itself, with the same results. Exits non-zero on a mismatch.
"""
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SERVER = os.path.join(HERE, "forkserver.py")

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


def client(sock, script, *args, stdin="", cwd=None):
    env = dict(os.environ, FORKSERVER_CHECK="seen")
    return subprocess.run([sys.executable, "-S", SERVER, sock, script, *args], input=stdin,
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=60)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose.
    with open("/proc/%d/stat" % pid) as f:
        return f.read().split(")")[-1].split()[0] != "Z"


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
    if not served:
        return  # a Python of its own: a killed one leaves its children, as any Python does
    # A client killed (a test's time-out) takes its script and the script's children with it.
    env = dict(os.environ)
    p = subprocess.Popen([sys.executable, "-S", SERVER, sock, sleeper], stdout=subprocess.PIPE,
                         text=True, env=env)
    grandchild = int(p.stdout.readline())
    check(alive(grandchild), "the script's child runs")
    p.kill()
    p.wait()
    deadline = time.monotonic() + 10
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    check(not alive(grandchild), "the script's child outlived its killed client")


def main():
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
        deadline = time.monotonic() + 10
        while os.path.exists(sock) and time.monotonic() < deadline:
            time.sleep(0.05)
        check(not os.path.exists(sock), "the server removes its socket when stopped")
        print("through the server: OK")


if __name__ == "__main__":
    main()
