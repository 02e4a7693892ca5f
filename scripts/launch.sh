#!/usr/bin/env bash
# One machine: set up the environment, then run megarl.train with a log file. Arguments go to megarl.train:
#   bash scripts/launch.sh --config configs/quickstart.yaml trainer.steps=5
# Ray starts inside the run, listens on 127.0.0.1 only and uses token authentication. The output also
# goes to $MEGARL_LOG_DIR/megarl-<date>-<pid>.log (default runs/logs). For several machines use
# scripts/ray_cluster.sh and scripts/ray_job.sh, or scripts/slurm/megarl.sbatch.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/env.sh
source scripts/env.sh
megarl_use_venv
megarl_dirs
megarl_nccl_env
megarl_ray_loopback
megarl_ray_auth
log="$MEGARL_LOG_DIR/megarl-$(date +%Y%m%d-%H%M%S)-$$.log"
echo "megarl launch: log $log" >&2
python -m megarl.train "$@" 2>&1 | tee "$log"
