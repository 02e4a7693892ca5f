"""Layout planner: per-GPU memory and per-rank weight-sync traffic, on paper, before asking for GPUs.

    python -m megarl.plan --model deepseek-v3 --train tp=8,pp=16,dp=2 --gen tp=8

--train also takes cp=N (context parallelism): activations divided by CP; CP ranks hold the same weights as
DP ones, so the distributed optimizer shards over CP x DP and the weight sync counts them as replicas.

--model takes a HF config.json path or a name in configs/models/. Memory per training rank: bf16
weights, fp32 grads (megatron's grad_reduce_in_fp32), Adam (fp32 master copy + two moments: 12 B per
parameter, divided over DP with --distributed-optimizer), and an activation estimate (Korthikanti et
al. 2022, no recomputation, attention scores not stored: s*b*h*(10 + 24/TP) bytes per layer and
micro-batch, with PP micro-batches in flight on the first stage of 1F1B; dense-MLP sizing, so MoE
layers are rough). Per generation rank: its TP shard of the weights and the KV cache for --kv-tokens.
Sync traffic comes from megarl.reshard's own transfer plan, for both deliveries: "full"
(whole HF tensors to every rank, which the engine slices) and "sharded" (only the generation TP
shard, minus the rows the rank already holds).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megarl.reshard.inventory import TensorSpec, hf_inventory
from megarl.reshard.layout import DELIVERIES, TrainLayout, generation_ranks
from megarl.reshard.transfers import transfer_bytes

MODELS_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"
GiB = 1 << 30


def load_model_config(model: str) -> dict:
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        path = MODELS_DIR / f"{model}.json"
    if not path.exists():
        known = sorted(p.stem for p in MODELS_DIR.glob("*.json"))
        raise FileNotFoundError(f"--model {model}: not a config.json path nor a name in {MODELS_DIR} ({known})")
    return json.loads(path.read_text())


def parse_layout(text: str, keys: tuple[str, ...]) -> dict[str, int]:
    """'tp=2,pp=2,dp=4' -> {'tp': 2, 'pp': 2, 'dp': 4}; missing keys default to 1."""
    layout = dict.fromkeys(keys, 1)
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key not in keys or not value.isdigit() or int(value) < 1:
            raise ValueError(f"bad layout entry {part!r} in {text!r}: expected {', '.join(k + '=N' for k in keys)}")
        layout[key] = int(value)
    return layout


def _shard_numel(specs: list[TensorSpec], tp: int, tp_rank: int) -> int:
    total = 0
    for s in specs:
        lo, hi = s.rows(tp, tp_rank)
        total += (hi - lo) * s.row_numel
    return total


def kv_bytes_per_token(hf: dict, gen_tp: int, itemsize: int = 2) -> int:
    """KV cache bytes per token on one generation rank (MLA keeps one latent per token, on every rank)."""
    layers = hf["num_hidden_layers"]
    if "kv_lora_rank" in hf:
        return layers * (hf["kv_lora_rank"] + hf["qk_rope_head_dim"]) * itemsize
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return layers * 2 * max(1, kv // gen_tp) * head_dim * itemsize


def plan(hf: dict, train: TrainLayout, gen_tp: int, seq_len: int = 4096, micro_batch: int = 1,
         kv_tokens: int = 65536, distributed_optimizer: bool = False, cp: int = 1) -> dict:
    """Per-rank memory (bytes) and sync traffic; everything main() prints. `train.dp` counts the CP x DP
    replicas (as the resharder does); `cp` of them split each sequence."""
    generation_ranks(train, gen_tp)
    specs = hf_inventory(hf)
    by_stage: dict[int, list[TensorSpec]] = {}
    for s in specs:
        by_stage.setdefault(train.stage(s), []).append(s)
    h = hf["hidden_size"]
    activations = (seq_len / cp * micro_batch * h * (10 + 24 / train.tp) * (train.num_layers // train.pp)
                   * train.pp)
    traffic = {d: transfer_bytes(specs, train, gen_tp, d, itemsize=2) for d in DELIVERIES}
    ranks = []
    for rank in range(train.world):
        t, _, p = train.coords(rank)
        params = _shard_numel(by_stage.get(p, []), train.tp, t)
        optimizer = 12 * params / (train.dp if distributed_optimizer else 1)
        gen_params = _shard_numel(specs, gen_tp, rank % gen_tp)
        ranks.append(dict(
            rank=rank, tp=t, pp=p, params=params, weights=2 * params, grads=4 * params, optimizer=optimizer,
            activations=activations if p == 0 else activations * (train.pp - p) / train.pp,
            gen_weights=2 * gen_params, kv_cache=kv_bytes_per_token(hf, gen_tp) * kv_tokens,
            **{f"{d}_recv": traffic[d][0][rank] for d in DELIVERIES},
            **{f"{d}_send": traffic[d][1][rank] for d in DELIVERIES}))
    return dict(total_params=sum(s.numel for s in specs), ranks=ranks)


def _gib(x: float) -> str:
    return f"{x / GiB:8.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megarl.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="config.json path or name in configs/models/")
    parser.add_argument("--train", required=True, help="training layout, e.g. tp=2,pp=2,dp=2")
    parser.add_argument("--gen", default="tp=1", help="generation layout, e.g. tp=4 (DP = world / TP)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--kv-tokens", type=int, default=65536, help="tokens of KV cache per generation rank")
    parser.add_argument("--distributed-optimizer", action="store_true")
    args = parser.parse_args(argv)
    hf = load_model_config(args.model)
    t = parse_layout(args.train, ("tp", "pp", "cp", "dp"))
    gen_tp = parse_layout(args.gen, ("tp",))["tp"]
    train = TrainLayout(t["tp"], t["pp"], t["cp"] * t["dp"], hf["num_hidden_layers"])
    if hf["num_hidden_layers"] % train.pp:
        raise SystemExit(f"PP={train.pp} does not divide num_hidden_layers={hf['num_hidden_layers']}")
    result = plan(hf, train, gen_tp, args.seq_len, args.micro_batch, args.kv_tokens, args.distributed_optimizer,
                  t["cp"])
    print(f"{args.model}: {result['total_params'] / 1e9:.2f}B parameters; train TP={train.tp} PP={train.pp} "
          f"CP={t['cp']} DP={t['dp']} ({train.world} GPUs), generation TP={gen_tp} DP={train.world // gen_tp}")
    adam = "over CP x DP" if args.distributed_optimizer else "replicated"
    print(f"per-GPU memory in GiB (bf16 weights, fp32 grads, Adam {adam}; "
          f"activations at seq {args.seq_len} x micro-batch {args.micro_batch}; KV for {args.kv_tokens} tokens)")
    print("rank tp pp |  weights    grads optimizer activations train_total | gen_weights kv_cache gen_total"
          " | sync GiB: full recv/send   sharded recv/send")
    for r in result["ranks"]:
        train_total = r["weights"] + r["grads"] + r["optimizer"] + r["activations"]
        print(f"{r['rank']:4d} {r['tp']:2d} {r['pp']:2d} |{_gib(r['weights'])} {_gib(r['grads'])} {_gib(r['optimizer'])}"
              f"    {_gib(r['activations'])}    {_gib(train_total)} |    {_gib(r['gen_weights'])} {_gib(r['kv_cache'])}"
              f"  {_gib(r['gen_weights'] + r['kv_cache'])} | {_gib(r['full_recv'])} {_gib(r['full_send'])}"
              f"  {_gib(r['sharded_recv'])} {_gib(r['sharded_send'])}")


if __name__ == "__main__":
    main()
