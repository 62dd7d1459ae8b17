#!/usr/bin/env bash
# A multi-node job on one machine: N emulated hosts, each a network namespace with its own
# address and host name, joined by a bridge (the "network"), each link optionally shaped; one
# torchrun agent per host with multi-node rendezvous (--nnodes, --rdzv-backend c10d,
# --rdzv-endpoint on host 0), each starting its local ranks of the command. The way to try a
# multi-node fsdp-train job, its faults and its traffic on a laptop (docs/multi-node.md).
#
#   sudo scripts/hosts.sh [options] -- build/trainer/fsdp-train configs/demo.toml [--key=value ...]
#
#   --hosts N            emulated hosts (2)
#   --nproc-per-host N   ranks per host (2)
#   --rate R             each host's link rate, both ways (tc tbf: 1gbit, 100mbit; none)
#   --loss P             drop P percent of each host's outgoing packets (nftables numgen)
#   --delay D            add D (20ms; units us, ms, s) to each host's outgoing packets: a
#                        packet between two hosts takes D longer, a round trip 2 x D. With tc
#                        netem where the kernel has sch_netem, else with a delay line in user
#                        space (scripts/delay_line.py: a forwarder per host between two TAP
#                        devices that replace the veth pair; needs /dev/net/tun and python3)
#   --nnodes SPEC        torchrun's --nnodes (N, or MIN:MAX for an elastic job)
#   --max-restarts K     torchrun's --max-restarts (0)
#   --store-timeout S    how long torchrun's agents wait on each call to the rendezvous store
#                        (its c10d read_timeout; 10). An agent cut off from host 0 retries its
#                        reads without end; its ranks tell it to end once they fail cut off,
#                        and it does within about twice this
#   --last-call S        elastic jobs: once --nnodes' minimum has joined a rendezvous, how long
#                        it waits for more hosts before starting without them (torchrun's
#                        last_call_timeout; 30)
#   --logs DIR           where host<h>.log goes (a new directory under /tmp)
#   --python P           the Python whose torchrun to use (the pinned torch's venv)
#   --launcher L         torchrun (the default), or fsdp-train: each host runs the command's own
#                        launcher instead (fsdp-train --nproc N --nnodes H --node-rank h
#                        --master-addr 10.79.0.1 --master-port 29400; host 0's serves the store),
#                        which a fault-tolerant job (fsdp.fault_tolerant) needs: it restarts a
#                        failed replica alone, and host<h>.sh brings a lost host back into the
#                        running job
#
# Host h is 10.79.0.(h+1) on its eth0 in namespace fsdp<pid>-h<h>, host name host<h>; the
# rendezvous endpoint is host 0's address, port 29400. While it runs, the names of the
# namespaces and of the host-side ends of the links (to cut one: ip link set <link> down) are in
# <logs>/hosts.env, and <logs>/host<h>.sh starts host h's agent again (after the host was
# "lost": every process in its namespace killed), to rejoin an elastic job; the script waits for
# such agents too. <logs>/agents.exit gets each first agent's exit code. At the end it prints each link's byte counters: what crossed between hosts.
# Everything it creates (namespaces, links, bridge, /etc/netns entries, processes, delay lines) is removed on exit, also on
# Ctrl-C or SIGTERM. Needs root (ip netns, tc) and iproute2; --loss needs nftables.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOSTS=2
NPROC=2
RATE=none
LOSS=0
DELAY=
NNODES=
MAX_RESTARTS=0
LAUNCHER=torchrun
STORE_TIMEOUT=10
LAST_CALL=30
LOGS=
PY="${FSDP_CACHE:-$HOME/.cache/fsdp-cpp}/torch-$(tr -d '[:space:]' < "$ROOT/.torch-version")/bin/python"
die() { echo "hosts.sh: $*" >&2; exit 2; }
while (($#)); do
  case "$1" in
    --hosts) HOSTS="$2"; shift 2 ;;
    --nproc-per-host) NPROC="$2"; shift 2 ;;
    --rate) RATE="$2"; shift 2 ;;
    --loss) LOSS="$2"; shift 2 ;;
    --delay) DELAY="$2"; shift 2 ;;
    --nnodes) NNODES="$2"; shift 2 ;;
    --max-restarts) MAX_RESTARTS="$2"; shift 2 ;;
    --store-timeout) STORE_TIMEOUT="$2"; shift 2 ;;
    --last-call) LAST_CALL="$2"; shift 2 ;;
    --logs) LOGS="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --launcher) LAUNCHER="$2"; shift 2 ;;
    --) shift; break ;;
    *) die "unknown option $1 (usage: see the header of $0)" ;;
  esac
