#!/usr/bin/env bash
# Vision-language GRPO on CPU (configs/quickstart_vl.yaml): writes the tiny random Qwen2.5-VL and the shapes prompt
# files under runs/quickstart_vl (offline, once), then trains. Extra arguments are config overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
megarl_venv
out=runs/quickstart_vl
[ -f "$out/model/config.json" ] || python -m megarl.models.tiny_vl "$out/model" --vision-init-std 0.1
[ -f "$out/shapes/val_blank/prompts.jsonl" ] || python -m megarl.data.shapes "$out/shapes"
exec python -m megarl.train --config configs/quickstart_vl.yaml "$@"
