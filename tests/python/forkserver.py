"""Runs the tests' programs in forks of one loaded copy instead of new processes.

The tests check fsdp-cpp against transformers, peft, safetensors, gguf and TensorBoard by running
the Python scripts beside this file, and CTest runs each GoogleTest test of the two test
binaries as a process of its own. Each such process used to start from nothing: a Python script
imported torch and transformers (2-7 s of CPU before its first line of work), a test binary
loaded LibTorch and ran its static initialisers (0.25 s). A server does that once and forks a
copy of itself per run (as Python's multiprocessing "forkserver" and Android's zygote do): the
copy becomes the run, with the client's arguments, working directory, environment, stdin, stdout
and stderr (passed as file descriptors), and the client exits with the run's status. This file
is the Python server; tests/harness/zygote.h is a test binary's; the client of both is
tests/harness/forkserver_client.cpp (it starts in a millisecond, where a Python client took 20 ms
of CPU).

    forkserver.py start SOCKET [BINARY]  start a server in the background (CTest's fixture):
                                         this Python, or BINARY serving itself
    forkserver.py stop SOCKET            stop it
    fsdp_forkserver_client SOCKET PROGRAM ...
                                         run PROGRAM (a .py script, the binary, or a program
                                         the binary also serves: zygote.h's serve_also) with its
                                         arguments: through the server when one answers on
                                         SOCKET and accepts, else as a new process (the same
                                         result, slower)

The servers never start a thread (a fork copies only the forking thread), end when the process
that started them (CTest) is gone or after an hour idle, and a run dies with its client.
"""

import json
import os
import select
import signal
import socket
import struct
import sys
import time

# What the scripts import (FSDP_FORKSERVER_PRELOAD, comma-separated, overrides it).
# The distributed modules of the PyTorch references (FSDP2, DTensor and its tensor parallelism:
# check_tp.py, bench/torch_gpt.py) cost each of their ranks 1.2 s of CPU to import after torch.
PRELOAD = ["numpy", "torch", "torch.distributed.run", "torch.distributed.device_mesh",
           "torch.distributed.fsdp", "torch.distributed.tensor.parallel", "safetensors.torch",
           "tokenizers", "transformers", "gguf", "peft",
           "tensorboard.backend.event_processing.event_accumulator"]
IDLE_LIMIT_S = 3600
MAX_REQUEST_BYTES = 1 << 20


def log_cpu(argv, started):
    """FSDP_TEST_CPU_LOG=FILE: a script's CPU seconds (its own and its waited-for children's),
    wall seconds and arguments, appended tab-separated as tests/harness/zygote.cpp logs a run."""
    path = os.environ.get("FSDP_TEST_CPU_LOG")
    if not path:
        return
    import resource
    cpu = sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                               resource.getrusage(resource.RUSAGE_CHILDREN)))
    line = "%f\t%f\t%s\n" % (cpu, time.monotonic() - started, "\t".join([sys.executable] + argv))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(fd, line.encode())  # one write: the runs append at once
        os.close(fd)
    except OSError:
        pass


def run_script(conn, fds, request):
    """In the forked copy: becomes the client's Python process for one script."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ["FSDP_FORKSERVED"] = "1"  # for tests/python/check_forkserver.py
    argv = request["argv"]
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    # A client that dies (killed by a test's time-out) takes its script, and anything the script
    # started, with it.
    watcher = os.fork()
    if watcher == 0:
        select.select([conn], [], [])
        if not conn.recv(1):
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os._exit(0)
    code = 0
    started = time.monotonic()
    try:
        import runpy
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    log_cpu(argv, started)
    os.kill(watcher, signal.SIGKILL)
    conn.sendall(str(code).encode())
    conn.close()
    os._exit(code)


def receive(conn):
    """The client's request and its stdin, stdout and stderr."""
    data = b""
    fds = []
    need = 8
    while len(data) < need:
        chunk, got, _, _ = socket.recv_fds(conn, 65536, 3)
        fds += got
        if not chunk:
            break
        data += chunk
        if len(data) >= 8:
            need = 8 + struct.unpack("<Q", data[:8])[0]
            if need > MAX_REQUEST_BYTES:
                raise ValueError("request over %d bytes" % MAX_REQUEST_BYTES)
    if len(fds) != 3 or len(data) != need:
        for fd in fds:
            os.close(fd)
        raise ValueError("a truncated request")
    return fds, json.loads(data[8:])


def serve(sock_path, owner):
    with open(sock_path + ".starting", "w") as f:
        f.write(str(os.getpid()))
    preload = os.environ.get("FSDP_FORKSERVER_PRELOAD")
    for name in PRELOAD if preload is None else [m for m in preload.split(",") if m]:
        try:
            __import__(name)
        except Exception:  # a package this machine lacks: its scripts import it themselves
            pass
    if "transformers" in sys.modules:
        try:  # transformers loads its classes when first named
            from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
        except Exception:
            pass
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # copies are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = sock_path + ".%d" % os.getpid()
    listener.bind(tmp)
    listener.listen(64)
    os.rename(tmp, sock_path)  # clients see a socket only once it listens
    os.unlink(sock_path + ".starting")
    last = time.monotonic()
    while True:
        ready, _, _ = select.select([listener], [], [], 1.0)
        if not ready:
            try:
                os.kill(owner, 0)
            except ProcessLookupError:
                break
            if not os.path.exists(sock_path) or time.monotonic() - last > IDLE_LIMIT_S:
                break
            continue
        conn, _ = listener.accept()
        last = time.monotonic()
        try:
            fds, request = receive(conn)
        except (OSError, ValueError):
            conn.close()
            continue
        if request.get("stop"):
            for fd in fds:
                os.close(fd)
            conn.close()
            break
        argv = request.get("argv") or [""]
        if not argv[0].endswith(".py"):
            conn.sendall(b"refused")
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        if os.fork() == 0:
            listener.close()
            run_script(conn, fds, request)
        for fd in fds:
            os.close(fd)
        conn.close()
    listener.close()
    try:
        os.unlink(sock_path)
    except FileNotFoundError:
        pass


def start(sock_path, binary=None):
    """Starts a server for the process that runs this one (CTest) and returns at once: clients
    wait for it while it loads (sock_path.starting exists, then holds its pid, until it
    listens)."""
    owner = os.getppid()
    for path in (sock_path, sock_path + ".starting"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    open(sock_path + ".starting", "w").close()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            try:
                if binary:
                    env = dict(os.environ, FSDP_TEST_ZYGOTE=sock_path,
                               FSDP_TEST_ZYGOTE_OWNER=str(owner))
                    os.execve(binary, [binary], env)
                serve(sock_path, owner)
            finally:
                try:
                    os.unlink(sock_path + ".starting")
                except FileNotFoundError:
                    pass
            os._exit(0)
        os._exit(0)
    print("forkserver.py: starting %s on %s for process %d" %
          (binary or "Python", sock_path, owner))


def stop(sock_path):
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(sock_path)
        request = json.dumps({"stop": True}).encode()
        socket.send_fds(conn, [struct.pack("<Q", len(request)) + request], [0, 1, 2])
        conn.close()
    except OSError:
        pass
    print("forkserver.py: stopped")


def main():
    if len(sys.argv) in (3, 4) and sys.argv[1] == "start":
        start(*sys.argv[2:])
    elif len(sys.argv) == 3 and sys.argv[1] == "stop":
        stop(sys.argv[2])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
