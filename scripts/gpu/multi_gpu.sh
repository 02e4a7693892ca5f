#!/usr/bin/env bash
# Multi-GPU runs on 2, 4 or 8 GPUs (the phases adapt to the count), after the bundle's install.sh
# (../shared/device/README.md). Logs, SGLang server log tails and JSON go to $OUT; a short table is printed last and
# kept in $OUT/table.md; on the GPU (PACK=1) the rest goes into $OUT/files.tgz (a lent machine returns 8 files).
#   train    benchmarks/engine_throughput.py, engine vs bare megatron-core, the ~1.4B Qwen2 shape (bf16, packed
#            sequences <= 2048, 64 per step): TP=1 x DP=N against TP=2 x PP=2 (x DP=N/4) on 4 or 8 GPUs, against
#            TP=2 on 2; tokens/s and MFU (989 TFLOP/s peak per GPU)                      (~1.5 min per layout)
#   reshard  benchmarks/multi_gpu.py reshard on 4 GPUs: the policy trained at TP=2 x PP=2 (one step), synced into
#            colocated SGLang servers at generation TP=1 x DP=4 (four servers) and TP=2 x DP=2 (two), resharded
#            over NCCL and posted by CUDA IPC; verified (resharded = megatron's export; SGLang holds what was
#            sent); sync seconds and GB/s. On 2 GPUs: TP=2 -> TP=1 x DP=2 and TP=2, at TP=2 also the sharded
#            delivery (each rank posts its own TP shard's buffer)                      (~5 min; the first
#            SGLang start on a fresh machine JIT-compiles for ~110 s)
#   disagg   benchmarks/multi_gpu.py disagg: 2 GPUs train (TP=2), 2 serve (one TP=2 server), weights by NCCL
#            broadcast; on 2 GPUs 1 + 1; verified, sync seconds and GB/s                 (~2-3 min)
#   moe      benchmarks/multi_gpu.py moe: a random Qwen3-MoE with 8 experts at EP=N vs EP=1 (fp32, bf16) and
#            transformers                                                               (~1 min)
# Expert parallelism in GRPO, `python -m megarl.train` on the quickstart task with a DeepSeek-V3-shaped
# policy (benchmarks/deepseek_sglang.py build, EP_SHAPE "layers hidden heads experts moe_intermediate intermediate
# dense": MLA with DeepSeek-V3's own head dimensions, EP_SHAPE's routed experts, a shared one, dense first layers),
# 10 SFT steps then 3 GRPO steps, colocated with ONE SGLang server of TP=EP (EP = min(GPUs, 4)), every sync verified by
# checksums inside SGLang; per run, for each delivery of EP_DELIVERIES (default "full sharded": whole HF tensors from
# rank 0; each rank its own SGLang rank's shard, the resharder moving expert rows out of the EP layout):
#   ep       the policy at TP=1 x EP=N (each GPU 1/N of the routed experts) into the server at --ep-size 1 (every
#            SGLang rank holds its TP rows of every expert)                  (~3-4 min a delivery; the first SGLang
#            start of a DeepSeek shape on a fresh machine JIT-compiles its kernels for ~2 min more)
#   sglang_ep  the same into the server at --ep-size N (rollout.sglang_args, with --moe-runner-backend triton: SGLang's
#            FusedMoE without DeepEP, each rank whole experts of its EP slice; sharded delivery then moves nothing
#            between the training ranks)                                                (~3-4 min a delivery)
#   ep_pp    on 4+ GPUs: the policy at TP=1 x EP=2 x PP=2 with uneven stages (the last holds one decoder layer, the
#            output layer's stage; the first the rest, dense and MoE layers) into two colocated SGLang servers of TP=2
#            (each GPU pair one server); expert rows move between the EP ranks of each stage and the stages
#            broadcast their layers to the servers                                      (~3-4 min a delivery)
#   sglang_ep_pp  the same into servers of TP=2 at --ep-size 2                          (~3-4 min a delivery)
#   hosts    the policy on GPU 0 (TP=1 x EP=1), SGLang servers disaggregated on server hosts (rollout.sglang_gpus_per_host
#            =1: a Ray actor per server GPU starts its server, as on other nodes; megarl/rollout/server_host.py): two
#            servers on 3+ GPUs, one on 2; full delivery over NCCL, checksums taken by each host       (~3-4 min)
#   nodes    on 4 GPUs, two Ray nodes on this machine (scripts/ray_cluster.sh, GPUs 0-1 and 2-3): the policy at TP=1 x
#            DP=4 over both, colocated SGLang servers of TP=2 started by a server host on each node; per delivery of
#            EP_DELIVERIES: full, rank 0 posts to its node's server by CUDA IPC and broadcasts to the other's over NCCL;
#            sharded, each node's two ranks post their rows to their node's server by CUDA IPC; checksums (~4 min each)
#   Run each as its own call (<= ~9 min): PHASES=ep, then PHASES=sglang_ep (on 4 GPUs also PHASES=ep_pp, then
#   PHASES=sglang_ep_pp; EP_DELIVERIES=sharded alone halves a call). GPU only: hosts (the CPU has no SGLang).
# The GRPO table gives per run: syncs verified, the best sync's seconds, the bytes per rank (the most received and
# sent resharding among training ranks, the least and most an SGLang rank received) measured beside the planner's
# for the same layouts (megarl.reshard.plan; "as planned": every rank's counts equal), the log-prob gap (mean
# |rollout - Megatron| log-prob per token: rollout/logprob_abs_diff, mean and worst step), expert load, reward.
# Asynchronous GRPO disaggregated against synchronous, in a call of its own (not in the default PHASES):
#   async    scripts/gpu/async_disagg.sh (its header says what runs; LENGTHS=fixed|tail, RUNS= a few of them a call):
#            colocated sync, disaggregated sync, one_step_off, async at max_staleness 1 and 4, a 1.5B Qwen2.5 shape;
#            on 4+ GPUs without LENGTHS both lengths side by side, each on half the GPUs (results in OUT/async_<lengths>);
#            LANES="lengths:runs ..." picks the lanes (each an equal share of the GPUs, >= 2), e.g. two of the fixed
#            workload's runs at once on 4 GPUs: LANES="fixed:disagg_sync fixed:disagg_one_step_off"; the tables merge
#            every lane of a length setting;
#            tokens/s/GPU, staleness, speed-ups against disaggregated sync beside its bound; DEVICE=cpu: its smoke
# PHASES: default "train reshard disagg moe" on 4+ GPUs, which is two calls' worth: run PHASES="train moe"
# then PHASES="reshard disagg" (each <= ~9 min). Default on 2 GPUs: "train disagg moe" (PHASES=reshard: a
# second call). Each phase has its own time limit, cut to what is left of BUDGET seconds (default 560);
# a phase that no longer fits is skipped and says so (then run it alone: PHASES=disagg).
# DEVICE=cpu: the same phases through gloo at tiny sizes, GPUS processes (default 4): the smoke test. There the
# SGLang servers are stand-ins: the reshard and disagg phases use the tests' fake SGLang server, and the GRPO
# phases (ep, sglang_ep) megarl's transformers rollout engine (rollout.engine=hf: no --ep-size, the same
# deliveries into generation TP=N, the same verification and byte counts), with a tiny DeepSeek-V3 (EP_SHAPE
# "2 64 4 8 32 128 1", with 3 layers when an ep_pp phase runs: 2 uneven stages need 3; 2 SFT + 2 GRPO steps). The
# smoke run of the EP phases on 2 cores (~3 min; tests/launch/test_multi_gpu_smoke.py runs PHASES=ep
# EP_DELIVERIES=sharded on 2 processes and PHASES=ep_pp on 4):
#   DEVICE=cpu GPUS=2 PHASES="ep sglang_ep" OUT=/tmp/multi-gpu-smoke scripts/gpu/multi_gpu.sh
#   DEVICE=cpu GPUS=4 PHASES="ep_pp" EP_DELIVERIES=sharded OUT=/tmp/multi-gpu-smoke scripts/gpu/multi_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false NCCL_NVLS_ENABLE=0 NCCL_CUMEM_ENABLE=0 OMP_NUM_THREADS=1
export RAY_USAGE_STATS_ENABLED=0
OUT=${OUT:-/tmp/megarl-multi-gpu}; mkdir -p "$OUT/server_logs"
BUDGET=${BUDGET:-560}
EP_DELIVERIES=${EP_DELIVERIES:-full sharded}
if [ "$DEVICE" = cpu ]; then
  export PYTHONPATH=$PWD
  GPUS=${GPUS:-4}
  echo "cpu (gloo), $GPUS processes" > "$OUT/gpu.txt"
  TINY="--device cpu --size tiny --seq 64"
  TRAIN_ARGS="--device cpu --size tiny --seq 64 --sequences 8 --max-tokens 128 --steps 1 --warmup 1"
  MOE_ARGS="--device cpu"
  [[ " ${PHASES:-} " == *" ep_pp "* || " ${PHASES:-} " == *" sglang_ep_pp "* ]] && layers=3 || layers=2
  EP_SHAPE=${EP_SHAPE:-"$layers 64 4 8 32 128 1"}
  ROLLOUT="rollout.engine=hf"  # no SGLang on the CPU: the transformers engine in its place
  SERVER="the transformers engine in SGLang's place (generation TP=EP)"; SERVER_EP="$SERVER"
  GRPO_ARGS="sft.steps=2 sft.batch_size=4 data.prompts_per_step=2 rollout.n_samples=2 data.val_size=2
    actor.micro_batch_size=8 trainer.steps=2 trainer.eval_every=2"
