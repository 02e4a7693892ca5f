"""Layout planner: per-GPU memory and per-rank weight-sync traffic, on paper, before asking for GPUs.

    python -m megarl.plan --model deepseek-v3 --train tp=1,pp=16,dp=8,ep=8 --gen tp=8,ep=8 \\
        --distributed-optimizer --recompute full --seq-len 8192
    python -m megarl.plan --model qwen3-235b-a22b --gpus 32 --gpu-mem 90 --optimizer-offload --recompute full

--train takes tp, pp, dp, cp (context parallelism), ep (expert parallelism) and etp (each expert's TP;
default tp); --gen takes tp and ep (SGLang's --tp-size/--ep-size). A layer count PP does not divide is
split megatron's way (uneven first/last stages, megarl/parallel/stages.py: the engine's rule): give
--pp-first-stage-layers/--pp-last-stage-layers, or the planner picks the stages between them with
ceil(layers / PP) each and splits the rest over the first and the last (61 over PP 8: 7 + 6 x 8 + 6), and
prints the actor.parallel keys that make the engine build that split. With --gpus N --gpu-mem GiB it lists
the layouts of N GPUs whose predicted per-GPU peak fits (and, with --host-mem, whose offloaded optimizer fits
each node's host memory) with a margin left free (--margin, 5% by default), best first, each with the
`key=value` overrides that make a run train that way; when none fits, the nearest ones and what would make one
fit, and exit status 1 (so too for --train with a --gpu-mem it does not fit). --optimizer-offload is megarl's
engine's (actor.optimizer_cpu_offload: Adam's moments leave the GPU, the fp32 master weights stay);
--te-precision-aware-optimizer plans megatron's TransformerEngine offload instead (the master weights leave too).
--lora-rank R [--lora-targets q_proj,v_proj] plans LoRA (actor.lora): the base frozen in bf16, the adapters trained.
--model takes a HF config.json path or a name in configs/models/. The memory model and its assumptions are
megarl/reshard/memory.py's (docs/planner.md); sync traffic comes from megarl.reshard's own transfer plan, for both
deliveries ("full": whole HF tensors to every rank; "sharded": only the rank's generation shard, minus what it
holds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from megarl.config.sglang_args import sglang_ep_size
from megarl.parallel.stages import default_first_last, stage_layers
from megarl.reshard.inventory import TensorSpec, hf_inventory
from megarl.reshard.layout import (DELIVERIES, GenLayout, TrainLayout, as_generation, generation_ranks,
                                   resharded_layout)
from megarl.reshard.memory import (LORA_TARGETS, GiB, MemorySettings, adaptable_targets, check_lora_targets,
                                   host_per_node, lora_fields, model_adapters, predict_peak, stage_memory)
from megarl.reshard.transfers import transfer_bytes
from megarl.utils.hf_config import (HYBRID_ATTENTION, TEXT_ONLY_TOWERS, UNFUSED_ATTENTION, language_fields,
                                    layer_types, parallel_limit, routed_experts)

MODELS_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"
TRAIN_KEYS, GEN_KEYS = ("tp", "pp", "cp", "dp", "ep", "etp"), ("tp", "ep")
LORA_RANK = 16  # the rank the planner tries when nothing fits with full fine-tuning


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
    """'tp=2,pp=2,dp=4' -> {'tp': 2, 'pp': 2, 'dp': 4, ...}; missing keys default to 1 (etp to tp)."""
    layout = dict.fromkeys(keys, 1)
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key not in keys or not value.isdigit() or int(value) < 1:
            raise ValueError(f"bad layout entry {part!r} in {text!r}: expected {', '.join(k + '=N' for k in keys)}")
        layout[key] = int(value)
    if "etp" in keys and "etp=" not in text:
        layout["etp"] = layout["tp"]
    return layout


def stage_split(num_layers: int, pp: int, first: int = 0, last: int = 0) -> tuple[int, ...]:
    """Decoder layers per stage as megarl's engine builds them (megarl/parallel/stages.py, megatron's rule) for
    the given first/last stage counts; neither given: stages.default_first_last's split. Errors name the
    planner's flags and the engine's keys."""
    if not (first or last):
        first, last = default_first_last(num_layers, pp)
    try:
        return stage_layers(num_layers, pp, first, last, keys="actor.parallel")
    except ValueError as e:
        raise ValueError(f"--pp-first-stage-layers={first} --pp-last-stage-layers={last}: {e}") from None


def train_layout(hf: dict, t: dict[str, int], first: int = 0, last: int = 0) -> TrainLayout:
    """The TrainLayout of a parsed --train (t['dp'] the DP size; TrainLayout.dp counts CP x DP), with its
    stage split (stage_split)."""
    layers = language_fields(hf)["num_hidden_layers"]
    stages = stage_split(layers, t["pp"], first, last)
    experts = routed_experts(hf)
    if t["ep"] > 1 and not experts:
        raise ValueError(f"ep={t['ep']}: model_type={hf.get('model_type')!r} has no routed experts")
    if experts and experts % t["ep"]:
        raise ValueError(f"ep={t['ep']} does not divide the {experts} routed experts")
    if limit := parallel_limit(hf, t["tp"], t["etp"], t["cp"]):
        raise ValueError(f"tp={t['tp']} etp={t['etp']} cp={t['cp']}: {limit}")
    return TrainLayout(t["tp"], t["pp"], t["cp"] * t["dp"], layers, stages, ep=t["ep"], etp=t["etp"])


def kv_bytes_per_token(hf: dict, gen_tp: int, itemsize: int = 2) -> int:
    """KV cache bytes per token on one generation rank (MLA keeps one latent per token, on every rank)."""
    hf = language_fields(hf)
    layers = hf["num_hidden_layers"]
    if hf.get("model_type") in HYBRID_ATTENTION:  # a cache in the full-attention layers only (the linear ones keep a
        layers = layer_types(hf).count("full_attention")  # state per sequence, not counted here)
    if "kv_lora_rank" in hf:
        return layers * (hf["kv_lora_rank"] + hf["qk_rope_head_dim"]) * itemsize
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return layers * 2 * max(1, kv // gen_tp) * head_dim * itemsize


def generation_bytes(specs: list[TensorSpec], gen: GenLayout, rank: int, itemsize: int = 2) -> int:
    """Bytes of the weights generation rank `rank` holds (its rows of each tensor; fp32 tensors at 4 bytes)."""
    total = 0
    for spec in specs:
        rows = gen.rows(spec, rank)
        if rows is not None:
            total += (rows[1] - rows[0]) * spec.row_numel * spec.itemsize(itemsize)
    return total


def generation_peak(specs: list[TensorSpec], gen: GenLayout) -> int:
    """The most weight bytes one generation rank holds."""
    return max(generation_bytes(specs, gen, rank) for rank in range(gen.tp))


def server_bytes(specs: list[TensorSpec], gen: GenLayout, rank: int, delivery: str, itemsize: int = 2) -> int:
    """Bytes engine rank `rank % gen.tp` receives in one sync: its own rows ("sharded"), or every HF tensor whole
    ("full": the engine slices them, dropping what it does not hold)."""
    if delivery == "sharded":
        return generation_bytes(specs, gen, rank, itemsize)
    return sum(spec.numel * spec.itemsize(itemsize) for spec in specs)


def plan(hf: dict, train: TrainLayout, gen: int | GenLayout, settings: MemorySettings = MemorySettings(),
         kv_tokens: int = 65536, cp: int = 1, traffic: bool = True) -> dict:
    """Everything main() prints: per-stage training memory (memory.stage_memory), the most a generation rank holds
    (`serving`: weights and KV cache), and per rank its generation weights, KV cache and sync traffic (bytes):
    what it receives and sends among the training ranks (the resharder, in the layout each delivery runs:
    layout.resharded_layout) and what its engine rank receives.
    `train.dp` counts the CP x DP replicas; `cp` of them split each sequence."""
    gen = as_generation(gen)
    generation_ranks(train, gen)
    specs = hf_inventory(hf)
    stages = stage_memory(hf, train, settings, cp)
    held = [generation_bytes(specs, gen, t) for t in range(gen.tp)]
    moved = {d: transfer_bytes(specs, train, resharded_layout(gen, d), d, itemsize=2)
             for d in DELIVERIES} if traffic else {}
    # what each engine rank receives: its own rows (sharded: what it holds), or every tensor whole (full: alike)
    served = {"sharded": held, "full": [server_bytes(specs, gen, 0, "full")] * gen.tp}
    ranks = []
    for rank in range(train.world):
        row = dict(rank=rank, stage=train.coords(rank)[2], gen_weights=held[rank % gen.tp],
                   kv_cache=kv_bytes_per_token(hf, gen.tp) * kv_tokens)
        for d, (recv, sent) in moved.items():
            row |= {f"{d}_recv": recv[rank], f"{d}_send": sent[rank], f"{d}_server_recv": served[d][rank % gen.tp]}
        ranks.append(row)
    return dict(total_params=sum(s.numel for s in specs), stages=stages, ranks=ranks,
                peak=max(s["peak"] for s in stages), serving=max(held) + kv_bytes_per_token(hf, gen.tp) * kv_tokens)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def fitting_layouts(hf: dict, gpus: int, gpu_mem: float, settings: MemorySettings, host_mem: float = 0.0,
                    gpus_per_node: int = 8, cp: int = 1) -> list[dict]:
    """Layouts of `gpus` GPUs (candidate_layouts) whose predicted per-GPU peak fits `gpu_mem` bytes (and whose
    offloaded optimizer fits `host_mem` bytes per node, when given), best first."""
    return [r for r in candidate_layouts(hf, gpus, settings, gpus_per_node, cp)
            if r["peak"] <= gpu_mem and (not host_mem or r["host_per_node"] <= host_mem)]


def candidate_layouts(hf: dict, gpus: int, settings: MemorySettings, gpus_per_node: int = 8,
                      cp: int = 1) -> list[dict]:
    """Every layout of `gpus` GPUs the model can take (TP within a node, default stage splits, ETP 1 or TP), with
    its predicted per-GPU peak and host memory per node, best first: the least model parallelism (TP x PP x CP; more
    data parallelism), then fewer pipeline stages, then the least expert parallelism, then the lowest peak."""
    experts, fields = routed_experts(hf), language_fields(hf)
    # the engine gives each TP rank whole query groups (megarl/config/model_layout.py refuses other TP sizes)
    kv_heads = fields.get("num_key_value_heads") or fields["num_attention_heads"]
    found = []
    for tp in [d for d in _divisors(gpus) if d <= gpus_per_node and kv_heads % d == 0]:
        for pp in [d for d in _divisors(gpus // tp) if d <= fields["num_hidden_layers"]]:
            if (gpus // (tp * pp)) % cp:
                continue
            dp = gpus // (tp * pp * cp)
            for ep in [d for d in _divisors(experts or 1) if (gpus // pp) % d == 0]:
                for etp in sorted({1, tp}) if experts else [tp]:
                    t = dict(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, etp=etp)
                    try:
                        train = train_layout(hf, t)
                        peak = predict_peak(hf, train, settings, cp)
                    except ValueError:  # a split this model cannot take (heads, experts, stages)
                        continue
                    host = host_per_node(hf, train, settings, gpus_per_node, cp) if settings.optimizer_offload else 0
                    found.append(dict(t, stage_layers=train.stage_layers, peak=peak, host_per_node=host))
    return sorted(found, key=lambda r: (r["tp"] * r["pp"] * r["cp"], r["pp"], r["ep"], r["peak"]))


def generation_layouts(hf: dict, gpus: int, kv_tokens: int, gpus_per_node: int = 8) -> list[dict]:
    """The SGLang layouts megarl can start for `gpus` GPUs (TP within a node, since each server runs on the GPUs of
    one node, and dividing `gpus`; EP 1 or TP where the experts divide), smallest TP first, each with the most bytes
    one rank holds: bf16 weights, and `kv_tokens` of KV cache."""
    specs, experts, layouts = hf_inventory(hf), routed_experts(hf), []
    for tp in [d for d in _divisors(min(gpus, gpus_per_node)) if gpus % d == 0]:
        for ep in sorted({1, tp}) if experts and experts % tp == 0 else [1]:
            gen = GenLayout(tp, ep)
            try:
                weights = generation_peak(specs, gen)
            except ValueError:  # a TP the model cannot take (heads)
                continue
            layouts.append(dict(tp=tp, ep=ep, weights=weights, kv_cache=kv_bytes_per_token(hf, tp) * kv_tokens))
    return layouts


def run_memory(hf: dict, actor, rollout, reference: bool, longest_prompt: int,
               response_tokens: int) -> tuple[str, float]:
    """The dry run's line and the largest of its byte counts: the planner's per-GPU training peak for a run's actor
    section (its layout, micro-batches of micro_batch_size x (longest prompt + response budget) tokens, or
    max_tokens_per_micro_batch; recompute, optimizer and offload as configured; bf16, as on GPUs) and, with SGLang,
    each engine rank's weights."""
    p = actor.parallel
    t = dict(tp=p.tp, pp=p.pp, cp=p.cp, dp=p.dp, ep=p.ep, etp=p.etp or p.tp)
    train = train_layout(hf, t, p.pp_first_stage_layers, p.pp_last_stage_layers)
    seq_len, rows = ((actor.max_tokens_per_micro_batch, 1) if actor.max_tokens_per_micro_batch
                     else (longest_prompt + response_tokens, actor.micro_batch_size))
    settings = MemorySettings(
        seq_len=seq_len, micro_batch=rows, sequence_parallel=p.sequence_parallel, recompute=actor.recompute,
        recompute_modules=tuple(actor.recompute_modules) or ("core_attn",),
        distributed_optimizer=actor.use_distributed_optimizer, optimizer_offload=actor.optimizer_cpu_offload,
        offload_fraction=actor.optimizer_offload_fraction, reference=reference, **lora_fields(actor.lora))
    ranks = stage_memory(hf, train, settings, p.cp)
    peak = max(r["peak"] for r in ranks)
    line = (f"predicted GPU memory (python -m megarl.plan, bf16): training peak {peak / GiB:.2f} GiB per GPU at "
            f"micro-batches of {rows} x {seq_len} tokens")
    if settings.lora_rank:
        most = max(ranks, key=lambda r: r["peak"])
        trained = most["adapters"] * 2 + most["grads"] + most["optimizer"]
        line += (f" (LoRA rank {settings.lora_rank} on {','.join(settings.lora_targets)}, on that GPU: the frozen "
                 f"bf16 base {most['params'] * 2 / GiB:.2f} GiB, {most['adapters'] / 1e6:.2f}M adapter parameters "
                 f"{trained / GiB:.2f} GiB with their gradients and optimizer state"
                 + ("; the KL reference is the base, no copy)" if reference else ")"))
    weights = 0
    if rollout.engine == "sglang":
        gen = GenLayout(rollout.sglang_tp, sglang_ep_size(rollout.sglang_args))
        weights = generation_peak(hf_inventory(hf), gen)
        line += f"; SGLang weights {weights / GiB:.2f} GiB per rank at TP={gen.tp} EP={gen.ep}, before its KV cache"
    return line, max(peak, weights)


