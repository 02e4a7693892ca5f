#!/usr/bin/env bash
# GRPO with real SGLang servers on one GPU (one H200: ~8 min for both phases; grpo alone ~5 min), after the bundle's
# install.sh (../shared/device/README.md):
#   grpo  - GRPO end to end, colocated, with the offload cycle (trainer.offload_between_phases=always):
#           train -> SGLang resumes its weights memory -> the train rank posts the weights by CUDA IPC itself, verified
#           in SGLang after every sync (weights checker: received vs its loader reading the exported file) -> Megatron
#           offloads weights, grads and optimizer state -> SGLang resumes its KV cache -> rollout -> SGLang
#           releases its memory -> Megatron reloads. A ~0.5B Qwen2 shape (hidden 896, 24 layers, 14 heads,
#           2 KV heads, FFN 4864; the char tokenizer's tiny vocabulary leaves ~0.36B parameters) after a
#           short SFT; per step the mean |SGLang log-prob - Megatron log-prob| on the same tokens and the
#           memory at each phase (the train rank's allocator, the whole device; SGLang's share is the rest),
#           plus nvidia-smi sampled every 0.5 s ($OUT/grpo_gpu_memory.csv, per process in grpo_gpu_processes.csv).
#           Fails if Megatron's memory does not leave the GPU during rollouts or SGLang's does not during training.
#   sync  - benchmarks/weight_sync.py: sync time split and GB/s for 0.5B / 1.5B / 7B dummy models, TP=1.
#   grpo_disagg - (2 GPUs, ~5 min) the same GRPO run disaggregated: the training rank on GPU 0, a TP=1 SGLang
#           server on GPU 1 (rollout.sglang_gpus=1: the rollout actor's own GPU), no offload cycle; each sync
#           broadcast by NCCL from the train rank into the server (its weight group built at the first sync),
#           verified in SGLang after every sync. Fails unless every sync was direct, some verified, no offload
#           ran and both GPUs were used. Run it alone: PHASES=grpo_disagg bash scripts/gpu/sglang.sh
# PHASES="grpo sync" by default; logs and JSON go to $OUT; a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/megarl-sglang}; mkdir -p "$OUT"
PHASES=${PHASES:-grpo sync}
# only the GPUs this run may use (another run may share the machine on other GPUs)
SMI_GPUS=${CUDA_VISIBLE_DEVICES:+-i $CUDA_VISIBLE_DEVICES}
nvidia-smi $SMI_GPUS --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
source scripts/gpu/gpu_free.sh  # GPU memory in use at start; loud warning above ~1 GB
# One GRPO run of the quickstart on SGLang: grpo_run NAME MODE OVERRIDES... (MODE: colocated or disaggregated,
# which the checks after the table follow). A ~0.5B Qwen2 shape (hidden 896, 24 layers, 14 heads, 2 KV heads,
# FFN 4864; the char tokenizer's tiny vocabulary leaves ~0.36B parameters) after a short SFT, weights verified
# inside SGLang after every sync (~2 s each at this size); nvidia-smi sampled every 0.5 s
# ($OUT/NAME_gpu_memory.csv, per process in NAME_gpu_processes.csv); log, metrics and the server logs' tails in $OUT/NAME*; the per-step table printed.
grpo_run() {
  local name=$1 mode=$2 rc
  local RUN=/tmp/megarl-sglang-run-$name-$$  # $$: runs of sync_lanes.sh's lanes side by side have a directory each
  shift 2
  rm -rf "$RUN"
  nvidia-smi $SMI_GPUS --query-gpu=timestamp,index,memory.used --format=csv,noheader -lms 500 > "$OUT/${name}_gpu_memory.csv" \
    2>/dev/null &
  local smi=$!
  ( while sleep 0.5; do nvidia-smi $SMI_GPUS --query-compute-apps=timestamp,gpu_uuid,pid,process_name,used_memory \
      --format=csv,noheader 2>/dev/null; done > "$OUT/${name}_gpu_processes.csv" ) &
  local apps=$!
  timeout 480 python3 -m megarl.train --config configs/quickstart.yaml trainer.device=cuda \
    actor.parallel.world_size=1 actor.parallel.tp=1 rollout.engine=sglang rollout.weight_delivery=full \
    model.tiny_hidden_size=896 model.tiny_num_layers=24 model.tiny_num_heads=14 model.tiny_num_kv_heads=2 \
    model.tiny_intermediate_size=4864 actor.optim.lr=2e-5 sft.lr=2e-4 sft.steps=40 trainer.steps=6 trainer.eval_every=3 \
    trainer.verify_weight_sync_every=1 trainer.sync_bucket_mb=512 actor.micro_batch_size=32 \
    trainer.cpus_per_rank=1 trainer.output_dir=$RUN "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  kill "$smi" "$apps" 2>/dev/null
  tail -n 25 "$OUT/$name.log"
  cp "$(ls -d "$RUN"/logs/*/ 2>/dev/null | tail -1)metrics.jsonl" "$OUT/${name}_metrics.jsonl" 2>/dev/null
  ls "$RUN"/sglang_*.log >/dev/null 2>&1 && tail -n 40 "$RUN"/sglang_*.log > "$OUT/${name}_sglang_server.log"
  python3 - "$OUT/${name}_metrics.jsonl" "$mode" "$OUT/${name}_gpu_memory.csv" <<'PY'
import csv, json, sys
path, mode, gpu_memory = sys.argv[1:4]
try:
    rows = [json.loads(l) for l in open(path)]
except OSError:
    rows = []
f = lambda r, k: f"{r[k]:.4g}" if k in r else ""
print("| step | train/reward | val/reward | logprob_abs_diff | timing/sync s | sync s (GB/s, direct) | gather+convert "
      "/ pack / transfer / end s | verify s | resume_kv s | generate s | offload s | onload s |\n|" + " --- |" * 12)
for r in (r for r in rows if "train/reward" in r or "val/reward" in r):
    print(f"| {r.get('step', '')} | {f(r, 'train/reward')} | {f(r, 'val/reward')} | {f(r, 'rollout/logprob_abs_diff')} | "
          f"{f(r, 'timing/sync')} | {f(r, 'sync/seconds')} ({f(r, 'sync/gb_per_s')}, {f(r, 'sync/direct')}) | "
          + " / ".join(f(r, f"sync/{k}_s") for k in ("gather_convert", "pack", "transfer", "end")) + " | "
          f"{f(r, 'sync/verify_s')} | {f(r, 'timing/resume_kv_cache')} | {f(r, 'timing/generate')} | "
          f"{f(r, 'timing/offload')} | {f(r, 'timing/onload')} |")
if mode == "colocated":
    # memory per phase, in cycle order: train rank allocated / reserved, whole device, the rest (SGLang + contexts)
    phases = ["trained", "synced", "offloaded", "kv_cache", "released", "onloaded"]
    print("\n| step | phase | megatron allocated GB | megatron reserved GB | device used GB | rest (SGLang) GB |")
    print("| --- | --- | --- | --- | --- | --- |")
    bad = []
    for r in rows:
        if "memory/offloaded_gb" not in r:
            continue
        for p in phases:
            k = f"memory/{p}/train_"
            if k + "device_used_gb" in r:
                rest = r[k + "device_used_gb"] - r[k + "reserved_gb"]
                print(f"| {r['step']} | {p} | {r[k + 'allocated_gb']:.2f} | {r[k + 'reserved_gb']:.2f} | "
                      f"{r[k + 'device_used_gb']:.2f} | {rest:.2f} |")
        m = lambda p, x: r.get(f"memory/{p}/train_{x}_gb", float("nan"))
        if not m("offloaded", "allocated") < 0.25 * m("trained", "allocated"):
            bad.append(f"step {r['step']}: Megatron kept {m('offloaded', 'allocated'):.2f} of "
                       f"{m('trained', 'allocated'):.2f} GB during the rollout")
        rest = lambda p: m(p, "device_used") - m(p, "reserved")
        if not rest("released") < rest("kv_cache") - 1.0:
            bad.append(f"step {r['step']}: SGLang's memory did not go down after the rollout "
                       f"({rest('kv_cache'):.2f} -> {rest('released'):.2f} GB)")
    if not any("memory/offloaded_gb" in r for r in rows):
        bad.append("no memory metrics: the offload cycle did not run")
    print("\n".join(f"MEMORY CHECK FAILED: {b}" for b in bad) or "memory checks passed: Megatron's memory leaves the GPU "
          "during rollouts, SGLang's during training")
    sys.exit(1 if bad else 0)
# disaggregated: every sync went from the train rank to the server by NCCL, some verified inside SGLang, no
# offload cycle, and two GPUs in use (Megatron's rank on one, SGLang's server on the other: over 2 GiB each at peak)
syncs = [r for r in rows if "sync/direct" in r]
peak = {}
for row in csv.reader(open(gpu_memory)):  # timestamp, index, "N MiB"
    if len(row) == 3 and row[2].strip().endswith("MiB"):
        peak[row[1].strip()] = max(peak.get(row[1].strip(), 0), int(row[2].split()[0]))
gpus = [i for i, mib in peak.items() if mib > 2048]
bad = [m for m, failed in (
    ("no weight sync recorded", not syncs),
    ("a sync did not go directly from the train rank to SGLang", any(r["sync/direct"] != 1 for r in syncs)),
    ("no sync was verified", not any(r.get("sync/verified") == 1 for r in syncs)),
    ("the offload cycle ran", any("memory/offloaded_gb" in r for r in rows)),
    (f"{len(gpus)} GPU(s) used (peak MiB by GPU: {peak}), expected 2: trainer and SGLang apart", len(gpus) != 2))
       if failed]
print("\n".join(f"DISAGGREGATED CHECK FAILED: {b}" for b in bad) or f"disaggregated checks passed: {len(syncs)} syncs "
      f"by NCCL, {sum(r.get('sync/verified') == 1 for r in syncs)} verified inside SGLang, peak MiB by GPU {peak}")
sys.exit(1 if bad else 0)
PY
  return $(( rc | $? ))
}
status=0
if [[ " $PHASES " == *" grpo "* ]]; then
  # colocated, with the offload cycle forced on
  grpo_run grpo colocated rollout.sglang_mem_fraction=0.35 trainer.offload_between_phases=always "$@"
  status=$(( status | $? ))
