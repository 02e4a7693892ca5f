#!/usr/bin/env bash
# LoRA GRPO on one GPU (one H100/H200: ~6 min, at most 9), after the bundle's install.sh (../shared/device/README.md);
# logs and metrics go to $OUT, a short table is printed last. Three runs of the quickstart task
# (configs/quickstart.yaml, no warm start) on a random Qwen2.5-0.5B shape (configs/models/qwen2.5-0.5b.json,
# megarl's character tokenizer), bf16, one training rank with a colocated SGLang server, the offload cycle as the
# defaults set it, STEPS steps each:
#   full    - full fine-tuning (actor.lora.rank=0), the merged-weights sync as usual;
#   merged  - actor.lora.rank=16, alpha 32, all-linear; each sync sends the merged model (rollout.lora_sync=merged),
#             checksum-verified;
#   adapter - the same LoRA policy; each sync writes the PEFT adapter and SGLang loads it under a new name
#             (rollout.lora_sync=adapter: --enable-lora, /load_lora_adapter; SGLang keeps its base weights between
#             rollouts), unverified.
# Per run: median sync seconds and MB, the step's seconds, the policy rank's engine state (weights, gradients,
# optimizer), allocated and the device's used GB after the update (memory/trained/...; GPU only), the last step's
# reward. DEVICE=cpu: the smoke test, a tiny shape, the hf engine (it merges the adapter), 2 steps (~14 min on 2 busy
# cores):  DEVICE=cpu OUT=/tmp/lora-smoke bash scripts/gpu/lora.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/megarl-lora}; mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}
RUN=/tmp/megarl-lora-run-$$
rm -rf "$RUN"; mkdir -p "$RUN"
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  source scripts/gpu/gpu_free.sh  # GPU memory in use at start; loud warning above ~1 GB
  STEPS=${STEPS:-6}; SIZE="data.prompts_per_step=32 rollout.n_samples=8 rollout.max_new_tokens=64"
  ROLLOUT="rollout.engine=sglang"
  LIMIT=${LIMIT:-170}  # seconds per run: the whole call stays within 9 minutes
else
  STEPS=${STEPS:-2}; SIZE="data.prompts_per_step=2 rollout.n_samples=2 data.val_size=2 rollout.eval_n_samples=1"
  ROLLOUT="rollout.engine=hf"
  LIMIT=${LIMIT:-600}  # a busy shared CPU
fi
MODEL=$RUN/base

python3 - "$MODEL" "$DEVICE" <<'PY' > "$OUT/model.log" 2>&1 || { tail "$OUT/model.log"; exit 1; }
import json, sys, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from megarl.models.tiny import build_char_tokenizer
model_dir, device = sys.argv[1:3]
tok = build_char_tokenizer()
shape = json.load(open("configs/models/qwen2.5-0.5b.json")) if device == "cuda" else dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-6)
config = Qwen2Config(**{k: shape[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                              "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")},
                     vocab_size=len(tok), rms_norm_eps=shape["rms_norm_eps"], max_position_embeddings=512,
                     rope_parameters={"rope_type": "default", "rope_theta": shape["rope_theta"]},
                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                     architectures=["Qwen2ForCausalLM"])
torch.manual_seed(0)
model = Qwen2ForCausalLM(config).to(torch.bfloat16 if device == "cuda" else torch.float32)
model.save_pretrained(model_dir)
tok.save_pretrained(model_dir)
print(f"base model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")
PY
tail -1 "$OUT/model.log"

LORA="actor.lora.rank=16 actor.lora.alpha=32 actor.lora.target_modules=all-linear"
for run in full merged adapter; do
  case $run in
    full) KEYS="actor.lora.rank=0" ;;
    merged) KEYS="$LORA rollout.lora_sync=merged" ;;
    adapter) KEYS="$LORA rollout.lora_sync=adapter actor.lora.peft_dir=$RUN/adapter/peft" ;;
  esac
  timeout "$LIMIT" python3 -m megarl.train --config configs/quickstart.yaml model.path="$MODEL" \
    trainer.device="$DEVICE" $ROLLOUT $SIZE actor.parallel.world_size=1 actor.parallel.tp=1 sft.steps=0 \
    actor.optim.lr=1e-4 trainer.steps="$STEPS" trainer.eval_every="$STEPS" trainer.cpus_per_rank=1 \
    trainer.output_dir="$RUN/$run" trainer.loggers=[console,jsonl] $KEYS > "$OUT/$run.log" 2>&1
  echo "== $run exit $?: $(tail -2 "$OUT/$run.log" | tr '\n' ' ' | cut -c1-300)"
  cp "$(ls -d "$RUN/$run"/logs/*/ 2>/dev/null | tail -1)metrics.jsonl" "$OUT/${run}_metrics.jsonl" 2>/dev/null
done
ls -l "$RUN/adapter/peft" > "$OUT/peft_dir.txt" 2>&1

echo "== LoRA GRPO on $DEVICE $(head -1 "$OUT/gpu.txt" 2>/dev/null)"
python3 - "$OUT" <<'PY'
import json, statistics, sys
out = sys.argv[1]
summary = {}
print("| run | steps | sync s (median) | sync MB | verified | step s (median) | train state GB | train allocated GB "
      "| device used GB | last reward |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for run in ("full", "merged", "adapter"):
    try:
        rows = [r for r in map(json.loads, open(f"{out}/{run}_metrics.jsonl")) if "train/reward" in r]
    except OSError:
        rows = []
    if not rows:
        print(f"| {run} | 0 (see {run}.log) | | | | | | | | |")
        continue
    med = lambda k: statistics.median(r[k] for r in rows if k in r) if any(k in r for r in rows) else float("nan")
    summary[run] = {k: med(k) for k in ("sync/seconds", "sync/bytes", "timing/step", "memory/trained/train_resident_gb",
                                        "memory/trained/train_allocated_gb", "memory/trained/train_device_used_gb")}
    print(f"| {run} | {len(rows)} | {med('sync/seconds'):.3f} | {med('sync/bytes') / 1e6:.2f} | "
          f"{med('sync/verified'):.0f} | {med('timing/step'):.2f} | {med('memory/trained/train_resident_gb'):.4g} | "
          f"{med('memory/trained/train_allocated_gb'):.2f} | "
          f"{med('memory/trained/train_device_used_gb'):.2f} | {rows[-1]['train/reward']:.3f} |")
json.dump(summary, open(f"{out}/lora_summary.json", "w"), indent=1)
PY