done
(($# > 0)) || die "no command after --"
[[ "$HOSTS" =~ ^[1-9][0-9]?$ ]] || die "--hosts must be 1..99, got '$HOSTS'"
[[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || die "--nproc-per-host must be a positive integer, got '$NPROC'"
[[ "$LOSS" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "--loss must be a percentage, got '$LOSS'"
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || die "--max-restarts must be >= 0, got '$MAX_RESTARTS'"
[[ "$STORE_TIMEOUT" =~ ^[1-9][0-9]*$ ]] || die "--store-timeout must be seconds > 0, got '$STORE_TIMEOUT'"
[[ "$LAST_CALL" =~ ^[0-9]+$ ]] || die "--last-call must be seconds >= 0, got '$LAST_CALL'"
((EUID == 0)) || die "needs root (network namespaces)"
command -v ip >/dev/null && command -v tc >/dev/null || die "needs ip and tc (Debian: iproute2)"
[[ -x "$PY" ]] || die "no Python at $PY (run scripts/setup.sh, or pass --python)"
[[ "$LAUNCHER" == torchrun || "$LAUNCHER" == fsdp-train ]] ||
  die "--launcher must be torchrun or fsdp-train, got '$LAUNCHER'"
TORCHRUN="$(dirname "$PY")/torchrun"
[[ -x "$TORCHRUN" ]] || die "no torchrun next to $PY"
if [[ "$LOSS" != 0 ]]; then command -v nft >/dev/null || die "--loss needs nft (Debian: nftables)"; fi
DELAY_VIA=
if [[ -n "$DELAY" ]]; then
  [[ "$DELAY" =~ ^([0-9]+(\.[0-9]+)?)(us|ms|s)$ ]] || die "--delay must be a time such as 20ms, got '$DELAY'"
  DELAY_MS=$(awk -v v="${BASH_REMATCH[1]}" -v u="${BASH_REMATCH[3]}" \
    'BEGIN { printf "%.6f", v * (u == "s" ? 1000 : u == "ms" ? 1 : 0.001) }')
  if [[ -d /sys/module/sch_netem ]] || grep -qs 'CONFIG_NET_SCH_NETEM=[ym]' <(zcat /proc/config.gz 2>/dev/null); then
    DELAY_VIA=netem
  else
    # No netem ("Specified qdisc kind is unknown"): frames pass through a process of ours that
    # holds them back instead.
    DELAY_VIA="delay line"
    [[ -c /dev/net/tun ]] || die "--delay needs the kernel's sch_netem or /dev/net/tun; this machine has neither"
    FWD_PY="$(command -v python3 || echo "$PY")"
  fi
fi
NNODES="${NNODES:-$HOSTS}"
LOGS="${LOGS:-$(mktemp -d /tmp/hosts.XXXXXX)}"
mkdir -p "$LOGS"
CMD=("$@")
[[ "${CMD[0]}" == */* ]] && CMD[0]="$(cd "$(dirname "${CMD[0]}")" && pwd)/$(basename "${CMD[0]}")"

ID=$$
BR="fsdpbr$ID"
ns() { echo "fsdp$ID-h$1"; }
link() { echo "fh$ID-$1"; }
pids=()
delay_pids=()
# Whether process $1 runs. A child that has exited stays a zombie until waited for, and kill -0
# succeeds on a zombie: hence its state in /proc.
alive() {
  local st
  st="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  st="${st##*) }"
  [[ "${st%% *}" != Z ]]
}
# Ends the delay lines (their TAP devices go with them); one that does not end on SIGTERM
# within 2 s is killed.
stop_delay_lines() {
  local p i
  for p in "${delay_pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${delay_pids[@]}"; do
    for ((i = 0; i < 20; ++i)); do alive "$p" || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  delay_pids=()
}
cleanup() {
  trap - EXIT INT TERM
  for ((h = 0; h < HOSTS; ++h)); do
    # Every process in the namespace (agents and ranks), then the namespace: deleting a
    # namespace does not end what runs in it.
    for p in $(ip netns pids "$(ns "$h")" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
  done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  stop_delay_lines
  for ((h = 0; h < HOSTS; ++h)); do
    ip netns del "$(ns "$h")" 2>/dev/null || true
    rm -rf "/etc/netns/$(ns "$h")"
    ip link del "$(link "$h")" 2>/dev/null || true
  done
  ip link del "$BR" 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

ip link add "$BR" type bridge
ip link set "$BR" up
: > "$LOGS/hosts.env"
: > "$LOGS/agents.exit"
for ((h = 0; h < HOSTS; ++h)); do
  n="$(ns "$h")"
  ip netns add "$n"
  # Every host resolves every host name: `ip netns exec` mounts /etc/netns/<ns>/hosts over
  # /etc/hosts (torchrun checks that the rendezvous endpoint is this machine by resolving its
  # own host name).
  mkdir -p "/etc/netns/$n"
  { echo "127.0.0.1 localhost"; for ((g = 0; g < HOSTS; ++g)); do echo "10.79.0.$((g + 1)) host$g"; done; } \
    > "/etc/netns/$n/hosts"
  if [[ "$DELAY_VIA" == "delay line" ]]; then
    # The link is two TAP devices, eth0 in the namespace and $(link h) on the bridge, with a
    # forwarder between them that holds what the host sends back for D; what it receives passes
    # at once (one delay per hop between two hosts, as netem on eth0 gives). The forwarder
    # runs in this namespace, so that it is none of the host's processes (which are waited for
    # and killed); its devices go when it ends.
    "$FWD_PY" "$ROOT/scripts/delay_line.py" --netns "$n" --outer "$(link "$h")" \
      --out-delay "$DELAY_MS" --mtu 1500 --ready "$LOGS/delay$h.ready" --parent $$ \
      2> "$LOGS/delay$h.log" &
    delay_pids+=($!)
    for ((i = 0; i < 100; ++i)); do
      [[ -s "$LOGS/delay$h.ready" ]] && break
      alive "$!" || break
      sleep 0.1
    done
    [[ -s "$LOGS/delay$h.ready" ]] || die "host$h's delay line did not start: $(cat "$LOGS/delay$h.log")"
    rm -f "$LOGS/delay$h.ready"
    # A TAP device drops what its reader has not taken once its queue is full (500 frames by
    # default); a longer one absorbs a burst while the forwarder is descheduled.
    ip link set "$(link "$h")" mtu 1500 txqueuelen 10000
    ip -n "$n" link set eth0 mtu 1500 txqueuelen 10000
  else
    ip link add "$(link "$h")" type veth peer name eth0 netns "$n"
  fi
  ip link set "$(link "$h")" master "$BR" up
  ip -n "$n" addr add "10.79.0.$((h + 1))/24" dev eth0
  ip -n "$n" link set eth0 up
  ip -n "$n" link set lo up
  # eth0's root qdisc: netem (with tbf below it, netem's own recipe for delay and rate) or tbf.
  if [[ "$DELAY_VIA" == netem ]]; then
    ip netns exec "$n" tc qdisc add dev eth0 root handle 1: netem delay "$DELAY"
  fi
  if [[ "$RATE" != none ]]; then
    # Both directions of the host's link: what it sends (its eth0) and what it receives (the
    # bridge's end of its link sends that).
    if [[ "$DELAY_VIA" == netem ]]; then
      ip netns exec "$n" tc qdisc add dev eth0 parent 1:1 handle 10: tbf rate "$RATE" burst 256kb latency 50ms
    else
      ip netns exec "$n" tc qdisc add dev eth0 root tbf rate "$RATE" burst 256kb latency 50ms
    fi
    tc qdisc add dev "$(link "$h")" root tbf rate "$RATE" burst 256kb latency 50ms
  fi
  if [[ "$LOSS" != 0 ]]; then
    per_mille=$(awk -v p="$LOSS" 'BEGIN { printf "%d", p * 10 + 0.5 }')
    ip netns exec "$n" nft -f - <<EOF
table inet fsdp_loss {
  chain out {
    type filter hook output priority 0;
    oifname "eth0" numgen random mod 1000 < $per_mille drop
  }
}
EOF
  fi
  echo "HOST$h=$n LINK$h=$(link "$h") ADDR$h=10.79.0.$((h + 1))" >> "$LOGS/hosts.env"
done
echo "hosts.sh: $HOSTS host(s) x $NPROC rank(s), link rate $RATE, loss $LOSS%${DELAY:+, delay $DELAY ($DELAY_VIA)}; logs in $LOGS"

# An elastic job (--nnodes MIN:MAX): the ranks get a store of their own (rank 0's) instead of
# sharing the agents' rendezvous store. With the shared store, torch 2.15's rank-0 agent
# publishes the store's address only in its first rendezvous round, so a host that joins a
# later round waits for it until its timeout (measured: the grown job failed after 30 s; the
# same class as pytorch/pytorch#135712).
SHARE_STORE=()
[[ "$NNODES" == *:* ]] && SHARE_STORE=(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
for ((h = 0; h < HOSTS; ++h)); do
  # Host h's agent, as a script of its own so that a lost host can be started again. Its own
  # host name (a UTS namespace), so that errors and reports name the host.
  {
    echo "#!/bin/sh"
    echo "# Starts host$h's torchrun agent (made by scripts/hosts.sh, pid $ID); appends to host$h.log."
    printf 'exec ip netns exec %q unshare --uts -- sh -c %q %q' "$(ns "$h")" 'hostname "$0"; exec "$@"' "host$h"
    if [[ "$LAUNCHER" == fsdp-train ]]; then
      printf ' %q' env OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0 "${CMD[@]}" --nproc "$NPROC" \
        --nnodes "$HOSTS" --node-rank "$h" --master-addr 10.79.0.1 --master-port 29400
    else
      printf ' %q' env OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0 "${SHARE_STORE[@]}" \
        "$TORCHRUN" --nnodes="$NNODES" --nproc-per-node="$NPROC" --rdzv-backend=c10d \
        --rdzv-endpoint=10.79.0.1:29400 --rdzv-id="fsdp$ID" --max-restarts="$MAX_RESTARTS" \
        --rdzv-conf="read_timeout=$STORE_TIMEOUT,last_call_timeout=$LAST_CALL" \
        --local-addr="10.79.0.$((h + 1))" --no-python -- "${CMD[@]}"
    fi
    printf ' >> %q 2>&1\n' "$LOGS/host$h.log"
  } > "$LOGS/host$h.sh"
  chmod +x "$LOGS/host$h.sh"
  : > "$LOGS/host$h.log"
  "$LOGS/host$h.sh" &
  pids+=($!)
done
status=0
for ((h = 0; h < HOSTS; ++h)); do
  code=0
  wait "${pids[$h]}" || code=$?
  echo "host$h=$code" >> "$LOGS/agents.exit"  # each agent's exit, for scripts
  ((code == 0)) || status=$code
done
# Agents started again by host<h>.sh (an elastic job's returning host) end with the job.
for ((h = 0; h < HOSTS; ++h)); do
  while [[ -n "$(ip netns pids "$(ns "$h")" 2>/dev/null)" ]]; do sleep 0.2; done
done
for ((h = 0; h < HOSTS; ++h)); do
  s=/sys/class/net/$(link "$h")/statistics
  # The host-side end of the link: its rx is what the host sent, its tx what it received.
  echo "hosts.sh: host$h sent $(cat "$s/rx_bytes") B in $(cat "$s/rx_packets") packets," \
    "received $(cat "$s/tx_bytes") B in $(cat "$s/tx_packets") packets over its link"
done
if ((${#delay_pids[@]})); then
  # What the delay lines passed and dropped, and what their TAP devices dropped because the
  # forwarder was late (both 0 unless a link was cut: then frames to the down device).
  for ((h = 0; h < HOSTS; ++h)); do
    tapdrops[h]=$(($(cat "/sys/class/net/$(link "$h")/statistics/tx_dropped" 2>/dev/null || echo 0) +
      $(ip netns exec "$(ns "$h")" cat /sys/class/net/eth0/statistics/tx_dropped 2>/dev/null || echo 0)))
  done
  stop_delay_lines
  for ((h = 0; h < HOSTS; ++h)); do
    echo "hosts.sh: host$h's $(tail -n 1 "$LOGS/delay$h.log"); its TAP devices dropped ${tapdrops[h]}"
  done
fi
((status == 0)) || echo "hosts.sh: a host's agent failed (exit $status); logs: $LOGS/host*.log" >&2
exit "$status"
