#!/usr/bin/env bash
# Runs a benchmark with each rank on its own emulated host: one network namespace per rank,
# joined by a bridge, every rank's outgoing traffic shaped to RATE (Linux tbf). On loopback,
# communication costs CPU time on the same cores the ranks compute on, so overlap can only
# trade one for the other; over a link of fixed bandwidth a rank mostly waits for the wire, as
# between real nodes, and overlap can hide that wait.
#
#   sudo bench/emulated_link.sh [--rate 1gbit] [--nproc 2] -- build/bench/bench_prefetch --batch 12
#
# Needs root (ip netns, tc). Everything it creates is removed on exit.
set -euo pipefail
RATE=1gbit
NPROC=2
while (($#)); do
  case "$1" in
    --rate) RATE="$2"; shift 2 ;;
    --nproc) NPROC="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "emulated_link.sh: unknown option $1 (usage: see the header)" >&2; exit 2 ;;
  esac
done
if (($# == 0)); then
  echo "emulated_link.sh: no command after --" >&2
  exit 2
fi
if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  echo "emulated_link.sh: needs ip and tc (Debian: iproute2)" >&2
  exit 2
fi

BR=fsdpbr$$
cleanup() {
  for ((r = 0; r < NPROC; ++r)); do ip netns del "fsdp$$-$r" 2>/dev/null || true; done
  ip link del "$BR" 2>/dev/null || true
}
trap cleanup EXIT
ip link add "$BR" type bridge
ip link set "$BR" up
for ((r = 0; r < NPROC; ++r)); do
  ns="fsdp$$-$r"
  ip netns add "$ns"
  ip link add "h$$r$r" type veth peer name eth0 netns "$ns"
  ip link set "h$$r$r" master "$BR" up
  ip -n "$ns" addr add "10.78.0.$((r + 1))/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  # Shape what this host sends: each host's NIC then carries at most RATE each way.
  ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$RATE" burst 256kb latency 50ms
done

pids=()
for ((r = 0; r < NPROC; ++r)); do
  out=/dev/stdout
  ((r == 0)) || out="/tmp/emulated_link.$$.rank$r.log"
  ip netns exec "fsdp$$-$r" env MASTER_ADDR=10.78.0.1 MASTER_PORT=29600 WORLD_SIZE="$NPROC" \
    RANK="$r" LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 \
    "$@" >"$out" 2>&1 &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=$?; done
((status == 0)) || echo "emulated_link.sh: a rank failed (logs: /tmp/emulated_link.$$.rank*.log)" >&2
exit "$status"
