#!/usr/bin/env bash
# Start a Ray head, join a worker to one, or wait until a cluster has all its nodes and GPUs.
#
#   ray_cluster.sh head   [--ip IP|auto] [--port 6379] [node options]
#   ray_cluster.sh worker --address HEAD_IP:PORT [--ip IP|auto (default)] [node options]
#   ray_cluster.sh wait   --address HEAD_IP:PORT --nodes N [--gpus G] [--timeout 300]
#
# node options: --num-cpus N --num-gpus N --resources JSON --temp-dir DIR --block
#
# Binding: a head without --ip is a one-machine cluster: every Ray server listens on 127.0.0.1 only,
# and no worker can join it. A cluster address must be asked for: --ip auto takes this host's address
# (MEGARL_IFNAME's, else the first non-loopback IPv4 one), or name one; workers take --ip auto unless
# told otherwise. Ray's gRPC servers then listen on every interface (Ray 2.60 has no bind option), and
# only clients holding the cluster's token get through. The dashboard (and the job server in it) stays
# on 127.0.0.1 unless MEGARL_DASHBOARD_HOST says otherwise; reach it through an SSH tunnel. Token
# authentication is always on (scripts/env.sh: megarl_ray_auth).
# Stop a node with Ctrl-C or SIGTERM when started with --block (what the Slurm script does), or
# `ray stop`, which stops every Ray node of this user on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/env.sh
source scripts/env.sh
megarl_use_venv

die() { echo "ray_cluster.sh: $*" >&2; exit 2; }

role=${1:-}
[ -n "$role" ] || die "usage: ray_cluster.sh head|worker|wait [options] (see the header of this file)"
shift
ip="" address="" port=${MEGARL_RAY_PORT:-6379} nodes="" gpus=0 timeout=300
node_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --ip) ip=$2; shift 2 ;;
    --address) address=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --nodes) nodes=$2; shift 2 ;;
    --gpus) gpus=$2; shift 2 ;;
    --timeout) timeout=$2; shift 2 ;;
    --num-cpus|--num-gpus|--resources|--temp-dir) node_args+=("$1=$2"); shift 2 ;;
    --block) node_args+=("--block"); shift ;;
    *) die "unknown option $1" ;;
  esac
done

case "$role" in
  head) ;;
  worker) [ -n "$address" ] || die "worker needs --address HEAD_IP:PORT" ;;
  wait) if [ -z "$address" ] || [ -z "$nodes" ]; then die "wait needs --address HEAD_IP:PORT and --nodes N"; fi ;;
  *) die "unknown role '$role': head, worker or wait" ;;
esac

megarl_ray_auth
if [ -z "$ip" ] && [ "$role" = head ]; then
  ip=127.0.0.1
  megarl_ray_loopback
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
    exec ray start --head --node-ip-address="$ip" --port="$port" \
      --dashboard-host="${MEGARL_DASHBOARD_HOST:-127.0.0.1}" --dashboard-port="${MEGARL_DASHBOARD_PORT:-8265}" \
      --disable-usage-stats "${node_args[@]}" ;;
  worker)
    exec ray start --address="$address" --node-ip-address="$ip" --disable-usage-stats "${node_args[@]}" ;;
  wait)
    exec python - "$address" "$nodes" "$gpus" "$timeout" <<'PY'
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
