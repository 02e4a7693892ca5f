#!/usr/bin/env bash
# DAPO on MATH with Qwen3-30B-A3B on one node of 8 H200s: configs/dapo_math_qwen3_30b_a3b.yaml, through scripts/launch.sh.
#   MODEL=/path/to/Qwen3-30B-A3B MATH_DIR=/path/to/MATH MATH_TEST=/path/to/MATH-500/test.jsonl bash scripts/recipes/dapo_math_qwen3_30b_a3b.sh [key=value ...]
# The public MATH files are converted once into data/math/ (SKIP_MALFORMED=1 skips and counts bad rows).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/recipes/common.sh
: "${MODEL:?set MODEL to the local Qwen3-30B-A3B directory}"
prepare_math
exec bash scripts/launch.sh --config configs/dapo_math_qwen3_30b_a3b.yaml model.path="$MODEL" "$@"
