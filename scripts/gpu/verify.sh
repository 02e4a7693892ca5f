#!/usr/bin/env bash
# GPU run of issue 17's weight verification (one H100/H200), after the bundle's install.sh
# (../shared/device/README.md). PARTS, in order (default "kernel sync"; "grpo" is a call of its own, ~5 min):
#   kernel  the Triton checksum kernel against the torch path on the GPU: whole tensors, row blocks, column
#           blocks (strided), offsets, bf16/fp32/uint8; and its time over 7.6B bf16 elements            (~30 s)
#   sync    benchmarks/weight_sync.py sync --checksums: 7B (8 GiB buckets) and 0.5B (1 GiB) into a TP=1 server;
#           after each format's timed syncs, one sync verified by checksums (sender during the sync, SGLang's
#           TP worker on its GPU, comparison) and a bit flipped in SGLang's memory, which must be named; at 0.5B
#           also the deep check (SGLang reloads a file) for comparison                                 (~3 min)
#   grpo    GRPO colocated on the 0.5B shape of scripts/gpu/sglang.sh, twice: the defaults (every sync verified
#           by checksums), and the deep check on every second sync (trainer.verify_weight_sync_deep=true,
#           verify_weight_sync_every=2), whose other steps are unverified                             (~5 min)
# Logs and JSON go to $OUT; a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/megarl-verify}; mkdir -p "$OUT"
PARTS=${PARTS:-kernel sync}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
if [[ " $PARTS " == *" kernel "* ]]; then
  timeout 120 python3 - > "$OUT/kernel.log" 2>&1 <<'PY'
import json, time, torch
from megarl.utils.checksum import weighted_sums

g = torch.Generator(device="cuda").manual_seed(0)
cases = []
for dtype in (torch.bfloat16, torch.float32, torch.uint8):
    x = (torch.randn(3000, 777, device="cuda", generator=g) * 100).to(dtype)
    for name, piece, offset, stride in (("whole", x, 0, None), ("rows", x[1000:2000], 12345, None),
                                        ("columns", x[:, 100:400], 7, 777), ("column shard", x[:, 400:], 0, None),
                                        ("1-d", x[5], 99, None)):
        gpu = weighted_sums(piece, offset, stride)
        cpu = weighted_sums(piece.cpu(), offset, stride)  # the torch path (a CPU tensor)
        cases.append((str(dtype), name, torch.equal(gpu.cpu(), cpu)))
# many pieces of several widths in one table, flushed at once (as a sync's bucket and SGLang's parameters are)
from megarl.utils.checksum import ChecksumTable
pieces = [(torch.randn(n, 64, device="cuda", generator=g) * 50).to(d) for n, d in
          ((5, torch.bfloat16), (300, torch.float32), (7, torch.uint8), (1000, torch.bfloat16), (3, torch.float64))]
gpu, cpu = ChecksumTable(3, "cuda"), ChecksumTable(3, "cpu")
for i, p in enumerate(pieces):
    for table, q in ((gpu, p), (cpu, p.cpu())):
        table.add(i % 3, q, offset=17 * i)
        table.add(i % 3, q[:, 10:20], offset=3, target_stride=64)
