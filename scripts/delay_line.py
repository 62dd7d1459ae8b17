#!/usr/bin/env python3
"""A delay line: one emulated host's link with latency, for kernels without tc netem.

    delay_line.py --netns NS --outer LINK [--out-delay MS] [--in-delay MS] [--mtu 1500]
                  [--ready FILE] [--parent PID]

Makes two TAP devices, eth0 inside network namespace NS (the host's interface) and LINK in this
process's own namespace (the host's end of the link, for the bridge), and passes every Ethernet
frame from one to the other: what the host sends (eth0 -> LINK) --out-delay ms after it was
sent, what it receives (LINK -> eth0) --in-delay ms after it arrived. scripts/hosts.sh uses it
for --delay where the kernel has no sch_netem.

Each direction is a FIFO with one constant delay, so frames keep their order. The forwarder
drops nothing itself except frames the kernel refuses: those written to a device that is down
(a cut link: what a cut does anyway) and frames of an impossible length; it counts both and
prints its counts on exit. The devices are not persistent: they go away with this process,
however it ends, so a killed forwarder leaves no device behind. It stays in its own namespace
(it enters NS only to make eth0), so it is not one of NS's processes. It ends on SIGTERM or
SIGINT, and when --parent's process ends (PR_SET_PDEATHSIG).
"""
import argparse
import collections
import ctypes
import errno
import fcntl
import os
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000  # bare Ethernet frames, no 4-byte packet-information header
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
ETH_HLEN = 14
VLAN_HLEN = 4
BATCH = 256  # frames read from one side before looking at the other: keeps both moving
QUEUE_CAP = 256 << 20  # bytes held per direction; far above rate x delay of any link here

libc = ctypes.CDLL(None, use_errno=True)


def check(ret):
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def tap(name):
    """A TAP device named `name` in the calling thread's network namespace, as a non-blocking
    fd; the device lives as long as the fd."""
    if not 0 < len(name.encode()) < 16:
        raise SystemExit(f"delay_line: bad device name {name!r}")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    os.set_blocking(fd, False)
    return fd


def tap_in_netns(netns, name):
    """A TAP device made inside network namespace `netns` (ip netns' /run/netns/<name>); this
    thread returns to its own namespace afterwards. Python 3.11 has no os.setns, hence libc."""
    own = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    target = os.open(os.path.join("/run/netns", netns), os.O_RDONLY | os.O_CLOEXEC)
    try:
        check(libc.setns(target, CLONE_NEWNET))
        try:
            return tap(name)
        finally:
            check(libc.setns(own, CLONE_NEWNET))
    finally:
        os.close(own)
        os.close(target)


class Direction:
    def __init__(self, name, src, dst, delay_s, max_frame):
        self.name, self.src, self.dst, self.delay_s, self.max_frame = name, src, dst, delay_s, max_frame
        self.queue = collections.deque()  # (due time, frame), due times non-decreasing
        self.held = 0
        self.frames = self.bytes = 0
        self.down = self.bad_length = self.refused = self.over_cap = 0

    def read(self):
        """Reads what the source has (up to BATCH frames), each due `delay` from now."""
        for _ in range(BATCH):
            try:
                frame = os.read(self.src, 65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno == errno.EIO:  # nothing readable while the device is down
                    return
                raise
            if not ETH_HLEN <= len(frame) <= self.max_frame:
                self.bad_length += 1
                continue
            if self.held + len(frame) > QUEUE_CAP:
                self.over_cap += 1
                continue
            # Stamped at its own read: a batch's frames keep their spacing.
            self.queue.append((time.monotonic() + self.delay_s, frame))
            self.held += len(frame)

    def flush(self, now):
        """Writes the frames whose time has come, in order. False if the destination would
        block (the frame stays first in line)."""
        q = self.queue
        while q and q[0][0] <= now:
            frame = q[0][1]
            try:
                os.write(self.dst, frame)
                self.frames += 1
                self.bytes += len(frame)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as e:
                if e.errno == errno.EIO:  # the destination is down: the link is cut
                    self.down += 1
                elif e.errno in (errno.EINVAL, errno.EMSGSIZE, errno.ENOMEM, errno.ENOBUFS):
                    self.refused += 1
                else:
                    raise
            q.popleft()
            self.held -= len(frame)
        return True

    def summary(self):
        return (f"{self.name} {self.frames} frames {self.bytes} B (delay {self.delay_s * 1e3:g} ms); "
                f"dropped: {self.down} to a down device, {self.bad_length} of bad length, "
                f"{self.refused} refused, {self.over_cap} over the cap, {len(self.queue)} in flight at exit")


def run(directions):
    poller = select.poll()
    by_fd = {}
    for d in directions:
        poller.register(d.src, select.POLLIN)
        by_fd[d.src] = d
    blocked = False
    while True:
        timeout = None  # nothing queued: sleep until a frame comes
        if blocked:
            timeout = 1
        else:
            due = [d.queue[0][0] for d in directions if d.queue]
            if due:
                timeout = max(0.0, (min(due) - time.monotonic()) * 1e3)
        for fd, ev in poller.poll(timeout):
            if ev & select.POLLNVAL:
                raise SystemExit("delay_line: a device's fd became invalid")
            if ev & select.POLLERR:  # the device was deleted under us (e.g. ip link del)
                raise SystemExit("delay_line: a device went away")
            by_fd[fd].read()
        now = time.monotonic()
        blocked = False
        for d in directions:
            blocked |= not d.flush(now)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--netns", required=True, help="the host's network namespace (ip netns name)")
    ap.add_argument("--inner", default="eth0", help="the device made inside it (eth0)")
    ap.add_argument("--outer", required=True, help="the device made here, for the bridge")
    ap.add_argument("--out-delay", type=float, default=0.0, help="ms added to what the host sends")
    ap.add_argument("--in-delay", type=float, default=0.0, help="ms added to what it receives")
    ap.add_argument("--mtu", type=int, default=1500, help="the devices' MTU; longer frames are bad")
    ap.add_argument("--ready", help="a file written once both devices exist")
    ap.add_argument("--parent", type=int, help="end when this process (the caller) ends")
    args = ap.parse_args()
    if args.out_delay < 0 or args.in_delay < 0 or not 68 <= args.mtu <= 65535:
        ap.error("delays must be >= 0 and the MTU 68..65535")

    stop = lambda signum, _frame: sys.exit(128 + signum)  # noqa: E731 (unwinds to the summary)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if args.parent:
        # The caller's cleanup ends this process; this covers a caller killed with SIGKILL.
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0))
        if os.getppid() != args.parent:  # it ended before the prctl
            sys.exit(1)

    outer = tap(args.outer)
    inner = tap_in_netns(args.netns, args.inner)
    max_frame = args.mtu + ETH_HLEN + VLAN_HLEN
    directions = [Direction("sent", inner, outer, args.out_delay / 1e3, max_frame),
                  Direction("received", outer, inner, args.in_delay / 1e3, max_frame)]
    if args.ready:
        with open(args.ready, "w") as f:
            f.write(f"{os.getpid()}\n")
    try:
        run(directions)
    finally:
        print(f"delay_line {args.outer}: " + "; ".join(d.summary() for d in directions),
              file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
