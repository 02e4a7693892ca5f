#!/usr/bin/env bash
# Reward models on one GPU (one H200: ~5 min, at most 8), after the bundle's install.sh
# (../shared/device/README.md); logs, metrics and JSON go to $OUT, a short table is printed last.
#   train - python -m megarl.train_rm on a random Qwen2.5-0.5B shape (hidden 896, 24 layers, 14 heads / 2 KV heads,
#           FFN 4864, vocabulary 151,936, tied; megarl's character tokenizer) with a scalar head, bf16, on pairs
#           whose sides are SEQ tokens (a prompt of random letters, a response ending in "yes" (chosen) or "no"
#           (rejected)), PAIRS pairs per step in packed micro-batches of at most MBT tokens, STEPS steps: tokens/s of
#           each step (the driver's whole train call) and MFU = (6 N + 12 L h n) * tokens/s / 989e12 (N: the
#           2-D weights but the input embedding, the 1-row head included; n: the rows' mean length;
#           benchmarks/engine_throughput.py's formula), held-out pair accuracy before and after. The trained model
#           is exported (megarl.convert) and scored again by transformers' AutoModelForSequenceClassification.
#   rl    - GRPO (configs/rm_grpo_quickstart.yaml: the reward is the reward model's score, normalised by its running
#           mean and std) with that model as reward_model.path: frozen, on ranks and a layout of its own
#           (reward_model.parallel), beside the policy (the same random shape) and a colocated SGLang server, the
#           offload cycle on (the reward model's memory leaves the GPU during rollouts too). Per step: the reward
#           model's time, the rule reward (never trained on) and the model's mean score, the step's time.
# PHASES="train rl" by default (rl needs train's model). DEVICE=cpu: the smoke test, tiny shapes and the hf rollout
# engine (~4 min on 2 busy cores):  DEVICE=cpu OUT=/tmp/rm-smoke bash scripts/gpu/rm.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/megarl-rm}; mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}
PHASES=${PHASES:-train rl}
RUN=/tmp/megarl-rm-run-$$
rm -rf "$RUN"; mkdir -p "$RUN"
phase() { [[ " $PHASES " == *" $1 "* ]]; }
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  source scripts/gpu/gpu_free.sh  # GPU memory in use at start; loud warning above ~1 GB
  SEQ=${SEQ:-512}; PAIRS=${PAIRS:-64}; MBT=${MBT:-16384}; STEPS=${STEPS:-60}; RL_STEPS=${RL_STEPS:-4}
  RL_SIZE="data.prompts_per_step=32"
  ROLLOUT="rollout.engine=sglang"
  LIMIT=${LIMIT:-220}  # seconds per phase: the whole call stays within 8 minutes
else
  SEQ=${SEQ:-24}; PAIRS=${PAIRS:-16}; MBT=${MBT:-512}; STEPS=${STEPS:-8}; RL_STEPS=${RL_STEPS:-2}
  RL_SIZE="data.prompts_per_step=4"
  ROLLOUT="rollout.engine=hf"
  LIMIT=${LIMIT:-1200}  # a busy shared CPU
fi
MODEL=$RUN/base

# the base model (random weights) and the pairs
python3 - "$MODEL" "$DEVICE" "$SEQ" "$PAIRS" "$STEPS" "$RUN" <<'PY' > "$OUT/inputs.log" 2>&1 || { tail "$OUT/inputs.log"; exit 1; }
import json, random, sys, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from megarl.models.tiny import build_char_tokenizer
from megarl.data.files import write_records
model_dir, device, seq, pairs, steps, run = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6]), sys.argv[6]
tok = build_char_tokenizer()
shape = json.load(open("configs/models/qwen2.5-0.5b.json")) if device == "cuda" else dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=len(tok), tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-6)
config = Qwen2Config(**{k: shape[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size",
                                              "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")},
                     rms_norm_eps=shape["rms_norm_eps"], max_position_embeddings=4 * seq + 64,
                     rope_parameters={"rope_type": "default", "rope_theta": shape["rope_theta"]},
                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                     architectures=["Qwen2ForCausalLM"])
torch.manual_seed(0)
with torch.device(device):  # a causal LM (tied: no lm_head written); megarl gives it a zero-initialised scalar head
    model = Qwen2ForCausalLM(config).to(torch.bfloat16 if device == "cuda" else torch.float32)
