#!/usr/bin/env bash
# GPU run of the weight-sync verification (one H100/H200), after the bundle's install.sh
# (../shared/device/README.md). PARTS, in order (default "kernel sync"; "grpo" is a call of its own, ~5 min):
#   kernel  the Triton checksum kernel against the torch path on the GPU: whole tensors, row blocks, column
#           blocks (strided), offsets, unaligned pieces, bf16/fp32/uint8, a bucket packed while summed (bytes
#           and sums); its time over 7.6B bf16 elements, beside torch's copy and the copy-and-sum    (~30 s)
#           KERNEL_SWEEP=1: the same times for each launch shape (elements per block, blocks per program,
#           warps), each shape's sums checked against the torch path; a JSON line each          (+~1-2 min)
#   sync    benchmarks/weight_sync.py sync --checksums: 7B (8 GiB buckets) and 0.5B (1 GiB) into a TP=1 server
#           (SYNC_MODELS="7b" for the 7B alone); after each format's timed syncs, rounds of one unverified and one
#           verified sync (the sender's checksums summed by its pack copy; SGLang sums nothing during the sync):
#           (a) the verification's cost on the sync's path is the difference of their medians; (b) the deferred
#           collection (the request that has SGLang's TP workers checksum what they hold, the comparison) is timed
#           apart, after each verified sync; (c) SGLang's sums' GPU time; then a bit flipped in
#           SGLang's memory after a verified sync, before its collection, which must be named; at 0.5B also the
#           deep check (SGLang reloads a file) for comparison. PROFILE=1: at 7B one more verified sync under
#           torch.profiler: $OUT/profile_7b/ (op table, trace, host seconds of CUDA waits and megarl's phases)
#           (7B ~3 min: ~2 of them the server's start; 0.5B ~1.5 min)
#   grpo    GRPO colocated on the 0.5B shape of scripts/gpu/sglang.sh, twice: the defaults (every sync verified
#           by checksums), and the deep check on every second sync (trainer.verify_weight_sync_deep=true,
#           verify_weight_sync_every=2), whose other steps are unverified                             (~5 min)
#   gsm8k   (a call of its own: ~4-5 min, at most ~5.5) the GSM8K GRPO recipe itself,
#           scripts/recipes/grpo_gsm8k_qwen2.5_0.5b.sh (256 prompts x 5 samples, 1024 new tokens), twice: the
#           defaults (checksum verification of every sync) and trainer.verify_weight_sync_every=0. SYNTHETIC
#           data: the GSM8K files are not on the GPU machines (no network) and a step's cost depends on shapes,
#           not text, so benchmarks/gsm8k_recipe.py writes GSM8K-format train/test.jsonl of GSM8K's sizes and
#           prompt lengths (the recipe converts them with scripts/preprocess/gsm8k.py) and a random
#           Qwen2.5-0.5B-shaped model (e2e_vs_trl's builder, with Qwen's chat tokens). Overrides only for one GPU
#           and time: actor.parallel.world_size=1, trainer.steps=GSM8K_STEPS (3: the first is left out as
#           warm-up), data.val_size=8 (the evaluations before RL and after the last step), no checkpoints, resume
#           none; GSM8K_RUN_TIMEOUT (150 s a run); GSM8K_PROMPTS_PER_STEP=N (a multiple of 64: the mini-batch is
#           320 samples) shrinks the batch (say so with the numbers). A random policy samples to the 1024-token
#           limit mostly (the table's mean length). Table: steps measured, median step s, verification s per
#           step (sync/verify_s + the deferred collection sync/verify_deferred_s), its share. DEVICE=cpu: a smoke
#           run of the same path (tiny model, 2 prompts x 5 samples, 8 new tokens, the HF engine; ~45 s on 2
#           cores, so not in the suite): DEVICE=cpu PARTS=gsm8k OUT=/tmp/v bash scripts/gpu/verify.sh. Model and
#           data in /tmp/megarl-gsm8k; the runs' metrics in $OUT/gsm8k/{default,verify_off}: if the call is cut,
#           python -m benchmarks.gsm8k_recipe table OUT/gsm8k/default OUT/gsm8k/verify_off prints the table.
# Logs and JSON go to $OUT; a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/megarl-verify}; mkdir -p "$OUT"
PARTS=${PARTS:-kernel sync}
[[ ${DEVICE:-cuda} == cpu ]] || nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
if [[ " $PARTS " == *" kernel "* ]]; then
  timeout 300 python3 - > "$OUT/kernel.log" 2>&1 <<'PY'
import itertools, json, os, time, torch
from megarl.rollout.transports.flat_bucket import flat_layout, pack
from megarl.utils.checksum import ChecksumTable, weighted_sums

