#!/usr/bin/env bash
# The driver for a running Ray cluster; `ray job submit` compatible. From the head node, in the checkout:
#   ray job submit --address http://127.0.0.1:8265 --runtime-env megarl/runtime_env.yaml -- \
#       bash scripts/ray_job.sh --config configs/quickstart.yaml trainer.steps=5
# The runtime env gives every worker of the job, on every node, the environment that this script's exports give
# the driver only. It joins the cluster named by RAY_ADDRESS (set by the job server; or HEAD_IP:PORT when run
# directly), else the one `ray start` left on this node, and never starts one (trainer.ray_address=auto).
# Arguments go to megarl.train; a trainer.ray_address=... among them wins.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/env.sh
source scripts/env.sh
megarl_use_venv
megarl_dirs
megarl_nccl_env
megarl_ray_auth
args=("$@")
case " $* " in
  *" trainer.ray_address="*) ;;
  *) args+=("trainer.ray_address=auto") ;;
esac
exec python -m megarl.train "${args[@]}"