cases.append(("mixed", "table", gpu.values() == cpu.values()))
ok = all(c[2] for c in cases)
big = torch.empty(7_615_616_512 // 4, dtype=torch.bfloat16, device="cuda")  # a quarter of 7B at a time: 3.8 GB
big.view(torch.int16).random_()
for _ in range(2):
    weighted_sums(big)
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(4):  # 7.6B elements in all
    weighted_sums(big)
torch.cuda.synchronize()
seconds = time.perf_counter() - t
print(json.dumps({"triton_equals_torch": ok, "cases": cases, "checksum_7b_elements_s": seconds,
                  "gb_per_s": 4 * big.numel() * 2 / seconds / 1e9}))
PY
  rc=$?; status=$((status | rc)); tail -n 3 "$OUT/kernel.log"
fi
if [[ " $PARTS " == *" sync "* ]]; then
  timeout 240 python3 benchmarks/weight_sync.py sync --models qwen2.5-7b --formats persistent --bucket-mb 8192 \
    --weights released --trials 2 --checksums --out "$OUT/sync_7b.json" --log-dir "$OUT" > "$OUT/sync_7b.log" 2>&1
  status=$((status | $?)); tail -n 3 "$OUT/sync_7b.log"
  timeout 200 python3 benchmarks/weight_sync.py sync --models qwen2.5-0.5b --formats persistent --bucket-mb 1024 \
    --weights released --trials 2 --checksums --verify --out "$OUT/sync_0.5b.json" --log-dir "$OUT" \
    > "$OUT/sync_0.5b.log" 2>&1
  status=$((status | $?)); tail -n 3 "$OUT/sync_0.5b.log"
fi
if [[ " $PARTS " == *" grpo "* ]]; then
  common="sft.steps=10 trainer.steps=6 trainer.eval_every=6"
  OUT=$OUT/grpo_default PHASES=grpo bash scripts/gpu/sglang.sh $common > "$OUT/grpo_default.log" 2>&1
  status=$((status | $?))
  OUT=$OUT/grpo_deep PHASES=grpo bash scripts/gpu/sglang.sh $common trainer.verify_weight_sync_deep=true \
    trainer.verify_weight_sync_every=2 > "$OUT/grpo_deep.log" 2>&1
  status=$((status | $?))
fi
python3 - "$OUT" <<'PY'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
kernel = out / "kernel.log"
if kernel.exists():
    lines = [l for l in kernel.read_text().splitlines() if l.startswith("{")]
    k = json.loads(lines[-1]) if lines else {}
    print(f"kernel: Triton == torch on every case: {k.get('triton_equals_torch')}; 7.6B bf16 elements in "
          f"{k.get('checksum_7b_elements_s', float('nan')):.4f} s ({k.get('gb_per_s', 0):.0f} GB/s)")
print("\n| model | sync s (GB/s) | sync with checksums s | sender checksum s | SGLang checksum s | compare s | "
      "verify s | verify / sync | first verify s (compiles) | params checked | flipped bit named | deep check s |\n|"
      + " --- |" * 12)
for name in ("sync_7b", "sync_0.5b"):
    path = out / f"{name}.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    rows = rows.get("results", []) if isinstance(rows, dict) else rows
    for r in rows:
        if "error" in r:
            print(f"| {r.get('model')} | ERROR {r['error'][:120]} |")
            continue
        f = lambda k, p=4: f"{r[k]:.{p}f}" if isinstance(r.get(k), (int, float)) else str(r.get(k, ""))
        ratio = r["checksum_verify_s"] / r["total_s"] if r.get("checksums_verified") else float("nan")
        print(f"| {r['model']} | {f('total_s')} ({f('gb_per_s', 1)}) | {f('checksum_sync_s')} | {f('sender_checksum_s')} | "
              f"{f('engine_checksum_s')} ({f('sglang_inside_s')}) | {f('compare_s')} | {f('checksum_verify_s')} | {ratio:.3f} | {f('first_verify_s')} | "
              f"{r.get('parameters_checked', '')} | {r.get('flip_detected', '')} | {f('verify_s') if r.get('verified') else ''} |")
for name in ("grpo_default", "grpo_deep"):
    path = out / name / "grpo_metrics.jsonl"
    if not path.exists():
        continue
    rows = [json.loads(l) for l in path.read_text().splitlines()]
    steps = [r for r in rows if "timing/step" in r]
    for verified in (1.0, 0.0):
        chosen = [r for r in steps if r.get("sync/verified") == verified]
        if chosen:
            step = statistics.median(r["timing/step"] for r in chosen)
            verify = statistics.median(r["sync/verify_s"] for r in chosen)
            print(f"{name}: {'verified' if verified else 'unverified'} steps {[r['step'] for r in chosen]}: median step "
                  f"{step:.3f} s, verify {verify:.4f} s ({verify / step:.2%} of the step)")
print(f"verify.sh parts [{' '.join(sys.argv[2:]) or 'see header'}] done")
PY
echo "== verify.sh [$PARTS] exit $status"
exit $status
