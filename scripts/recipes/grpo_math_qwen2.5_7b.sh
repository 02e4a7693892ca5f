#!/usr/bin/env bash
# GRPO on MATH with Qwen2.5-7B on one node of 8 GPUs: configs/grpo_math_qwen2.5_7b.yaml, through scripts/launch.sh.
#   MODEL=/path/to/Qwen2.5-7B MATH_DIR=/path/to/MATH MATH_TEST=/path/to/MATH-500/test.jsonl bash scripts/recipes/grpo_math_qwen2.5_7b.sh [key=value ...]
# The public MATH files are converted once into data/math/ (SKIP_MALFORMED=1 skips and counts bad rows).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/recipes/common.sh
: "${MODEL:?set MODEL to the local Qwen2.5-7B directory}"
prepare_math
exec bash scripts/launch.sh --config configs/grpo_math_qwen2.5_7b.yaml model.path="$MODEL" "$@"