def _gib(x: float) -> str:
    return f"{x / GiB:8.2f}"


def _print_assumptions(settings: MemorySettings, tp: int, cp: int, kv_tokens: int | None) -> None:
    print("assumptions:")
    for line in settings.describe(tp, cp) + ([f"generation KV cache: {kv_tokens} tokens per rank"]
                                            if kv_tokens else []):
        print(f"  - {line}")


def _print_plan(name: str, hf: dict, train: TrainLayout, t: dict, gen: GenLayout, settings: MemorySettings,
                kv_tokens: int, gpus_per_node: int) -> dict:
    result = plan(hf, train, gen, settings, kv_tokens, t["cp"])
    print(f"{name}: {result['total_params'] / 1e9:.2f}B parameters; train TP={train.tp} PP={train.pp} CP={t['cp']} "
          f"DP={t['dp']} EP={train.ep} ETP={train.etp} ({train.world} GPUs), generation TP={gen.tp} EP={gen.ep} "
          f"DP={train.world // gen.tp}")
    if settings.lora_rank:
        print(f"LoRA: {model_adapters(hf, settings) / 1e6:.2f}M adapter parameters in all (rank {settings.lora_rank} "
              f"on {','.join(settings.lora_targets)}); the rest frozen")
    first, last = train.stage_layers[0], train.stage_layers[-1]
    print(f"pipeline stages (decoder layers): {','.join(map(str, train.stage_layers))}"
          + (f" (actor.parallel.pp_first_stage_layers={first} actor.parallel.pp_last_stage_layers={last})"
             if len(set(train.stage_layers)) > 1 else ""))
    _print_assumptions(settings, train.tp, t["cp"], kv_tokens)
    if language_fields(hf).get("model_type") in UNFUSED_ATTENTION:
        print("  - but this model's attention is megatron's unfused one (sliding windows, sinks): its scores are stored")
    if hf.get("model_type") in TEXT_ONLY_TOWERS:
        print("  - the language model alone: the checkpoint's vision tower is neither trained nor synced (text-only RL), "
              "and SGLang's copy of it is not counted")
    print("per-GPU training memory in GiB, the most loaded rank of each pipeline stage:")
    lora = settings.lora_rank > 0
    print("stage layers  params(B)" + (" adapters(M)" if lora else "") + " |  weights    grads optimizer reference "
          "activations   logits  working |     peak | host (offload)")
    for p, m in enumerate(result["stages"]):
        adapters = f" {m['adapters'] / 1e6:11.3f}" if lora else ""
        print(f"{p:5d} {train.stage_layers[p]:6d} {m['params'] / 1e9:10.3f}{adapters} |{_gib(m['weights'])} "
              f"{_gib(m['grads'])} "
              f"{_gib(m['optimizer'])}  {_gib(m['reference'])}    {_gib(m['activations'])} {_gib(m['logits'])} "
              f"{_gib(m['backward_working'])} | {_gib(m['peak'])} | {_gib(m['host'])}")
    print(f"per-GPU peak: {result['peak'] / GiB:.2f} GiB", end="")
    if settings.optimizer_offload:
        host = host_per_node(hf, train, settings, gpus_per_node, t["cp"])
        print(f"; host memory of the offloaded optimizer: {host / GiB:.1f} GiB on the most loaded node of "
              f"{gpus_per_node} GPUs", end="")
    print()
    r = result["ranks"]
    print(f"generation per rank: weights {max(x['gen_weights'] for x in r) / GiB:.2f} GiB + KV cache "
          f"{r[0]['kv_cache'] / GiB:.2f} GiB = {result['serving'] / GiB:.2f} GiB")
    for d in DELIVERIES:
        print(f"weight sync, {d} delivery: at most {max(x[f'{d}_recv'] for x in r) / GiB:.2f} GiB received and "
              f"{max(x[f'{d}_send'] for x in r) / GiB:.2f} GiB sent by one training rank, "
              f"{sum(x[f'{d}_recv'] for x in r) / GiB:.1f} GiB in all; each engine rank receives "
              f"{_span([x[f'{d}_server_recv'] for x in r[:gen.tp]])} GiB")
    return result