fi
if [[ " $PHASES " == *" grpo_disagg "* ]]; then
  gpus=$(nvidia-smi $SMI_GPUS --query-gpu=index --format=csv,noheader | wc -l)
  if [ "$gpus" -lt 2 ]; then
    echo "grpo_disagg needs 2 GPUs (1 training rank, 1 SGLang server); this run has $gpus"
    status=1
  else
    # SGLang on a GPU of its own (most of it for weights and KV cache), no offload cycle; NCCL_CUMEM_ENABLE=0
    # as SGLang's side of the weight group has it (megarl/rollout/transports/nccl_broadcast.py)
    NCCL_CUMEM_ENABLE=0 grpo_run grpo_disagg disaggregated rollout.sglang_gpus=1 rollout.sglang_mem_fraction=0.7 "$@"
    status=$(( status | $? ))
  fi
fi
if [[ " $PHASES " == *" sync "* ]]; then
  # MEGARL_COMMIT: the device copy has no .git; pass the commit in to stamp the JSON
  timeout 400 python3 benchmarks/weight_sync.py sync --models qwen2.5-0.5b qwen2.5-1.5b qwen2.5-7b \
    --out "$OUT/weight_sync.json" --log-dir "$OUT" ${SYNC_ARGS:-} 2>&1 | tail -n 30 | tee "$OUT/weight_sync.log"
  status=$(( status | PIPESTATUS[0] ))
fi
echo "== sglang.sh phases [$PHASES] on $(cat "$OUT/gpu.txt"): exit $status"
exit $status
