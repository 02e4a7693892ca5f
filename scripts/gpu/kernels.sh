#!/usr/bin/env bash
# GPU check of megarl's Triton kernels for RoPE and SwiGLU (megarl/models/kernels.py, the engine's fused kernels
# on the GPU), after the bundle's install.sh (../shared/device/README.md). One call, ~6 min:
#   - tests/models/test_fused_ops.py on the GPU (the kernels against megatron's unfused ops, values and gradients)
#     and tests/engine/test_megatron_gpu.py (fused against unfused engines, the kernels counted);
#   - benchmarks/fused_ops.py: per-call time of each op unfused, compiled by torch.compile, and as the Triton kernel;
#   - the engine at the e2e update's batch at 64 completions (0.5B shape, 64 x 640, 4 one-row micro-batches), ROUNDS
#     alternating rounds of this tree and, with AB_OLD=<dir holding an older megarl/ (git archive)>, that tree.
# The device returns at most 8 files a call: logs and JSON go to a scratch directory, and $OUT gets the
# benchmark's JSON, the engine runs' JSON in one file and one log of everything. A short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/megarl-kernels}; mkdir -p "$OUT"
WORK=$(mktemp -d)
ROUNDS=${ROUNDS:-2}
AB_OLD=${AB_OLD:-}
LOG=$OUT/kernels.log
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$LOG"
status=0
timeout 300 python3 -m pytest -q tests/models/test_fused_ops.py tests/engine/test_megatron_gpu.py \
  > "$WORK/tests.log" 2>&1 || status=1
cat "$WORK/tests.log" >> "$LOG"
tests=$(tail -1 "$WORK/tests.log")
timeout 200 python3 benchmarks/fused_ops.py --out "$OUT/fused_ops.json" >> "$LOG" 2>&1 || status=1
engine() {  # $1: name, $2: PYTHONPATH's megarl tree
  PYTHONPATH=/tmp/site:$2 timeout 200 python3 benchmarks/engine_throughput.py --size 0.5b --seq 640 --min-len 640 \
    --sequences 64 --max-tokens 10240 --micro-batch-size 16 --packing one_row --skip-bare --steps 8 --warmup 3 \
    --out "$WORK/engine_$1.json" >> "$LOG" 2>&1 || status=1
}
for round in $(seq "$ROUNDS"); do
  [ -n "$AB_OLD" ] && engine "old_$round" "$PWD/$AB_OLD"
  engine "new_$round" "$PWD"
done
python3 - "$WORK" "$OUT" "$tests" <<'EOF'
import glob, json, os, sys
work, out, tests = sys.argv[1:]
runs = {os.path.basename(p)[7:-5]: json.load(open(p)) for p in sorted(glob.glob(f"{work}/engine_*.json"))}
json.dump(runs, open(f"{out}/engine_runs.json", "w"), indent=1)
print(f"tests: {tests}")
ops = json.load(open(f"{out}/fused_ops.json"))["us_per_call"] if os.path.exists(f"{out}/fused_ops.json") else {}
print("| op (forward + backward) | unfused us | compiled us | triton us |\n| --- | --- | --- | --- |")
for key in sorted({k.rsplit("/", 1)[0] for k in ops}):
    print(f"| {key} | " + " | ".join(str(ops.get(f"{key}/{w}", "-")) for w in ("unfused", "compiled", "triton")) + " |")
print("| engine run (0.5B, 64 x 640) | mean ms/step | steps ms |\n| --- | --- | --- |")
for name, r in runs.items():
    steps = [round(s * 1e3) for s in r.get("engine", {}).get("step_seconds", [])]
    mean = round(sum(steps) / len(steps)) if steps else "-"
    print(f"| {name} | {mean} | {min(steps, default='-')}-{max(steps, default='-')} |")
EOF
echo "== kernels.sh exit $status"
exit $status