model.save_pretrained(model_dir)
tok.save_pretrained(model_dir)
print(f"base model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")
rng = random.Random(0)
letters = "abcdefghijklmnopqrstuvwxyz "
def row():
    prompt = "".join(rng.choice(letters) for _ in range(seq // 2)) + ">"
    body = "".join(rng.choice(letters) for _ in range(seq - len(prompt) - 4))
    return {"prompt": prompt, "chosen": body + " yes", "rejected": body + " no"}
write_records(f"{run}/pairs_train.jsonl", [row() for _ in range(pairs * steps)])
write_records(f"{run}/pairs_val.jsonl", [row() for _ in range(64)])
PY
tail -1 "$OUT/inputs.log"

if phase train; then
  timeout "$LIMIT" python3 -m megarl.train_rm model.path="$MODEL" preference.train="$RUN/pairs_train.jsonl" \
    preference.val="$RUN/pairs_val.jsonl" preference.val_size=64 preference.pairs_per_step="$PAIRS" \
    reward_model.max_tokens_per_micro_batch="$MBT" reward_model.optim.lr=2e-5 reward_model.optim.warmup_steps=5 \
    trainer.device="$DEVICE" trainer.steps="$STEPS" trainer.eval_every=$((STEPS / 3)) trainer.cpus_per_rank=1 \
    trainer.output_dir="$RUN/rm" trainer.loggers=[console,tensorboard,jsonl] > "$OUT/train_rm.log" 2>&1
  echo "== train_rm exit $?: $(tail -3 "$OUT/train_rm.log" | tr '\n' ' ')"
  cp "$(ls -d "$RUN/rm"/logs/*/ 2>/dev/null | tail -1)metrics.jsonl" "$OUT/train_rm_metrics.jsonl" 2>/dev/null
  # the export in transformers: a sequence classifier scoring the held-out pairs
  python3 - "$RUN/rm/reward_model" "$RUN/pairs_val.jsonl" "$DEVICE" <<'PY' > "$OUT/transformers.json" 2> "$OUT/transformers.log"
import json, sys, torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer
path, pairs, device = sys.argv[1:4]
model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.bfloat16 if device == "cuda" else
                                                           torch.float32).to(device).eval()
tok = AutoTokenizer.from_pretrained(path)
rows = [json.loads(line) for line in open(pairs)]
def score(text):
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids], device=device)).logits[0, 0].float().item()
margins = [score(r["prompt"] + r["chosen"]) - score(r["prompt"] + r["rejected"]) for r in rows]
print(json.dumps({"class": type(model).__name__, "num_labels": model.config.num_labels,
                  "pair_accuracy": sum(m > 0 for m in margins) / len(margins), "margin": sum(margins) / len(margins)}))
PY
fi

if phase rl; then
  timeout "$LIMIT" python3 -m megarl.train --config configs/rm_grpo_quickstart.yaml model.path="$MODEL" \
    reward_model.path="$RUN/rm/reward_model" trainer.device="$DEVICE" $ROLLOUT $RL_SIZE sft.steps=0 actor.optim.lr=1e-6 \
    trainer.steps="$RL_STEPS" trainer.eval_every="$RL_STEPS" data.val_size=16 rollout.eval_n_samples=1 \
    trainer.cpus_per_rank=1 trainer.output_dir="$RUN/rl" trainer.loggers=[console,tensorboard,jsonl] \
    > "$OUT/rl.log" 2>&1
  echo "== RL exit $?: $(tail -2 "$OUT/rl.log" | tr '\n' ' ')"
  cp "$(ls -d "$RUN/rl"/logs/*/ 2>/dev/null | tail -1)metrics.jsonl" "$OUT/rl_metrics.jsonl" 2>/dev/null
fi

echo "== reward model on $DEVICE $(head -1 "$OUT/gpu.txt" 2>/dev/null)"
python3 - "$OUT" "$MODEL/config.json" "$PAIRS" <<'PY'
import json, statistics, sys
sys.path.insert(0, "benchmarks")
from engine_throughput import PEAK_FLOPS, flop_parameters
out, config, pairs = sys.argv[1], json.load(open(sys.argv[2])), int(sys.argv[3])
def rows(name):
    try:
        return [json.loads(line) for line in open(f"{out}/{name}")]
    except OSError:
        return []
train = [r for r in rows("train_rm_metrics.jsonl") if "perf/tokens_per_s" in r]
val = {r["step"]: r for r in rows("train_rm_metrics.jsonl") if "val/pair_accuracy" in r}
summary = {}
if train:
    steady = train[2:] or train  # the first steps compile and allocate
    tps = statistics.median(r["perf/tokens_per_s"] for r in steady)
    step_s = statistics.median(r["timing/step"] for r in steady)
    n = tps * step_s / (2 * pairs)  # the rows' mean length
    flops_per_token = 6 * flop_parameters(dict(config, vocab_size=1)) + 12 * config["num_hidden_layers"] * config["hidden_size"] * n
    summary = {"tokens_per_s": tps, "step_s": step_s, "mean_row_tokens": n, "mfu": tps * flops_per_token / PEAK_FLOPS}
    print("| phase | steps | median step s | tokens/s | row tokens | MFU | held-out pair accuracy (margin) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    first, last = min(val), max(val)
    print(f"| train_rm | {len(train)} | {step_s:.3f} | {tps:,.0f} | {n:.0f} | {100 * summary['mfu']:.1f}% "
          f"| {val[first]['val/pair_accuracy']:.3f} -> {val[last]['val/pair_accuracy']:.3f} "
          f"({val[last]['val/margin']:.3f}) |")
try:
    hf = json.load(open(f"{out}/transformers.json"))
    summary["transformers"] = hf
    print(f"| transformers | {hf['class']}, num_labels {hf['num_labels']} | | | | | {hf['pair_accuracy']:.3f} "
          f"({hf['margin']:.3f}) |")
except (OSError, ValueError):
    print("| transformers | did not load (transformers.log) |")
rl = [r for r in rows("rl_metrics.jsonl") if "train/reward" in r]
if rl:
    print("\n| RL step | step s | reward model s | rm score | rule reward (exact) | reward (normalised) | generate s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rl:
        g = lambda k: f"{r[k]:.3g}" if k in r else "-"
        print(f"| {r['step']} | {g('timing/step')} | {g('timing/reward_model')} | {g('train/rm_score')} "
              f"| {g('train/rule_reward')} | {g('train/reward')} | {g('timing/generate')} |")
    summary["rl"] = rl
json.dump(summary, open(f"{out}/rm_summary.json", "w"), indent=1)
PY
