#!/usr/bin/env bash
# PPO on GSM8K with Qwen2.5-0.5B-Instruct on one node of 8 GPUs: configs/ppo_gsm8k_qwen2.5_0.5b.yaml, through scripts/launch.sh.
#   MODEL=/path/to/Qwen2.5-0.5B-Instruct GSM8K_DIR=/path/to/gsm8k bash scripts/recipes/ppo_gsm8k_qwen2.5_0.5b.sh [key=value ...]
# The public GSM8K files are converted once into data/gsm8k/ (or $GSM8K_PROMPTS; SKIP_MALFORMED=1 skips and counts
# bad rows).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/recipes/common.sh
: "${MODEL:?set MODEL to the local Qwen2.5-0.5B-Instruct directory}"
PROMPTS=${GSM8K_PROMPTS:-data/gsm8k}  # the converted files (another folder keeps other data apart)
prepare_prompts gsm8k "${GSM8K_TRAIN:-${GSM8K_DIR:?set GSM8K_DIR to the folder of GSM8K train.jsonl and test.jsonl}/train.jsonl}" \
  "${GSM8K_TEST:-$GSM8K_DIR/test.jsonl}" "$PROMPTS"
exec bash scripts/launch.sh --config configs/ppo_gsm8k_qwen2.5_0.5b.yaml model.path="$MODEL" \
  data.task="$PROMPTS/train.jsonl" data.val_task="$PROMPTS/test.jsonl" "$@"
