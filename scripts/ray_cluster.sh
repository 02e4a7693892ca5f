#!/usr/bin/env bash
# Start a Ray head, join a worker to one, or wait until a cluster has all its nodes and GPUs.
#
#   ray_cluster.sh head   [--ip IP|auto] [--port 6379] [head options] [node options]
#   ray_cluster.sh worker --address HEAD_IP:PORT [--ip IP|auto (default)] [node options]
#   ray_cluster.sh wait   --address HEAD_IP:PORT --nodes N [--gpus G] [--timeout 300]
#
# node options: --num-cpus N --num-gpus N --resources JSON --temp-dir DIR --block
# head options: --dashboard-host HOST (default MEGARL_DASHBOARD_HOST, else 127.0.0.1)
#               --dashboard-port PORT (default MEGARL_DASHBOARD_PORT, else 8265)
# Ray's own spellings work too, as `ray start` takes them: --head for `head`, --address alone for `worker`,
# --node-ip-address for --ip, and --opt=value for --opt value, e.g.
#   ray_cluster.sh --head --node-ip-address=10.0.0.1 --port=6379 --dashboard-host=0.0.0.0 --block
#   ray_cluster.sh --address=10.0.0.1:6379 --num-gpus=8
# --dry-run prints the command instead of running it.
#
# Binding: a head without --ip is a one-machine cluster: every Ray server listens on 127.0.0.1 only,
# and no worker can join it. A cluster address must be asked for: --ip auto takes this host's address
# (MEGARL_IFNAME's, else the first non-loopback IPv4 one), or name one; workers take --ip auto unless
# told otherwise. Ray's gRPC servers then listen on every interface (Ray 2.60 has no bind option), and
# only clients holding the cluster's token get through. The dashboard (and the job server in it) stays
# on 127.0.0.1 unless --dashboard-host or MEGARL_DASHBOARD_HOST says otherwise; reach it through an SSH
# tunnel. Token authentication is always on (scripts/env.sh: megarl_ray_auth).
# Stop a node with Ctrl-C or SIGTERM when started with --block (what the Slurm script does), or
# `ray stop`, which stops every Ray node of this user on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/env.sh
source scripts/env.sh
megarl_use_venv

die() { echo "ray_cluster.sh: $*" >&2; exit 2; }

usage="usage: ray_cluster.sh head|worker|wait [options], or Ray's spellings (see the header of this file)"
[ $# -gt 0 ] || die "$usage"
role=""
case "$1" in
  head|worker|wait) role=$1; shift ;;
  --*) ;;
  *) die "unknown role '$1': head, worker or wait" ;;
esac
# --opt=value as Ray writes it: split, so that one loop reads both spellings
args=()
for arg in "$@"; do
  case "$arg" in
    --*=*) args+=("${arg%%=*}" "${arg#*=}") ;;
    *) args+=("$arg") ;;
  esac
done
set -- ${args[@]+"${args[@]}"}
ip="" address="" port=${MEGARL_RAY_PORT:-6379} nodes="" gpus=0 timeout=300 dry_run=""
dashboard_host="" dashboard_port=""
node_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --head) [ "${role:-head}" = head ] || die "--head with role '$role'"; role="head"; shift; continue ;;
    --block) node_args+=("--block"); shift; continue ;;
    --dry-run) dry_run=1; shift; continue ;;
  esac
  [ $# -ge 2 ] || die "$1 needs a value"
  case "$1" in
    --ip|--node-ip-address) ip=$2 ;;
    --address) address=$2 ;;
    --port) port=$2 ;;
    --dashboard-host) dashboard_host=$2 ;;
    --dashboard-port) dashboard_port=$2 ;;
    --nodes) nodes=$2 ;;
    --gpus) gpus=$2 ;;
    --timeout) timeout=$2 ;;
    --num-cpus|--num-gpus|--resources|--temp-dir) node_args+=("$1=$2") ;;
    *) die "unknown option $1" ;;
  esac
  shift 2
done
if [ -z "$role" ]; then
  [ -n "$address" ] || die "$usage"
  role=worker  # `ray start --address=HEAD:PORT`
fi

case "$role" in
  head) [ -z "$address" ] || die "head takes no --address (a worker does: --address HEAD_IP:PORT)" ;;
  worker) [ -n "$address" ] || die "worker needs --address HEAD_IP:PORT" ;;
  wait) if [ -z "$address" ] || [ -z "$nodes" ]; then die "wait needs --address HEAD_IP:PORT and --nodes N"; fi ;;
esac
if [ "$role" != head ] && [ -n "$dashboard_host$dashboard_port" ]; then
  die "--dashboard-host and --dashboard-port are the head's"
fi

# --dry-run: the command, not run (nor the token made)
start() {
  if [ -n "$dry_run" ]; then echo "$*"; exit 0; fi
  exec "$@"
}

[ -n "$dry_run" ] || megarl_ray_auth
if [ -z "$ip" ] && [ "$role" = head ]; then
  ip=127.0.0.1
  megarl_ray_loopback
  echo "ray_cluster.sh: a one-machine cluster on 127.0.0.1: no worker can join it (--ip auto, or" \
    "--node-ip-address IP, gives it a cluster address)" >&2
elif [ "$role" != wait ] && { [ -z "$ip" ] || [ "$ip" = auto ]; }; then
  ip=$(megarl_node_ip)
fi

# Each node's dashboard agent gets a port of its own: several nodes on one host (tests, shared
# machines) would otherwise race for Ray's fixed default, and the loser serves no jobs.
if [ "$role" != wait ]; then
  agent_port=${MEGARL_AGENT_PORT:-$(python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')}
  node_args+=("--dashboard-agent-listen-port=$agent_port")
fi

case "$role" in
  head)
    start ray start --head --node-ip-address="$ip" --port="$port" \
      --dashboard-host="${dashboard_host:-${MEGARL_DASHBOARD_HOST:-127.0.0.1}}" \
      --dashboard-port="${dashboard_port:-${MEGARL_DASHBOARD_PORT:-8265}}" --disable-usage-stats "${node_args[@]}" ;;
  worker)
    start ray start --address="$address" --node-ip-address="$ip" --disable-usage-stats "${node_args[@]}" ;;
  wait)
    start python - "$address" "$nodes" "$gpus" "$timeout" <<'PY'
import sys, time
import ray

address, nodes, gpus, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
ray.init(address=address, log_to_driver=False, logging_level="ERROR")
deadline = time.monotonic() + timeout
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    have_gpus = sum(n["Resources"].get("GPU", 0) for n in alive)
    if len(alive) >= nodes and have_gpus >= gpus:
        print(f"ray cluster at {address}: {len(alive)} nodes, {have_gpus:g} GPUs", flush=True)
        break
    if time.monotonic() > deadline:
        sys.exit(f"ray cluster at {address}: {len(alive)}/{nodes} nodes and {have_gpus:g}/{gpus:g} GPUs "
                 f"after {timeout:g} s")
    time.sleep(1)
PY
    ;;
esac
