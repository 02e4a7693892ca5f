#!/usr/bin/env bash
# GPU run of issue 4's weight sync and rollout throughput (benchmarks/weight_sync.py), 1 or 2 GPUs, after
# the bundle's install.sh (../shared/device/README.md). Expected: ~6 min on one H200, ~8 on two.
#   sync_tp1   colocated CUDA IPC into a TP=1 server, 0.5B / 1.5B / 7B random Qwen2 shapes (dummy load),
#              payload formats tensors / flattened_bucket / persistent, time split and GB/s; 0.5B
#              verified bit for bit inside SGLang (weights checker) for every format.
#   throughput megarl's SGLangRolloutEngine.generate vs sglang.Engine.generate, same requests (0.5B).
#   sync_tp2   (2 GPUs) one TP=2 server on GPUs 0-1, 7B, trainer on GPU 0.
#   nccl       (2 GPUs) disaggregated: server on GPU 1, NCCL broadcast from GPU 0, 7B, flattened and
#              per-tensor, verified bit for bit.
# Each part is its own process with its own time limit: one failing keeps the others' numbers. Logs,
# server logs and JSON go to $OUT; a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/megarl-weight-sync}; mkdir -p "$OUT/server_logs"
B="python3 benchmarks/weight_sync.py"
LOGS="--log-dir $OUT/server_logs"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
source scripts/gpu/gpu_free.sh  # GPU memory in use at start; loud warning above ~1 GB
GPUS=$(nvidia-smi -L | wc -l)
run() {  # name, limit in seconds, command...
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)"
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "   exit $? after ${SECONDS}s total"; tail -n 4 "$OUT/$name.log"
}
run sync_tp1 300 $B sync --models qwen2.5-0.5b qwen2.5-1.5b qwen2.5-7b --verify --out "$OUT/sync_tp1.json" $LOGS
run throughput 240 $B throughput --models qwen2.5-0.5b --out "$OUT/throughput.json" $LOGS
if [ "$GPUS" -ge 2 ]; then
  run sync_tp2 110 $B sync --models qwen2.5-7b --server-tp 2 --formats flattened_bucket persistent \
    --out "$OUT/sync_tp2.json" $LOGS
  run nccl 110 $B nccl --models qwen2.5-7b --verify --out "$OUT/nccl.json" $LOGS
fi
# keep only the server logs' tails (the files that come back are limited)
for f in "$OUT"/server_logs/*.log; do [ -f "$f" ] && tail -n 60 "$f" > "$f.tail" && rm "$f"; done
echo "== weight sync on $(head -1 "$OUT/gpu.txt") ($GPUS GPU(s)), ${SECONDS}s"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / name).read_text())["results"]
    except Exception as e:
        print(f"{name}: no results ({e})"); return []
print("| part | model | format | tp | GB | total s | resume | convert | pack | transfer | ready | GB/s | verified |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for part in ("sync_tp1.json", "sync_tp2.json"):
    for r in load(part) if (out / part).exists() or part == "sync_tp1.json" else []:
        if "error" in r:
            print(f"| {part[:-5]} | {r['model']} | {r.get('format', '')} | {r.get('server_tp')} | ERROR {r['error'][:80]} |"); continue
        print(f"| {part[:-5]} | {r['model']} | {r['format']} | {r['server_tp']} | {r['bytes']/1e9:.2f} | {r['total_s']:.3f} "
              f"| {r['resume_s']:.3f} | {r['convert_s']:.3f} | {r['pack_s']:.3f} | {r['transfer_s']:.3f} | {r['ready_s']:.3f} "
              f"| {r['gb_per_s']:.1f} | {r.get('verified', '')} |")
if (out / "nccl.json").exists():
    for r in load("nccl.json"):
        if "error" in r:
            print(f"| nccl | {r['model']} | flattened={r['flattened']} | 1 | ERROR {r['error'][:80]} |"); continue
        print(f"| nccl | {r['model']} | flattened={r['flattened']} | 1 | {r['bytes']/1e9:.2f} | {r['total_s']:.3f} "
              f"| | | | | | {r['gb_per_s']:.1f} | {r.get('verified', '')} |")
t = load("throughput.json")
if t:
    print(f"rollout tok/s ({t.get('model')}, {t.get('prompts')} prompts x n={t.get('n')} x {t.get('new_tokens')} new): "
          f"megarl {t.get('megarl_tok_s', float('nan')):.0f}, sglang.Engine {t.get('sglang_engine_tok_s', float('nan')):.0f}, "
          f"ratio {t.get('ratio', float('nan')):.3f}; megarl with SGLang's memory saver (as colocated) "
          f"{t.get('megarl_memory_saver_tok_s', float('nan')):.0f}, ratio {t.get('ratio_memory_saver', float('nan')):.3f}")
PY
