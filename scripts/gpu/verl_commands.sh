#!/usr/bin/env bash
# verl's command lines on one GPU (after the bundle's install.sh, ../shared/device/README.md): python -m megarl.train
# run with verl's keys only, as verl's GRPO and PPO GSM8K examples write them (sizes cut to a few minutes):
#   grpo - algorithm.adv_estimator=grpo, KL as a loss term, rollout.name=vllm (served by SGLang), rollout.n=4,
#          top_k=20, a tokenizer with no pad token (EOS pads), SGLang colocated with the memory cycle
#   ppo  - verl's quickstart defaults: GAE with a critic, one sample per prompt, rollout.name=sglang
# Each on a random ~60M Qwen2 shape with the character tokenizer and a chat template, prompts in verl's GSM8K parquet
# layout, written as jsonl (data_source openai/gsm8k: the reward follows it). Fails unless each run ends, says `profile: verl` first,
# trains every step and verifies its weight syncs. Logs go to $OUT; a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/megarl-verl}; mkdir -p "$OUT"
WORK=/tmp/megarl-verl-$$
mkdir -p "$WORK"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
source scripts/gpu/gpu_free.sh

python3 - "$WORK" <<'PY'
import json, sys
from pathlib import Path
from megarl.models.tiny import build_tiny_model

work = Path(sys.argv[1])
model = build_tiny_model(work / "model", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, vocab_multiple=64)
config = json.loads((model / "tokenizer_config.json").read_text())
template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
(model / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template, "pad_token": None}))
for split, n in (("train", 96), ("test", 16)):
    rows = [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "user", "content": f"{i} + {i % 9} = ? Answer after ####."}],
             "reward_model": {"style": "rule", "ground_truth": str(i + i % 9)},
             "extra_info": {"split": split, "index": i}} for i in range(n)]
    # verl's parquet layout, as jsonl: the GPU bundle has no pyarrow
    (work / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
PY

common=(data.train_files="$WORK/train.jsonl" data.val_files="$WORK/test.jsonl" data.max_prompt_length=64
  data.max_response_length=48 actor_rollout_ref.model.path="$WORK/model" actor_rollout_ref.rollout.tensor_model_parallel_size=1
  actor_rollout_ref.rollout.gpu_memory_utilization=0.4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16
  trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.logger="['console','file']" trainer.project_name=verl_gpu
  trainer.total_training_steps=3 trainer.test_freq=3 trainer.default_local_dir="$WORK/checkpoints")
status=0
run() {
  local name=$1; shift
  (cd "$WORK" && timeout 540 python3 -m megarl.train "${common[@]}" trainer.experiment_name="$name" "$@") \
    > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 15 "$OUT/$name.log"
  cp "$(ls -d "$WORK/runs/verl_gpu/$name"/logs/*/ 2>/dev/null | tail -1)metrics.jsonl" "$OUT/${name}_metrics.jsonl" 2>/dev/null
  python3 - "$OUT/$name.log" "$OUT/${name}_metrics.jsonl" "$name" "$rc" >> "$OUT/table.md" <<'PY' || status=1
import json, sys
log, metrics, name, rc = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
text = open(log).read()
try:
    rows = [json.loads(l) for l in open(metrics)]
except OSError:
    rows = []
steps = [r for r in rows if r.get("step", 0) > 0]
bad = [m for m, failed in (
    (f"exit {rc}", rc != 0), ("first line is not the verl profile", not text.startswith("profile: verl")),
    (f"{len(steps)} steps trained, expected 3", len(steps) != 3),
    ("a weight sync was not verified", not all(r.get("sync/verified") == 1 for r in steps)),
    ("no critic metrics", name == "ppo" and not any(k.startswith("critic/") for r in steps for k in r))) if failed]
print(f"| {name} | {rc} | {len(steps)} | " + " | ".join(f"{steps[-1].get(k, float('nan')):.4g}" if steps else "" for k in
      ("train/reward", "timing/step", "timing/generate", "sync/seconds")) + f" | {'; '.join(bad) or 'ok'} |")
sys.exit(1 if bad else 0)
PY
}
echo "| run | exit | steps | train/reward | step s | generate s | sync s | checks |" > "$OUT/table.md"
echo "| --- | --- | --- | --- | --- | --- | --- | --- |" >> "$OUT/table.md"
run grpo algorithm.adv_estimator=grpo data.train_batch_size=32 actor_rollout_ref.rollout.n=4 \
  actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.use_kl_loss=True \
  actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl \
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.top_k=20 actor_rollout_ref.actor.optim.lr=1e-5
run ppo data.train_batch_size=32 actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.rollout.name=sglang \
  critic.ppo_micro_batch_size_per_gpu=16 critic.optim.lr=1e-5
echo; grep -h "^profile\|^note\|^  algorithm\|^  samples\|^  batch\|^  steps\|^  reward" "$OUT"/grpo.log "$OUT"/ppo.log
echo; cat "$OUT/table.md"
rm -rf "$WORK"
exit $status