def _span(values: list[int]) -> str:
    low, high = min(values) / GiB, max(values) / GiB
    return f"{high:.2f}" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f} to {high:.2f}"


def _settings(args) -> MemorySettings:
    targets = [t for t in args.lora_targets.split(",") if t]
    unknown = [t for t in targets if t not in LORA_TARGETS + ("all-linear",)]
    if unknown or not targets:
        raise ValueError(f"--lora-targets {args.lora_targets}: {', '.join(unknown) or 'none'} is not among "
                         f"{', '.join(LORA_TARGETS)} or all-linear (actor.lora.target_modules' names)")
    if args.lora_rank < 0:
        raise ValueError(f"--lora-rank {args.lora_rank}: must be >= 0 (actor.lora.rank; 0 = full fine-tuning)")
    return MemorySettings(
        seq_len=args.seq_len, micro_batch=args.micro_batch, micro_batches=args.micro_batches,
        sequence_parallel=args.sequence_parallel, recompute=args.recompute,
        recompute_modules=tuple(filter(None, args.recompute_modules.split(","))),
        distributed_optimizer=args.distributed_optimizer or args.optimizer_offload,
        optimizer_offload=args.optimizer_offload, offload_fraction=args.offload_fraction,
        te_precision_aware_optimizer=args.te_precision_aware_optimizer, reference=args.reference,
        lora_rank=args.lora_rank,
        lora_targets=tuple(t for t in LORA_TARGETS if "all-linear" in targets or t in targets))


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns the exit status: 1 where --gpu-mem cannot be met."""
    parser = argparse.ArgumentParser(prog="python -m megarl.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="config.json path or name in configs/models/")
    parser.add_argument("--train", default="", help="training layout, e.g. tp=1,pp=16,dp=8,ep=8[,etp=1][,cp=2]")
    parser.add_argument("--pp-first-stage-layers", type=int, default=0, help="decoder layers on the first stage")
    parser.add_argument("--pp-last-stage-layers", type=int, default=0, help="decoder layers on the last stage")
    parser.add_argument("--gen", default="tp=1", help="generation layout, e.g. tp=8,ep=8 (DP = world / TP)")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (packed row)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=0, help="micro-batches per step; 0 = PP")
    parser.add_argument("--kv-tokens", type=int, default=65536, help="tokens of KV cache per generation rank")
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--optimizer-offload", action="store_true",
                        help="megatron's optimizer CPU offload as megarl's engine runs it (actor.optimizer_cpu_"
                             "offload: Adam's moments on the host, fp32 master weights on the GPU; implies "
                             "--distributed-optimizer)")
    parser.add_argument("--offload-fraction", type=float, default=1.0, help="share of the optimizer on the CPU")
    parser.add_argument("--te-precision-aware-optimizer", action="store_true",
                        help="with --optimizer-offload: plan megatron with TransformerEngine's precision-aware "
                             "optimizer, whose fp32 master weights leave the GPU too (verl's and slime's offload); "
                             "default: megarl's engine (no TransformerEngine), where only Adam's moments do")
    parser.add_argument("--recompute", default="none", help="none, selective or full")
    parser.add_argument("--recompute-modules", default="core_attn",
                        help="with --recompute selective: core_attn,layernorm,mla_up_proj,mlp,moe,moe_act,"
                             "shared_experts")
    parser.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                        help="default: on when TP > 1")
    parser.add_argument("--reference", action="store_true", help="a bf16 reference snapshot on each GPU (KL; none "
                        "with LoRA, whose reference is the base with the adapters off)")
    parser.add_argument("--lora-rank", type=int, default=0, help="actor.lora.rank: LoRA adapters of this rank, the "
                        "base frozen (bf16 weights alone); 0 = full fine-tuning")
    parser.add_argument("--lora-targets", default="all-linear", help="actor.lora.target_modules: q_proj,k_proj,"
                        "v_proj,o_proj,gate_proj,up_proj,down_proj or all-linear")
    parser.add_argument("--gpus", type=int, default=0, help="list the layouts of this many GPUs that fit")
    parser.add_argument("--gpu-mem", type=float, default=0.0, help="GiB per GPU: with --gpus the layouts must fit "
                        "it; with --train the plan says whether training and generation each do")
    parser.add_argument("--host-mem", type=float, default=0.0, help="with --gpus: host GiB per node (offload)")
    parser.add_argument("--cp", type=int, default=1, help="with --gpus: the context-parallel size to plan with")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--top", type=int, default=10, help="with --gpus: how many layouts to list")
    parser.add_argument("--margin", type=float, default=0.05,
                        help="share of --gpu-mem kept free for what the memory model leaves out (CUDA context, NCCL "
                             "buffers, allocator fragmentation): a layout fits when its predicted peak is at most "
                             "(1 - margin) x --gpu-mem")
    args = parser.parse_args(argv)
    try:
        hf = load_model_config(args.model)
        settings = _settings(args)
        check_lora_targets(hf, settings)
        if not 0 <= args.margin < 1:
            raise ValueError(f"--margin {args.margin:g}: a share of --gpu-mem in [0, 1)")
        if args.gpus:
            if args.gpu_mem <= 0:
                raise ValueError("--gpus needs --gpu-mem (GiB per GPU)")
            return _print_fitting(args, hf, settings)
        if not args.train:
            raise ValueError("give --train (a layout to plan) or --gpus/--gpu-mem (layouts that fit)")
        t = parse_layout(args.train, TRAIN_KEYS)
        gen = GenLayout(**parse_layout(args.gen, GEN_KEYS))
        train = train_layout(hf, t, args.pp_first_stage_layers, args.pp_last_stage_layers)
        result = _print_plan(args.model, hf, train, t, gen, settings, args.kv_tokens, args.gpus_per_node)
        print(f"run keys: {run_overrides(t, train.stage_layers, settings, dict(tp=gen.tp, ep=gen.ep))}")
        if gen.tp > args.gpus_per_node:
            print(f"note: megarl starts each SGLang server on the GPUs of one node; --gen tp={gen.tp} needs more "
                  f"than --gpus-per-node {args.gpus_per_node}")
        if args.gpu_mem:  # colocated, each side holds the GPU alone (the other offloaded): each must fit
            return _print_fit(args, result["peak"], result["serving"])
        return 0
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"python -m megarl.plan: {e}") from e


def _print_fit(args, *peaks: float) -> int:
    """Whether training and generation (peaks in bytes) each fit --gpu-mem less the margin; 1 if one does not."""
    budget = args.gpu_mem * GiB * (1 - args.margin)

    def fit(peak: float) -> str:
        free = f"{args.gpu_mem - peak / GiB:.2f} GiB free"
        if peak <= budget:
            return f"fits ({peak / GiB:.2f} GiB, {free})"
        if peak <= args.gpu_mem * GiB:
            return f"does NOT fit with the {args.margin:.0%} margin ({peak / GiB:.2f} GiB, only {free})"
        return f"does NOT fit ({peak / GiB:.2f} GiB)"

    training, generation = map(fit, peaks)
    print(f"on GPUs of {args.gpu_mem:g} GiB with a {args.margin:.0%} margin (--margin: for what the memory model "
          f"leaves out): training {training}, generation {generation}")
    return 0 if max(peaks) <= budget else 1


def run_overrides(t: dict, stage_layers: tuple[int, ...], settings: MemorySettings, gen: dict | None) -> str:
    """The `key=value` overrides that make a run train (and generate) as planned: the layout t (TRAIN_KEYS and
    world size), its uneven stages, the memory settings the plan assumed, and the generation layout `gen` (tp, ep)."""
    tp, world = t["tp"], t["tp"] * t["pp"] * t["cp"] * t["dp"]
    keys = {"actor.parallel.world_size": world, "actor.parallel.tp": tp, "actor.parallel.pp": t["pp"]}
    keys |= {f"actor.parallel.{k}": t[k] for k in ("cp", "ep") if t[k] > 1}
    if t["ep"] > 1 and t["etp"] != tp:
        keys["actor.parallel.etp"] = t["etp"]
    if len(set(stage_layers)) > 1:
        keys |= {"actor.parallel.pp_first_stage_layers": stage_layers[0],
                 "actor.parallel.pp_last_stage_layers": stage_layers[-1]}
    if settings.sp(tp):
        keys["actor.parallel.sequence_parallel"] = "true"
    keys["actor.max_tokens_per_micro_batch"] = settings.seq_len * settings.micro_batch
    if settings.recompute != "none":
        keys["actor.recompute"] = settings.recompute
        if settings.recompute == "selective":
            keys["actor.recompute_modules"] = f"[{','.join(settings.recompute_modules)}]"
    if settings.distributed_optimizer or settings.optimizer_offload:
        keys["actor.use_distributed_optimizer"] = "true"
    if settings.optimizer_offload:
        keys["actor.optimizer_cpu_offload"] = "true"
        if settings.offload_fraction != 1.0:
            keys["actor.optimizer_offload_fraction"] = f"{settings.offload_fraction:g}"
    if settings.lora_rank:
        keys["actor.lora.rank"] = settings.lora_rank
        keys["actor.lora.target_modules"] = _lora_targets_text(settings.lora_targets)
    if gen is not None:
        keys |= {"rollout.engine": "sglang", "rollout.sglang_tp": gen["tp"]}
        if gen["ep"] > 1:
            keys["rollout.sglang_args"] = f"[--ep-size,{gen['ep']}]"
    return " ".join(f"{k}={v}" for k, v in keys.items())


def _lora_targets_text(targets: tuple[str, ...]) -> str:
    return "all-linear" if set(targets) == set(LORA_TARGETS) else f"[{','.join(targets)}]"


def _layout_text(r: dict) -> str:
    return ",".join(f"{k}={r[k]}" for k in TRAIN_KEYS)


def _print_fitting(args, hf: dict, settings: MemorySettings) -> int:
    """The layouts that fit --gpu-mem less the margin, each with the run's overrides; when none does, the nearest
    and what would make one fit. Returns the exit status: 1 when no training layout or no SGLang server fits."""
    budget, host_mem = args.gpu_mem * GiB * (1 - args.margin), args.host_mem * GiB
    every = candidate_layouts(hf, args.gpus, settings, args.gpus_per_node, args.cp)
    found = [r for r in every if r["peak"] <= budget and (not host_mem or r["host_per_node"] <= host_mem)]
    tight = [r for r in every if budget < r["peak"] <= args.gpu_mem * GiB]
    shown = "" if not found else "; " + (f"best {args.top} shown (--top {args.top})" if len(found) > args.top
                                         else "all shown") + ", best first (least TP x PP x CP, then fewest stages, "\
                                        "then least EP)"
    host = f" and whose offloaded optimizer fits {args.host_mem:g} GiB of host memory per node" if host_mem else ""
    print(f"{args.model}: {len(found)} layout(s) of {args.gpus} GPUs fit {args.gpu_mem:g} GiB per GPU with a "
          f"{args.margin:.0%} margin (predicted peak at most {budget / GiB:.2f} GiB: the margin is for what the memory "
          f"model leaves out: CUDA context, NCCL buffers, allocator fragmentation){host}{shown}")
    _print_assumptions(settings, 0, args.cp, None)
    # colocated, training and generation take turns on each GPU (megarl offloads one while the other runs), so
    # each must fit alone
    layouts = generation_layouts(hf, args.gpus, args.kv_tokens, args.gpus_per_node)
    fit = [g for g in layouts if g["weights"] + g["kv_cache"] <= budget]
    gen = fit[0] if fit else None
    for i, r in enumerate(found[:args.top], 1):
        host_text = f", host {r['host_per_node'] / GiB:.1f} GiB/node" if settings.optimizer_offload else ""
        stages = ",".join(map(str, r["stage_layers"]))
        print(f"  {i}. --train {_layout_text(r):40s} peak {r['peak'] / GiB:7.2f} GiB, "
              f"{args.gpu_mem - r['peak'] / GiB:6.2f} GiB free{host_text}; stages {stages}")
        print(f"     {run_overrides(r, r['stage_layers'], settings, gen)}")
    if tight:
        print(f"  {len(tight)} more fit {args.gpu_mem:g} GiB only inside the {args.margin:.0%} margin (peak "
              f"{_span([r['peak'] for r in tight])} GiB): not counted; --margin 0 counts them")
    if not found:
        _print_nearest(args, hf, settings, every, budget)
    if gen is not None:
        print(f"generation: the smallest SGLang server that fits is --gen tp={gen['tp']},ep={gen['ep']} "
              f"({gen['weights'] / GiB:.2f} GiB of bf16 weights + {gen['kv_cache'] / GiB:.2f} GiB for "
              f"{args.kv_tokens} tokens of KV cache per rank; rollout.sglang_tp={gen['tp']})")
    else:
        least = min(layouts, key=lambda g: g["weights"], default=None)
        held = (f": at TP={least['tp']} EP={least['ep']} a rank holds {least['weights'] / GiB:.2f} GiB of bf16 "
                "weights before its KV cache" if least else "")
        print(f"generation: no SGLang server within a node of {args.gpus_per_node} GPUs fits {budget / GiB:.2f} GiB"
              f"{held}. megarl starts each server on the GPUs of one node and serves bf16 weights (no FP8), so this "
              f"model cannot be served on these GPUs (fewer --kv-tokens than {args.kv_tokens} shrink the KV cache)")
    return 0 if found and gen is not None else 1


def _print_nearest(args, hf: dict, settings: MemorySettings, every: list[dict], budget: float) -> None:
    """When nothing fits: the layouts closest to fitting, and each change that would make one fit, tried."""
    print(f"no layout of {args.gpus} GPUs fits. The nearest:")
    for r in sorted(every, key=lambda r: r["peak"])[:3]:
        print(f"  --train {_layout_text(r):40s} peak {r['peak'] / GiB:7.2f} GiB, {(r['peak'] - budget) / GiB:.2f} GiB "
              "over")
    print("what would make one fit:")

    def best(gpus: int, s: MemorySettings) -> str:
        found = fitting_layouts(hf, gpus, budget, s, args.host_mem * GiB, args.gpus_per_node, args.cp)
        if found:
            return f"{len(found)} layout(s) fit, the best --train {_layout_text(found[0])} at " \
                   f"{found[0]['peak'] / GiB:.2f} GiB"
        least = min(candidate_layouts(hf, gpus, s, args.gpus_per_node, args.cp), key=lambda r: r["peak"], default=None)
        return "still none" + (f" (the nearest at {least['peak'] / GiB:.2f} GiB)" if least else "")

    nodes = max(1, args.gpus // args.gpus_per_node)
    more = next((g for g in (args.gpus * k for k in (2, 4, 8)) if fitting_layouts(
        hf, g, budget, settings, args.host_mem * GiB, args.gpus_per_node, args.cp)), args.gpus * 8)
    print(f"  - more GPUs: --gpus {more}: {best(more, settings)}" + (f" ({more // args.gpus_per_node} nodes of "
          f"{args.gpus_per_node}, now {nodes})" if more > args.gpus_per_node else ""))
    changes = []
    if not settings.optimizer_offload:
        changes.append(("--optimizer-offload (actor.use_distributed_optimizer=true actor.optimizer_cpu_offload=true: "
                        "Adam's moments on the host)",
                        dataclasses.replace(settings, distributed_optimizer=True, optimizer_offload=True)))
    elif not settings.distributed_optimizer:
        changes.append(("--distributed-optimizer (actor.use_distributed_optimizer=true)",
                        dataclasses.replace(settings, distributed_optimizer=True)))
    if settings.recompute != "full":
        changes.append(("--recompute full (actor.recompute=full)", dataclasses.replace(settings, recompute="full")))
    if settings.seq_len * settings.micro_batch > 1024:
        half = settings.seq_len // 2
        changes.append((f"--seq-len {half} (actor.max_tokens_per_micro_batch={half * settings.micro_batch}: half the "
                        "tokens per micro-batch)", dataclasses.replace(settings, seq_len=half)))
    for what, changed in changes:
        print(f"  - {what}: {best(args.gpus, changed)}")
    experts = routed_experts(hf)
    if experts:
        print(f"  - expert parallelism: every EP dividing the {experts} experts and the GPUs of a stage was tried "
              "above; more GPUs allow more")
    if not settings.lora_rank and adaptable_targets(hf):  # LoRA: the frozen base sheds its grads and optimizer state
        lora = dataclasses.replace(settings, lora_rank=LORA_RANK, lora_targets=adaptable_targets(hf))
        targets = _lora_targets_text(lora.lora_targets)
        print(f"  - LoRA, e.g. --lora-rank {LORA_RANK} --lora-targets {targets.strip('[]')} (actor.lora.rank="
              f"{LORA_RANK} actor.lora.target_modules={targets}, docs/lora.md: the base frozen, no gradients or "
              f"optimizer state for it): {best(args.gpus, lora)}")


if __name__ == "__main__":
    raise SystemExit(main())