else
  export PYTHONPATH=/tmp/site:$PWD
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  source scripts/gpu/gpu_free.sh  # GPU memory in use at start; loud warning above ~1 GB
  GPUS=${GPUS:-$(nvidia-smi -L | wc -l)}
  TINY=""
  TRAIN_ARGS=""
  MOE_ARGS=""
  EP_SHAPE=${EP_SHAPE:-"4 1024 16 16 512 2816 1"}
  ROLLOUT="rollout.engine=sglang"
  SERVER="1 SGLang server TP=EP"; SERVER_EP="1 SGLang server TP=EP --ep-size EP"
  GRPO_ARGS="sft.steps=10 sft.lr=1e-4 sft.batch_size=16 data.prompts_per_step=8 rollout.n_samples=4 data.val_size=8
    actor.micro_batch_size=16 actor.optim.lr=2e-5 trainer.steps=3 trainer.eval_every=3 trainer.sync_bucket_mb=256
    trainer.cpus_per_rank=1"
fi
EP=$(( GPUS < 4 ? GPUS : 4 ))
if [ "$GPUS" -ge 4 ]; then PHASES=${PHASES:-train reshard disagg moe}; else PHASES=${PHASES:-train disagg moe}; fi
if [ "$GPUS" -lt 2 ]; then echo "multi_gpu.sh needs 2, 4 or 8 GPUs (found $GPUS)"; exit 2; fi
M="benchmarks/multi_gpu.py"
LOGS="--log-dir $OUT/server_logs"
status=0
phase() { [[ " $PHASES " == *" $1 "* ]]; }
fits() {  # name, limit in seconds: sets LIMIT to the limit cut to what is left of BUDGET; false if under 45 s
  local left=$(( BUDGET - SECONDS - 10 ))
  LIMIT=$2; [ "$LIMIT" -gt "$left" ] && LIMIT=$left
  if [ "$LIMIT" -lt 45 ]; then
    echo "== $1: SKIPPED, ${left}s left of BUDGET=$BUDGET"; status=1; return 1
  fi
}
launch() {  # name, limit in seconds, processes, script and arguments...
  local name=$1 procs=$3 limit; fits "$1" "$2" || return; limit=$LIMIT; shift 3
  echo "== $name ($procs processes, limit ${limit}s, at ${SECONDS}s)"
  local start=$SECONDS
  timeout -k 15 "$limit" $PY -m torch.distributed.run --standalone --nproc-per-node "$procs" "$@" \
    > "$OUT/$name.log" 2>&1
  local rc=$?
  if [ "$rc" != 0 ] && [ $(( SECONDS - start )) -lt 30 ]; then  # failed at start-up (a port taken?): once more
    mv "$OUT/$name.log" "$OUT/$name.first_try.log"; echo "   exit $rc within 30 s: trying again"
    timeout -k 15 "$limit" $PY -m torch.distributed.run --standalone --nproc-per-node "$procs" "$@" \
      > "$OUT/$name.log" 2>&1
    rc=$?
  fi
  echo "   exit $rc after ${SECONDS}s total"; grep -v -i "warn" "$OUT/$name.log" | tail -n 4
  status=$(( status | (rc != 0) ))
}
grpo() {  # name, limit in seconds, what it runs (for the table), megarl.train overrides...: GRPO with EP_MODEL
  local name=$1 about=$3 limit run=/tmp/megarl-multi-gpu-$1-$$; fits "$1" "$2" || return; limit=$LIMIT; shift 3
  echo "== $name (python -m megarl.train, limit ${limit}s, at ${SECONDS}s): $about"
  echo "$about" > "$OUT/$name.about"
  rm -rf "$run"
  # shellcheck disable=SC2086  # GRPO_ARGS: one override a word
  timeout -k 30 "$limit" $PY -m megarl.train --config configs/quickstart.yaml model.path="$EP_MODEL" \
    trainer.device="$DEVICE" trainer.output_dir="$run" trainer.loggers=jsonl trainer.verify_weight_sync_every=1 \
    $GRPO_ARGS "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  cp "$(ls -d "$run"/logs/*/ 2>/dev/null | tail -1)metrics.jsonl" "$OUT/${name}_metrics.jsonl" 2>/dev/null
  for f in "$run"/sglang_*.log; do [ -f "$f" ] && tail -n 60 "$f" > "$OUT/server_logs/${name}_$(basename "$f").tail"; done
  rm -rf "$run"
  echo "   exit $rc after ${SECONDS}s total"; grep -v -i "warn" "$OUT/$name.log" | tail -n 4
  status=$(( status | (rc != 0) ))
}
if phase ep || phase sglang_ep || phase ep_pp || phase sglang_ep_pp || phase hosts || phase nodes; then  # the DeepSeek-V3-shaped policy the GRPO
  # phases train
  EP_MODEL=/tmp/megarl-multi-gpu-ep-model-$$
  read -r layers hidden heads experts moe inter dense <<< "$EP_SHAPE"
  if ! $PY benchmarks/deepseek_sglang.py build --out "$OUT/ep_model.json" --model-dir "$EP_MODEL" --layers "$layers" \
      --hidden "$hidden" --heads "$heads" --experts "$experts" --moe-intermediate "$moe" --intermediate "$inter" \
      --dense "$dense" > "$OUT/ep_model.log" 2>&1; then
    echo "== building the EP policy ($EP_SHAPE) failed: no GRPO phases"; tail -n 20 "$OUT/ep_model.log"; status=1
    EP_MODEL=""
  fi
fi
if phase ep && [ -n "$EP_MODEL" ]; then
  for delivery in $EP_DELIVERIES; do
    grpo "ep_tp1_ep${EP}_$delivery" 280 "policy TP=1 EP=$EP; ${SERVER//EP/$EP}; $delivery delivery; checksums" \
      actor.parallel.world_size=$EP actor.parallel.tp=1 actor.parallel.ep=$EP $ROLLOUT rollout.sglang_tp=$EP \
      rollout.weight_delivery="$delivery"
  done
fi
if phase sglang_ep && [ -n "$EP_MODEL" ]; then
  # SGLang's --ep-size on the GPU, with its triton MoE runner (no DeepEP: not in the bundle); the CPU's transformers
  # engine takes no SGLang arguments
  [ "$DEVICE" = cpu ] && SGLANG_EP="" || SGLANG_EP="rollout.sglang_args=[--ep-size,$EP,--moe-runner-backend,triton]"
  for delivery in $EP_DELIVERIES; do
    grpo "sglang_ep_tp1_ep${EP}_$delivery" 280 "policy TP=1 EP=$EP; ${SERVER_EP//EP/$EP}; $delivery delivery; checksums" \
      actor.parallel.world_size=$EP actor.parallel.tp=1 actor.parallel.ep=$EP $ROLLOUT rollout.sglang_tp=$EP \
      $SGLANG_EP rollout.weight_delivery="$delivery"
  done
fi
if { phase ep_pp || phase sglang_ep_pp; } && [ -n "$EP_MODEL" ]; then
  # EP=2 x PP=2 on 4 GPUs, the last stage one decoder layer (uneven: the first holds the rest); two servers of TP=2
  UNEVEN="actor.parallel.pp=2 actor.parallel.pp_last_stage_layers=1"
  [ "$DEVICE" = cpu ] && SGLANG_EP="" || SGLANG_EP="rollout.sglang_args=[--ep-size,2,--moe-runner-backend,triton]"
  for name in ep_pp sglang_ep_pp; do
    phase $name || continue
    if [ "$GPUS" -lt 4 ]; then echo "== $name: SKIPPED, needs 4 GPUs (found $GPUS)"; status=1; continue; fi
    if [ $name = ep_pp ]; then server="2 SGLang servers TP=2" extra=""
    else server="2 SGLang servers TP=2 --ep-size 2" extra=$SGLANG_EP; fi
    [ "$DEVICE" = cpu ] && server="the transformers engine in SGLang's place (2 of generation TP=2)"
    for delivery in $EP_DELIVERIES; do
      # shellcheck disable=SC2086  # UNEVEN, extra: one override a word
      grpo "${name}_ep2_pp2_$delivery" 280 "policy TP=1 EP=2 PP=2, stages $(( ${EP_SHAPE%% *} - 1 ))+1 layers; \
$server; $delivery delivery; checksums" actor.parallel.world_size=4 actor.parallel.tp=1 actor.parallel.ep=2 $UNEVEN \
        $ROLLOUT rollout.sglang_tp=2 $extra rollout.weight_delivery="$delivery"
    done
  done
fi
if phase hosts && [ -n "$EP_MODEL" ]; then
  if [ "$DEVICE" = cpu ]; then echo "== hosts: SKIPPED on the CPU (server hosts start SGLang servers)"
  else
    servers=$(( GPUS > 2 ? 2 : 1 ))
    grpo "hosts_${servers}x1" 280 "policy on 1 GPU; $servers SGLang server(s) TP=1 on server hosts of 1 GPU; full \
delivery; checksums" actor.parallel.world_size=1 actor.parallel.tp=1 $ROLLOUT rollout.sglang_gpus=$servers rollout.sglang_gpus_per_host=1
  fi
fi
if phase nodes && [ -n "$EP_MODEL" ]; then
  if [ "$DEVICE" = cpu ] || [ "$GPUS" -lt 4 ]; then echo "== nodes: SKIPPED (4 GPUs and SGLang)"; status=1
  else  # two Ray nodes of 2 GPUs each on this machine, as two machines would be
    ray_dir=/tmp/megarl-nodes-$$; mkdir -p "$ray_dir"; ray_port=$(( 20000 + $$ % 20000 ))
    export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$ray_dir/token MEGARL_DASHBOARD_PORT=$(( ray_port + 1 ))
    if ip=$(bash -c 'source scripts/env.sh && megarl_node_ip') &&
       CUDA_VISIBLE_DEVICES=0,1 bash scripts/ray_cluster.sh head --ip "$ip" --port "$ray_port" --num-gpus 2 \
         --temp-dir "$ray_dir/h" > "$OUT/nodes_ray.log" 2>&1 &&
       CUDA_VISIBLE_DEVICES=2,3 bash scripts/ray_cluster.sh worker --address "$ip:$ray_port" --num-gpus 2 \
         --temp-dir "$ray_dir/w" >> "$OUT/nodes_ray.log" 2>&1 &&
       bash scripts/ray_cluster.sh wait --address "$ip:$ray_port" --nodes 2 --gpus 4 --timeout 60 >> "$OUT/nodes_ray.log" 2>&1
    then
      for delivery in $EP_DELIVERIES; do  # full: rank 0 by IPC to its node, NCCL to the other; sharded: IPC per node
        grpo "nodes_2x2_$delivery" 300 "policy TP=1 x DP=4 on 2 Ray nodes; a TP=2 server per node (host); \
$delivery delivery; checksums" actor.parallel.world_size=4 actor.parallel.tp=1 $ROLLOUT rollout.sglang_tp=2 \
          trainer.ray_address="$ip:$ray_port" rollout.weight_delivery="$delivery"
      done
    else echo "== nodes: the two Ray nodes did not start"; tail -n 20 "$OUT/nodes_ray.log"; status=1; fi
    ray stop --force > /dev/null 2>&1; rm -rf "$ray_dir"
  fi
fi
[ -n "${EP_MODEL:-}" ] && rm -rf "$EP_MODEL"
T=benchmarks/engine_throughput.py
if phase train; then
  launch "train_tp1_dp$GPUS" 210 "$GPUS" $T --tp 1 $TRAIN_ARGS --out "$OUT/train_tp1_dp$GPUS.json"
  if [ "$GPUS" -ge 4 ]; then
    launch "train_tp2_pp2_dp$((GPUS / 4))" 210 "$GPUS" $T --tp 2 --pp 2 $TRAIN_ARGS \
      --out "$OUT/train_tp2_pp2_dp$((GPUS / 4)).json"
  else
    launch train_tp2_dp1 210 2 $T --tp 2 $TRAIN_ARGS --out "$OUT/train_tp2_dp1.json"
  fi
fi
if phase moe; then
  launch "moe_ep$GPUS" 120 "$GPUS" $M moe $MOE_ARGS --out "$OUT/moe_ep$GPUS.json"
fi
if phase reshard; then
  if [ "$GPUS" -ge 4 ]; then
    launch reshard_tp2_pp2 380 4 $M reshard --tp 2 --pp 2 --gen-tp 1 2 $TINY $LOGS --out "$OUT/reshard_tp2_pp2.json"
  else
    launch reshard_tp2 380 2 $M reshard --tp 2 --gen-tp 1 2 --delivery full sharded $TINY $LOGS \
      --out "$OUT/reshard_tp2.json"
  fi
fi
if phase disagg; then
  if [ "$GPUS" -ge 4 ]; then
    launch disagg_2_2 170 2 $M disagg --tp 2 --server-tp 2 $TINY $LOGS --out "$OUT/disagg_2_2.json"
  else
    launch disagg_1_1 170 1 $M disagg --tp 1 --server-tp 1 $TINY $LOGS --out "$OUT/disagg_1_1.json"
  fi
fi
if phase async && fits async "$([ "$DEVICE" = cpu ] && echo 1500 || echo 540)"; then  # async_disagg.sh does the work
  # On 4+ GPUs with no LENGTHS given, both length settings in one call, side by side: each on half the GPUs (its own
  # CUDA_VISIBLE_DEVICES, Ray, servers and results), so a comparison never crosses GPU pairs. LANES ("lengths:runs",
  # space-separated) picks other lanes, each an equal share of the GPUs. Else LENGTHS (default fixed) on every GPU.
  if [ -n "${LANES:-}" ]; then lanes=$LANES
  elif [ "$GPUS" -ge 4 ] && [ -z "${LENGTHS:-}" ]; then lanes="fixed:${RUNS:-} tail:${RUNS:-}"
  else lanes="${LENGTHS:-fixed}:${RUNS:-}"; fi
  read -ra lane_list <<< "$lanes"; each=$(( GPUS / ${#lane_list[@]} ))
  echo "== async (scripts/gpu/async_disagg.sh, lanes: $lanes, $each GPUs each, limit ${LIMIT}s, at ${SECONDS}s)"
  if [ "$each" -lt 2 ]; then echo "   SKIPPED: ${#lane_list[@]} lanes of $GPUS GPUs (a lane needs 2)"; status=1
    lane_list=(); fi
  first=0; pids=()
  for lane in "${lane_list[@]}"; do
    lengths=${lane%%:*} runs=${lane#*:} dir=async_${lane%%:*}
    [ -e "$OUT/$dir" ] && dir=${dir}_$(( first / each ))  # a second lane of the same lengths
    mkdir -p "$OUT/$dir"
    devices=$(seq -s, "$first" $(( first + each - 1 ))); first=$(( first + each ))
    # shellcheck disable=SC2046  # one assignment a word
    env $([ "$DEVICE" = cpu ] || [ "$each" = "$GPUS" ] || echo "CUDA_VISIBLE_DEVICES=$devices") DEVICE="$DEVICE" \
      GPUS="$each" LENGTHS="$lengths" RUNS="$runs" OUT="$OUT/$dir" BUDGET=$(( LIMIT - 20 )) timeout -k 30 "$LIMIT" \
      bash scripts/gpu/async_disagg.sh > "$OUT/$dir.log" 2>&1 &
    pids+=("$!")
  done
  for pid in "${pids[@]}"; do wait "$pid"; rc=$?; status=$(( status | (rc != 0) )); done
  echo "   exit $status after ${SECONDS}s total"
fi
# keep only the server logs' tails (the files that come back are limited)
for f in "$OUT"/server_logs/*.log; do [ -f "$f" ] && tail -n 60 "$f" > "$f.tail" && rm "$f"; done
{
echo "== multi-GPU runs [$PHASES] on $GPUS x $(head -1 "$OUT/gpu.txt"), ${SECONDS}s"
$PY - "$OUT" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
def load(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        print(f"{path.name}: unreadable ({e})"); return None
pct = lambda x: f"{100 * x:.1f}%" if x is not None else "-"
train = sorted(out.glob("train_*.json"))
if train:
    print("| training layout | engine tok/s | tok/s/GPU | engine MFU | bare MFU | engine/bare | peak GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for p in train:
        d = load(p) or {}
        e, b, lay = d.get("engine", {}), d.get("bare", {}), d.get("layout", {})
        print(f"| TP={lay.get('tp')} PP={lay.get('pp')} DP={lay.get('dp')} | {e.get('tokens_per_s', 0):,.0f} "
              f"| {e.get('tokens_per_s_per_gpu', 0):,.0f} | {pct(e.get('mfu'))} | {pct(b.get('mfu'))} "
              f"| {pct(d.get('engine_over_bare'))} | {e.get('peak_memory_gib', float('nan')):.1f} |")
rows = [r for p in sorted(out.glob("*.json")) if not p.name.startswith("train_") for r in (load(p) or {}).get("results", [])]
sync = [r for r in rows if r["part"] in ("reshard", "disagg")]
if sync:
    print("\n| sync | training | generation | GB per server | total s (trials) | GB/s per server | GB/s all | verified |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in sync:
        t = r["train"]
        train = f"TP={t['tp']} PP={t['pp']} DP={t['dp']}"
        gen = (f"TP={r['gen_tp']} x DP={r['gen_dp']} {r.get('delivery', '')}" if r["part"] == "reshard"
               else f"1 server TP={r['server_tp']} on other GPUs")
        if "error" in r or "total_s" not in r:
            print(f"| {r['part']} | {train} | {gen} | ERROR {r.get('error', '')[:120]} |"); continue
        nbytes = r.get("bytes_per_server", r.get("bytes"))
        trials = ", ".join(f"{s:.2f}" for s in r["trials_total_s"])
        print(f"| {r['part']} | {train} | {gen} | {nbytes / 1e9:.2f} | {r['total_s']:.3f} ({trials}) "
              f"| {nbytes / r['total_s'] / 1e9:.1f} | {r.get('gb_per_s_total', r.get('gb_per_s')):.1f} "
              f"| {r['verified']} {'; '.join(r.get('failures', []))[:200]} |")
grpo = sorted(out.glob("*_metrics.jsonl"))
if grpo:
    mb = lambda r, key: f"{r[key] / 1e6:.2f}" if key in r else "-"
    print("\n| GRPO run | what | RL steps | syncs verified | GB a sync | best sync s (GB/s) | reshard MB recv/send, most "
          "(planned) | SGLang rank MB least-most (planned) | as planned | log-prob gap mean (worst) "
          "| expert load max/mean | held-out reward |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for p in grpo:
        name = p.name[:-len("_metrics.jsonl")]
        about = (out / f"{name}.about").read_text().strip() if (out / f"{name}.about").exists() else ""
        records = [json.loads(line) for line in p.read_text().splitlines()]
        steps = [r for r in records if "train/loss" in r]
        evals = [r["val/reward"] for r in records if "val/reward" in r]
        syncs = [r for r in records if "sync/seconds" in r]
        best = min(syncs, key=lambda r: r["sync/seconds"], default=None)
        load = max((r.get("train/expert_load/max_over_mean", 0) for r in steps), default=0)
        verified = f"{sum(r.get('sync/verified') == 1.0 for r in syncs)}/{len(syncs)}"
        sync = (f"{best['sync/bytes'] / 1e9:.3f} | {best['sync/seconds']:.3f} ({best['sync/gb_per_s']:.1f})" if best
                else "- | -")
        last = syncs[-1] if syncs else {}
        traffic = (f"{mb(last, 'sync/reshard_recv_max')}/{mb(last, 'sync/reshard_send_max')} "
                   f"({mb(last, 'sync/plan_reshard_recv_max')}/{mb(last, 'sync/plan_reshard_send_max')}) | "
                   f"{mb(last, 'sync/server_recv_min')}-{mb(last, 'sync/server_recv_max')} "
                   f"({mb(last, 'sync/plan_server_recv_min')}-{mb(last, 'sync/plan_server_recv_max')})")
        planned = [r.get("sync/traffic_as_planned") for r in syncs]
        as_planned = f"{sum(x == 1.0 for x in planned)}/{len(planned)}"
        gaps = [r["rollout/logprob_abs_diff"] for r in records if "rollout/logprob_abs_diff" in r]
        gap = f"{sum(gaps) / len(gaps):.3g} ({max(gaps):.3g})" if gaps else "-"
        print(f"| {name} | {about} | {len(steps)} | {verified} | {sync} | {traffic} | {as_planned} | {gap} "
              f"| {load:.2f} | {' -> '.join(f'{v:.3f}' for v in evals)} |")
moe = [r for r in rows if r["part"] == "moe"]
if moe:
    print("\n| MoE | experts | EP | max abs diff vs EP=1 | EP=1 vs transformers | tolerance | ok |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in moe:
        hf = r.get("max_abs_diff_ep1_vs_transformers")
        print(f"| {r['precision']} | {r['experts']} | {r['ep']} | {r['max_abs_diff_vs_ep1']:.3g} "
              f"| {'-' if hf is None else f'{hf:.3g}'} | {r['atol']} | {r['ok']} |")
PY
for lengths in fixed tail; do  # every lane's runs of a length setting in one table (speed-ups across lanes)
  results=("$OUT"/async_"$lengths"*/async_grpo.json)
  [ -f "${results[0]}" ] || continue
  echo "== async GRPO, disaggregated ($lengths), lanes: $(for r in "${results[@]}"; do basename "$(dirname "$r")"; done | xargs)"
  $PY -m benchmarks.async_grpo --report "${results[@]}"
done
} | tee "$OUT/table.md"
# The lent GPU machine returns 8 files at most: there (PACK=1, the GPU's default) everything but the table and the GPU's
# name goes into OUT/files.tgz
if [ "${PACK:-$([ "$DEVICE" = cpu ] && echo 0 || echo 1)}" = 1 ]; then
  (cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name files.tgz ! -name table.md ! -name gpu.txt -printf '%P\n' \
    | tar -czf files.tgz -T - --remove-files) && echo "(the other files: $OUT/files.tgz)"
fi
echo "== multi_gpu.sh: exit $status"
exit $status