g = torch.Generator(device="cuda").manual_seed(0)
cases = []
for dtype in (torch.bfloat16, torch.float32, torch.uint8):
    x = (torch.randn(3000, 777, device="cuda", generator=g) * 100).to(dtype)
    flat = x.view(-1)
    for name, piece, offset, stride in (("whole", x, 0, None), ("rows", x[1000:2000], 12345, None),
                                        ("columns", x[:, 100:400], 7, 777), ("column shard", x[:, 400:], 0, None),
                                        ("1-d", x[5], 99, None), ("one program, unaligned", flat[3:3 + 32768], 0, None),
                                        ("a program and one, aligned", flat[16:16 + 32769], 1, None)):
        gpu = weighted_sums(piece, offset, stride)
        cpu = weighted_sums(piece.cpu(), offset, stride)  # the torch path (a CPU tensor)
        cases.append((str(dtype), name, torch.equal(gpu.cpu(), cpu)))
# many pieces of several widths in one table, flushed at once (as a sync's bucket and SGLang's parameters are)
pieces = [(torch.randn(n, 64, device="cuda", generator=g) * 50).to(d) for n, d in
          ((5, torch.bfloat16), (300, torch.float32), (7, torch.uint8), (1000, torch.bfloat16), (3, torch.float64))]
gpu, cpu = ChecksumTable(3, "cuda"), ChecksumTable(3, "cpu")
for i, p in enumerate(pieces):
    for table, q in ((gpu, p), (cpu, p.cpu())):
        table.add(i % 3, q, offset=17 * i)
        table.add(i % 3, q[:, 10:20], offset=3, target_stride=64)
cases.append(("mixed", "table", gpu.values() == cpu.values()))
# a bucket packed while it is summed (the sender's verified sync): whole tensors, TP=2 column blocks, a tensor every
# rank holds; a 7-element tensor puts the one after it off the 16-byte alignment (torch copies that one)
bucket = [(f"t{i}", p) for i, p in enumerate(pieces[:2] + [pieces[4], pieces[3][0, :7], pieces[3]])]
out = torch.zeros(flat_layout(bucket)[1], dtype=torch.uint8, device="cuda")
gpu, cpu = ChecksumTable(4, "cuda"), ChecksumTable(4, "cpu")
for table, moved in ((gpu, bucket), (cpu, [(n, t.cpu()) for n, t in bucket])):
    for i, (_, t) in enumerate(moved):
        if i == 1:  # column blocks of two ranks
            table.add(1, t[:, :32], 0, 64)
            table.add(2, t[:, 32:], 0, 32)
        else:
            table.add(0 if i != 3 else 3, t, offset=100 * i)
            if i == 0:
                table.add(2, t)  # a second rank's copy
