# shellcheck shell=bash
# Sourced by the scripts: one place for the virtual environment and the run-time environment.

# Create .venv if needed and install megarl into it; `megarl_venv test` adds the test extras.
# torch comes first and pinned (pins.toml [cpu]): a CPU build of that version is on local disk,
# any other version would download gigabytes of CUDA wheels.
megarl_venv() {
  local extra=${1:+[$1]}
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  source .venv/bin/activate
  local torch_pin
  torch_pin=$(python - <<'PY'
import tomllib
print(tomllib.load(open("pins.toml", "rb"))["cpu"]["torch"])
PY
)
  local stamp=".venv/.megarl-installed$extra"
  if [ ! -f "$stamp" ] || [ "$stamp" -ot setup.py ] || [ "$stamp" -ot pins.toml ]; then
    # pip stays quiet (-q): its own lines would bury these; each step says what it installs and the time so far
    local t0=$SECONDS
    echo "[install 1/3] pip into .venv ..."
    python -m pip install -q --upgrade pip
    echo "[install 2/3] torch $torch_pin (CPU build) ... ($((SECONDS - t0)) s so far)"
    python -m pip install -q "torch==$torch_pin"
    echo "[install 3/3] megarl$extra and its dependencies (megatron-core, transformers, ray, ...: minutes on a fresh" \
         "machine) ... ($((SECONDS - t0)) s so far)"
    python -m pip install -q -e ".$extra"
    if [ "$extra" = "[test]" ]; then  # pins.toml [test-no-deps]: packages whose dependencies megarl does not use
      # shellcheck disable=SC2046
      python -m pip install -q --no-deps $(python -c 'from megarl.pins import requirements; print(*requirements("test-no-deps"))')
    fi
    echo "[install] done in $((SECONDS - t0)) s (later runs skip it)"
    touch "$stamp"
  fi
}

# No hub access at run time: models and data come from local paths.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
# Ray: no usage reporting; dashboard and services on loopback.
export RAY_USAGE_STATS_ENABLED=0
export PYTHONUNBUFFERED=1

# ---- Launch environment (scripts/launch.sh, ray_cluster.sh, ray_job.sh, slurm/megarl.sbatch) ----------

# Where logs and checkpoints go; every launcher writes under these.
megarl_dirs() {
  export MEGARL_LOG_DIR=${MEGARL_LOG_DIR:-$PWD/runs/logs}
  export MEGARL_CKPT_DIR=${MEGARL_CKPT_DIR:-$PWD/runs/checkpoints}
  mkdir -p "$MEGARL_LOG_DIR" "$MEGARL_CKPT_DIR"
}

# NCCL and CUDA defaults for multi-GPU runs; anything already set wins. MEGARL_IFNAME names the
# network interface NCCL and gloo should use between nodes (e.g. ib0, eth0).
megarl_nccl_env() {
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  # NVLink SHARP multicast is off: it needs fabric-manager support that many clusters lack.
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
  export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
  # Megatron overlaps TP communication with compute only when kernels run in issue order.
  export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
  if [ -n "${MEGARL_IFNAME:-}" ]; then
    export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$MEGARL_IFNAME}
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$MEGARL_IFNAME}
  fi
}

# Ray's token authentication, on for every cluster the scripts start or join. Every node and every
# client needs the same token: RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token
# (created here, readable by its owner only, when none exists).
megarl_ray_auth() {
  export RAY_AUTH_MODE=token
  [ -n "${RAY_AUTH_TOKEN:-}" ] && return 0
  local token_file=${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}
  if [ ! -s "$token_file" ]; then
    mkdir -p "$(dirname "$token_file")"
    (umask 077 && python3 -c 'import secrets; print(secrets.token_hex(32), end="")' > "$token_file")
  fi
  export RAY_AUTH_TOKEN_PATH=$token_file
}

# A one-machine Ray: every Ray server (GCS, raylets, workers, agents) binds 127.0.0.1 only. Ray reads
# this when it is imported; without it Ray replaces 127.0.0.1 with the host's address and its gRPC
# servers listen on every interface.
megarl_ray_loopback() {
  export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
}

# Put .venv first on PATH when the checkout has one; a container has megarl installed system-wide.
megarl_use_venv() {
  if [ -x .venv/bin/python ]; then export PATH="$PWD/.venv/bin:$PATH"; fi
}

# This node's IPv4 address for other nodes: MEGARL_IFNAME's address, else the first non-loopback one.
megarl_node_ip() {
  local addr
  if [ -n "${MEGARL_IFNAME:-}" ]; then
    addr=$(ip -4 -o addr show dev "$MEGARL_IFNAME" 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')
  else
    addr=$(hostname -I 2>/dev/null | tr ' ' '\n' | grep -m1 -E '^[0-9]+\.')
  fi
  [ -n "$addr" ] || { echo "megarl_node_ip: no IPv4 address${MEGARL_IFNAME:+ on $MEGARL_IFNAME}" >&2; return 1; }
  echo "$addr"
}
