#!/usr/bin/env bash
# Fresh machine -> a trained tiny policy: creates .venv, installs megarl (CPU), runs configs/quickstart.yaml.
# Extra arguments are config overrides, e.g. `bash scripts/quickstart.sh trainer.steps=5`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
megarl_venv
exec python -m megarl.train --config configs/quickstart.yaml "$@"