reference = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in bucket])
cases.append(("packed", "bytes", torch.equal(pack(bucket, out, gpu).cpu(), reference.cpu())))
cases.append(("packed", "sums", gpu.values() == cpu.values()))
ok = all(c[2] for c in cases)
big = torch.empty(7_615_616_512 // 4, dtype=torch.bfloat16, device="cuda")  # a quarter of 7B at a time: 3.8 GB
big.view(torch.int16).random_()
copy = torch.empty_like(big)


def timed(step) -> float:
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(4):  # 7.6B elements in all
        step()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def fused():
    table = ChecksumTable(1, "cuda")
    table.add(0, big)
    table.flush([(big, copy)])


seconds = timed(lambda: weighted_sums(big))
copy_s, fused_s = timed(lambda: copy.copy_(big)), timed(fused)
print(json.dumps({"triton_equals_torch": ok, "cases": cases, "checksum_7b_elements_s": seconds,
                  "gb_per_s": 4 * big.numel() * 2 / seconds / 1e9, "copy_7b_elements_s": copy_s,
                  "copy_and_checksum_7b_elements_s": fused_s,
                  "copied_bitwise": torch.equal(copy.view(torch.int16), big.view(torch.int16))}))
if os.environ.get("KERNEL_SWEEP") == "1":  # the launch shape's candidates, each checked against the torch path
    from megarl.utils import checksum
    piece, reference = big[:1 << 22], weighted_sums(big[:1 << 22].cpu())
    for block, iters, warps in itertools.product((1024, 2048, 4096), (2, 4, 8, 16), (4, 8, 16)):
        if block // (32 * warps) < 8 or block * iters > 65536:  # a 16-byte load per thread at least
            continue
        checksum._LAUNCH = {False: (block, iters, warps), True: (block, iters, warps)}
        right = torch.equal(weighted_sums(piece).cpu(), reference)
        print(json.dumps({"sweep": [block, iters, warps], "right": right,
                          "checksum_s": round(timed(lambda: weighted_sums(big)), 5),
                          "copy_and_checksum_s": round(timed(fused), 5), "copy_s": round(copy_s, 5)}), flush=True)
PY
  rc=$?; status=$((status | rc)); grep -v '"sweep"' "$OUT/kernel.log" | tail -n 3
  grep '"sweep"' "$OUT/kernel.log" | cut -c1-160
fi
SYNC_MODELS=${SYNC_MODELS:-7b 0.5b}
if [[ " $PARTS " == *" sync "* && " $SYNC_MODELS " == *" 7b "* ]]; then
  profile=(); [[ "${PROFILE:-0}" == 1 ]] && profile=(--profile-dir "$OUT/profile_7b")
  timeout 260 python3 benchmarks/weight_sync.py sync --models qwen2.5-7b --formats persistent --bucket-mb 8192 \
    --weights released --trials 2 --checksums "${profile[@]}" --out "$OUT/sync_7b.json" \
    --log-dir "$OUT" > "$OUT/sync_7b.log" 2>&1
  status=$((status | $?)); tail -n 3 "$OUT/sync_7b.log"
fi
if [[ " $PARTS " == *" sync "* && " $SYNC_MODELS " == *" 0.5b "* ]]; then
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
if [[ " $PARTS " == *" gsm8k "* ]]; then
  # the model (1 GB) and data stay out of $OUT (what comes back): only the runs' logs and metrics go there
  gsm=/tmp/megarl-gsm8k; runs=$OUT/gsm8k; steps=${GSM8K_STEPS:-3}; smoke=()
  overrides=(actor.parallel.world_size=1 trainer.steps=$steps trainer.eval_every=0 data.val_size=8 trainer.save_every=0
             trainer.resume=none ${GSM8K_PROMPTS_PER_STEP:+data.prompts_per_step=$GSM8K_PROMPTS_PER_STEP})
  if [[ ${DEVICE:-cuda} == cpu ]]; then
    smoke=(--smoke)
    overrides+=(trainer.device=cpu rollout.engine=hf data.prompts_per_step=2 actor.mini_batch_size=10
                actor.micro_batch_size=5 rollout.max_new_tokens=8 data.val_size=2)
  fi
  # the recipe and scripts/launch.sh call `python`, which the GPU image may lack
  command -v python >/dev/null || { mkdir -p /tmp/gsm8k-bin; ln -sf "$(command -v python3)" /tmp/gsm8k-bin/python
                                    export PATH=/tmp/gsm8k-bin:$PATH; }
  echo "== gsm8k: SYNTHETIC GSM8K-format data and a random Qwen2.5-0.5B-shaped model (no GSM8K on this machine;" \
    "a step's cost depends on shapes, not text); overrides: ${overrides[*]}"
  rm -rf "$gsm" "$runs"; mkdir -p "$runs"
  timeout 120 python3 -m benchmarks.gsm8k_recipe prepare --out "$gsm" "${smoke[@]}" > "$OUT/gsm8k_prepare.log" 2>&1
  status=$((status | $?)); grep -v "shards" "$OUT/gsm8k_prepare.log" | tail -n 2
  for run in default verify_off; do
    extra=(); [[ $run == verify_off ]] && extra=(trainer.verify_weight_sync_every=0)
    start=$SECONDS
    MODEL=$gsm/model GSM8K_DIR=$gsm/raw GSM8K_PROMPTS=$gsm/prompts PYTHON=python3 MEGARL_LOG_DIR=$gsm/logs \
      timeout "${GSM8K_RUN_TIMEOUT:-150}" bash scripts/recipes/grpo_gsm8k_qwen2.5_0.5b.sh "${overrides[@]}" \
      trainer.output_dir="$runs/$run" "${extra[@]}" > "$OUT/gsm8k_$run.log" 2>&1
    rc=$?; status=$((status | rc))
    echo "gsm8k $run: exit $rc after $((SECONDS - start)) s (log $OUT/gsm8k_$run.log)"; tail -n 2 "$OUT/gsm8k_$run.log"
    [[ ${DEVICE:-cuda} == cpu ]] || nvidia-smi --query-gpu=memory.used --format=csv,noheader |
      sed 's/^/  GPU memory used now (a leftover server skews the next run): /'
  done
fi
python3 - "$OUT" <<'PY'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
kernel = out / "kernel.log"
if kernel.exists():
    lines = [l for l in kernel.read_text().splitlines() if l.startswith("{")]
    k = json.loads(lines[-1]) if lines else {}
    print(f"kernel: Triton == torch on every case: {k.get('triton_equals_torch')}; 7.6B bf16 elements in "
          f"{k.get('checksum_7b_elements_s', float('nan')):.4f} s ({k.get('gb_per_s', 0):.0f} GB/s); copied by torch "
          f"in {k.get('copy_7b_elements_s', float('nan')):.4f} s, copied and summed by one kernel in "
          f"{k.get('copy_and_checksum_7b_elements_s', float('nan')):.4f} s (bitwise: {k.get('copied_bitwise')})")
if any((out / f"{name}.json").exists() for name in ("sync_7b", "sync_0.5b")):
    print("\n| model | sync s (GB/s) | verified sync s | (a) verification on the sync's path s | (a) / sync | "
          "(b) deferred collection s: request / compare | (a)+(b) s | (a)+(b) / sync | (c) SGLang's sums, GPU s | "
          "sender checksums (host) s | first verification s (compiles) | params checked | flipped bit named | "
          "deep check s |\n|" + " --- |" * 14)
for name in ("sync_7b", "sync_0.5b"):
    path = out / f"{name}.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    rows = rows.get("results", []) if isinstance(rows, dict) else rows
    for r in rows:
        if "error" in r:
            print(f"| {r.get('model')} | ERROR {r['error'][:120]} |")
            continue
        if not r.get("checksums_verified"):
            continue
        f = lambda k, p=4: f"{r[k]:.{p}f}" if isinstance(r.get(k), (int, float)) else str(r.get(k, ""))
        sync = r["unverified_sync_s"]
        print(f"| {r['model']} | {f('unverified_sync_s')} ({r['bytes'] / sync / 1e9:.1f}) | {f('verified_sync_s')} | "
              f"**{f('checksum_verify_s')}** | **{r['checksum_verify_s'] / sync:.3f}** | "
              f"{f('deferred_collect_s')} / {f('deferred_compare_s')} | {f('verify_with_deferred_s')} | "
              f"{r['verify_with_deferred_s'] / sync:.3f} | {f('sglang_sums_gpu_s')} | {f('sender_checksum_s')} | "
              f"{f('first_verify_s')} | {r.get('parameters_checked', '')} | {r.get('flip_detected', '')} | "
              f"{f('verify_s') if r.get('verified') else ''} |")
for name in ("sync_7b", "sync_0.5b"):  # where a verified sync's extra time goes, and what the profile saw
    path = out / f"{name}.json"
    rows = json.loads(path.read_text()).get("results", []) if path.exists() else []
    for r in (r for r in rows if r.get("checksums_verified")):
        if "paired_verify_s" in r:
            q = r["paired_verify_quartiles_s"]
            print(f"{r['model']}: each round's own difference (verified - unverified), median "
                  f"{r['paired_verify_s']:.4f} s ({r['paired_verify_s'] / r['unverified_sync_s']:.3f} of the sync), "
                  f"quartiles {q[0]:.4f} / {q[1]:.4f} s over {len(r['unverified_trials_s'])} rounds")
        print(f"{r['model']}: pack s verified {r['verified_pack_s']:.4f} / not {r['unverified_pack_s']:.4f}; posts s "
              f"verified {r['verified_posts_s']:.4f} / not {r['unverified_posts_s']:.4f}; SGLang's loads s verified "
              f"{r.get('verified_server_load_s', float('nan')):.4f} / not "
              f"{r.get('unverified_server_load_s', float('nan')):.4f}; the collection inside SGLang's TP worker "
              f"(summing, writing them) {r.get('sglang_collect_inside_s') or float('nan'):.4f}; trials s unverified "
              f"{r['unverified_trials_s']}, verified {r['verified_trials_s']}")
        if "profiled_sync_s" in r or "profile_error" in r:
            print(f"  profiled verified sync {r.get('profiled_sync_s', float('nan')):.4f} s "
                  f"{r.get('profile_error', '')}; host s (calls) of waits, allocations and phases:")
            for key, v in sorted(r.get("profiled_host_calls", {}).items(), key=lambda kv: -kv[1]["host_s"]):
                print(f"    {key}: {v['host_s']:.4f} ({v['calls']})")
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
    deferred = [r["sync/verify_deferred_s"] for r in steps if "sync/verify_deferred_s" in r]
    if deferred:  # the default check's collection, in the step after a verified sync, before its update
        print(f"{name}: deferred collection of SGLang's checksums, median {statistics.median(deferred):.4f} s "
              f"(steps {[r['step'] for r in steps if 'sync/verify_deferred_s' in r]})")
if (out / "gsm8k").is_dir():  # last: the GSM8K recipe's table
    from benchmarks.gsm8k_recipe import table
    print("\n" + table([out / "gsm8k" / "default", out / "gsm8k" / "verify_off"]))
print(f"verify.sh parts [{' '.join(sys.argv[2:]) or 'see header'}] done")
PY
echo "== verify.sh [$PARTS] exit $status"
exit $status
