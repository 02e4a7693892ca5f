"""Per-GPU memory of a megatron-core training rank on paper: the planner's model (docs/planner.md).

`rank_memory` / `predict_peak` give what `torch.cuda.max_memory_allocated()` should read during a policy train
step of megarl's engine (megatron-core's local layer spec, no TransformerEngine). Bytes per parameter held
on a rank (its TP shard of dense tensors, its EP block of routed experts cut over ETP):
- weights: bf16, 2 (Float16Module); gradients: fp32, 4 (DDP's grad_reduce_in_fp32 buffer, never sharded);
- Adam: fp32 master copy + two moments, 12, divided over the data-parallel replicas of that parameter with
  the distributed optimizer (dense: CP x DP ranks; routed experts: the expert-DP group,
  world / (ETP x EP x PP));
- optimizer CPU offload (megatron's HybridDeviceOptimizer, actor.optimizer_cpu_offload): megarl's engine
  runs without TransformerEngine, where the distributed optimizer keeps its fp32 master copy on the GPU and
  only Adam's two moments of the offloaded fraction leave it (8; measured on an H200,
  tests/engine/test_layouts_gpu.py); with TransformerEngine's precision-aware optimizer (what megarl does
  not build; te_precision_aware_optimizer) the master copy leaves too (12). Host memory either way: the
  fp32 master copy the CPU Adam updates, a pinned gradient copy and both moments, 16 per offloaded sharded
  parameter;
- the optimizer step's transient: torch's foreach Adam makes one fp32 temporary per parameter it updates
  on the GPU (4; none for the offloaded fraction, which the CPU updates);
- a reference snapshot (KL to the initial policy): another bf16 copy, 2.
LoRA (actor.lora, megarl/engine/lora.py): the base is frozen, its parameters bf16 (2) with no gradient buffer, fp32
master copy or Adam state (megatron's DDP and optimizer take only what requires a gradient); the adapters (A [r, in]
and B [out, r] per adapted projection, per expert for the routed experts, sharded as lora.py shards them: a
column-parallel layer's B by rows and A whole, a row-parallel layer's A by columns and B whole, an expert's over
expert-TP on the EP rank holding it) cost what a trained parameter costs above; the KL reference is the base with the
adapters off, no copy. Activations are full fine-tuning's (the adapters' r numbers per token and projection are not
counted).
Activations (bf16 unless said) are counted tensor by tensor from what the local spec saves for backward,
per token of one micro-batch (T = seq_len x micro_batch / CP tokens; tensors outside TP regions divide by TP
only under sequence parallelism), with flash-style attention (no score matrix stored) and balanced routing:
- norms: input and output of the input and pre-MLP RMSNorms, 2h each;
- attention: the fused QKV output (kept alive by V), rotated Q and K, the output and fp32 log-sum-exp;
  MLA: q/kv down-projections and their norms (replicated), Q and K (heads x (nope + rope)), the kv
  up-projection output (kept alive by V), the output (heads x v);
- dense SwiGLU MLP: fc1 output (2F), SiLU output and product (F each): 8F bytes;
- MoE (allgather dispatcher, SequentialMLP): fp32 router input and three fp32 [T, E] score tensors; each of
  the T x topk x ETP routed token copies this rank computes saves its input and output (2h each), fc1
  output, SiLU and product (8F / ETP) and its fp32 probability; shared experts as a dense MLP;
- the last stage: the fp32 vocab-parallel logits and their fp32 gradient, 8 bytes per logit (T x V / TP).
Gemma 3 (megarl runs its sliding windows in megatron's unfused attention): each layer also saves the fp32 softmax
output and bf16 probabilities, heads x seq_len scores per token, and four norms' inputs and outputs instead of two.
Recompute (megatron's): full keeps each layer's input only; selective drops what its modules save
(core_attn: the log-sum-exp; layernorm: norm outputs; mla_up_proj: Q, K, the kv up output; mlp: a dense
MLP's; moe_act: the experts' SiLU and product; shared_experts: theirs; moe: the whole MoE block). Backward
adds a working set of one layer (its activations' gradients, plus what it recomputes). 1F1B (no virtual
stages) keeps min(PP - stage, micro-batches) micro-batches in flight on each stage.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass

from megarl.config.validation import LORA_TARGETS, lora_targets
from megarl.reshard.inventory import (MIXTRAL_EXPERT_PARTS, STACKED_EXPERTS, VISION_LANGUAGE, TensorSpec, hf_inventory,
                                      is_moe_layer, on_first_stage)
from megarl.reshard.layout import TrainLayout
from megarl.utils.hf_config import (HYBRID_ATTENTION, UNFUSED_ATTENTION, expert_width, language_fields,
                                    routed_experts, shared_expert_width, tied_embeddings)

BF16, FP32 = 2, 4
RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mla_up_proj", "mlp", "moe", "moe_act", "shared_experts")
GiB = 1 << 30


@dataclass(frozen=True)
class MemorySettings:
    """What a run's memory depends on beside the model and the layout (defaults: megarl's actor defaults)."""
    seq_len: int = 4096  # tokens per sequence (with packing: tokens per packed row)
    micro_batch: int = 1  # sequences (rows) per micro-batch
    micro_batches: int = 0  # micro-batches per step on each DP rank; 0 = enough to fill the 1F1B pipeline (PP)
    sequence_parallel: bool | None = None  # None = on when TP > 1 (megatron needs it for MoE at TP > 1)
    recompute: str = "none"  # none, selective (recompute_modules) or full (each layer's input kept)
    recompute_modules: tuple[str, ...] = ("core_attn",)
    distributed_optimizer: bool = False
    optimizer_offload: bool = False  # megatron's optimizer CPU offload (needs distributed_optimizer)
    offload_fraction: float = 1.0  # share of the optimizer's parameters whose state lives on the CPU
    # Offload as megatron does it with TransformerEngine's precision-aware optimizer (fp32 master weights on the
    # host too), as verl and slime run it; False: megarl's engine (no TE), whose master weights stay on the GPU.
    te_precision_aware_optimizer: bool = False
    reference: bool = False  # a bf16 snapshot of the weights (KL to the reference policy); none under LoRA
    lora_rank: int = 0  # actor.lora.rank: > 0 trains adapters of this rank, the base frozen (0: full fine-tuning)
    lora_targets: tuple[str, ...] = LORA_TARGETS  # the projections adapted (actor.lora.target_modules spelled out)

    def __post_init__(self):
        for name in ("seq_len", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.micro_batches < 0:
            raise ValueError(f"micro_batches={self.micro_batches}: must be >= 0 (0 = PP)")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r}: expected one of {', '.join(RECOMPUTE)}")
        unknown = set(self.recompute_modules) - set(RECOMPUTE_MODULES)
        if unknown:
            raise ValueError(f"recompute_modules: {sorted(unknown)} not among {', '.join(RECOMPUTE_MODULES)}")
        if self.optimizer_offload and not self.distributed_optimizer:
            raise ValueError("optimizer_offload needs distributed_optimizer (megatron offloads the distributed "
                             "optimizer's shards)")
        if not 0 < self.offload_fraction <= 1:
            raise ValueError(f"offload_fraction={self.offload_fraction}: must be in (0, 1]")
        if self.te_precision_aware_optimizer and not self.optimizer_offload:
            raise ValueError("te_precision_aware_optimizer: changes only what optimizer_offload moves to the host "
                             "(the fp32 master weights too); set optimizer_offload")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank={self.lora_rank}: must be >= 0 (0 = full fine-tuning)")
        unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
        if unknown or (self.lora_rank and not self.lora_targets):
            raise ValueError(f"lora_targets={list(self.lora_targets)}: LoRA adapts some of {', '.join(LORA_TARGETS)}")

    def sp(self, tp: int) -> bool:
        return tp > 1 if self.sequence_parallel is None else self.sequence_parallel and tp > 1

    def recomputed(self, module: str) -> bool:
        return self.recompute == "selective" and module in self.recompute_modules

    def describe(self, tp: int, cp: int) -> list[str]:
        """Every assumption, one line each (the planner prints them); tp=0: for layouts of any TP."""
        tokens = self.seq_len * self.micro_batch
        if tp:
            sp = "on" if self.sp(tp) else "off"
        else:
            sp = "off" if self.sequence_parallel is False else "on when TP > 1"
        modules = f" ({', '.join(self.recompute_modules)})" if self.recompute == "selective" else ""
        opt = "sharded over data-parallel replicas (distributed optimizer)" if self.distributed_optimizer \
            else "replicated on every data-parallel rank"
        if not self.optimizer_offload:
            offload = "on the GPU"
        elif self.te_precision_aware_optimizer:
            offload = (f"{self.offload_fraction:.0%} of it on the CPU, fp32 master and 2 moments leave the GPU (12 B: "
                       "TransformerEngine's precision-aware optimizer, not megarl's engine); host: fp32 master, "
                       "grad copy, 2 moments = 16 B")
        else:
            offload = (f"{self.offload_fraction:.0%} of it on the CPU, Adam's 2 moments leave the GPU (8 B), the fp32 "
                       "master stays (megarl's engine, no TransformerEngine); host: fp32 master copy, grad copy, "
                       "2 moments = 16 B")
        return [f"dtype: bf16 weights (2 B), fp32 grads (4 B), Adam fp32 master + 2 moments (12 B) {opt}, {offload}",
                f"micro-batch: {self.micro_batch} x {self.seq_len} tokens = {tokens} (CP={cp}: {tokens // cp} per "
                f"rank); micro-batches per step: {self.micro_batches or 'PP (pipeline full)'}",
                f"recompute: {self.recompute}{modules}; sequence parallel: {sp}",
                "attention: flash-style (no score matrix); MoE routing balanced; 1F1B without virtual stages",
                self._lora_line(),
                "reference snapshot: " + ("none: LoRA's reference is the base with the adapters off" if self.lora_rank
                                          else "yes (+2 B/param)" if self.reference else "no")]

    def _lora_line(self) -> str:
        if not self.lora_rank:
            return "LoRA: off (full fine-tuning: every parameter trained)"
        return (f"LoRA: rank {self.lora_rank} on {','.join(self.lora_targets)}: the base frozen, bf16 weights alone "
                "(2 B/param: no gradient, master copy or Adam state); the adapters (A r x in, B out x r, per expert "
                "for the experts) trained at the costs above; activations as full fine-tuning's")


def _activations(hf: dict, layer: int, train: TrainLayout, s: MemorySettings, cp: int) -> tuple[float, float, float]:
    """One decoder layer's saved activations for one micro-batch, in bytes: (kept until its backward, what
    recompute re-materialises in its backward, all of it without recompute)."""
    hf = language_fields(hf)
    h, tp, etp = hf["hidden_size"], train.tp, train.etp
    tokens = s.seq_len * s.micro_batch / cp
    local = tokens / (tp if s.sp(tp) else 1)  # tokens of the tensors outside TP regions
    parts: dict[str, float] = {"norm_in": 2 * BF16 * h * local, "norm_out": 2 * BF16 * h * local}
    heads = hf["num_attention_heads"]
    if "kv_lora_rank" in hf:  # MLA
        nope, rope, v, kvl = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"], hf["kv_lora_rank"]
        ql = hf.get("q_lora_rank") or 0
        parts["attention"] = BF16 * tokens * (2 * ql + (kvl + rope) + kvl + heads * v / tp)
        parts["attention_up"] = BF16 * tokens * heads * (2 * (nope + rope) + (nope + v)) / tp
    else:
        hd = hf.get("head_dim") or h // heads
        q, kv = heads * hd, (hf.get("num_key_value_heads") or heads) * hd
        parts["attention"] = BF16 * tokens * ((q + 2 * kv) + (q + kv) + q) / tp
    if hf.get("model_type") in UNFUSED_ATTENTION:  # megatron's attention: fp32 softmax output, bf16 probabilities
        parts["core_attn"] = (FP32 + BF16) * tokens * s.seq_len * heads / tp
    else:
        parts["core_attn"] = FP32 * tokens * heads / tp  # flash attention's log-sum-exp
    if hf.get("model_type") == "gemma3_text":  # the post-attention and post-MLP norms' inputs and outputs
        parts["norm_in"], parts["norm_out"] = 2 * parts["norm_in"], 2 * parts["norm_out"]
    if is_moe_layer(hf, layer):
        experts = routed_experts(hf)
        f, topk = expert_width(hf)[0], hf["num_experts_per_tok"]
        routed = local * topk * etp  # token copies this rank's experts compute (balanced routing)
        parts["moe_router"] = FP32 * local * (h + 3 * experts)
        parts["moe_tokens"] = routed * (2 * BF16 * h + FP32)
        parts["moe_act"] = routed * BF16 * 2 * f / etp  # SiLU output and product
        parts["moe_fc1"] = routed * BF16 * 2 * f / etp
        parts["shared_experts"] = BF16 * tokens * 4 * shared_expert_width(hf) / tp
    else:
        parts["mlp"] = BF16 * tokens * 4 * hf["intermediate_size"] / tp
    full = sum(parts.values())
    if s.recompute == "full":
        return BF16 * h * local, full, full
    dropped = {"norm_out"} if s.recomputed("layernorm") else set()
    dropped |= {m for m in ("core_attn", "mlp", "shared_experts", "moe_act") if s.recomputed(m)}
    if s.recomputed("mla_up_proj"):
        dropped.add("attention_up")
    if s.recomputed("moe"):
        dropped |= {"moe_router", "moe_tokens", "moe_act", "moe_fc1", "shared_experts"}
    remade = sum(v for k, v in parts.items() if k in dropped)
    return full - remade, remade, full


@dataclass(frozen=True)
class _ParamIndex:
    """A model's tensors by decoder layer, routed experts by one representative each (an EP rank holds
    num_experts / EP identically shaped ones), so that planning a 671B model over hundreds of layouts is quick."""
    first: tuple[TensorSpec, ...]  # the embedding (first stage)
    last: tuple[TensorSpec, ...]  # final norm and output layer (last stage)
    tied: tuple[TensorSpec, ...]  # a tied model's output-layer copy of the embedding (last stage when PP > 1)
    dense: tuple[tuple[TensorSpec, ...], ...]  # per layer
    experts: tuple[tuple[tuple[TensorSpec, ...], int], ...]  # per layer: expert 0's tensors, routed experts


@functools.lru_cache(maxsize=16)
def _index(model: str) -> _ParamIndex:
    """`model`: the HF config as sorted JSON (a hashable cache key)."""
    hf = json.loads(model)
    layers = language_fields(hf)["num_hidden_layers"]
    first, last, tied, dense = [], [], [], [[] for _ in range(layers)]
    experts: list[tuple[list[TensorSpec], int]] = [([], 0) for _ in range(layers)]
    for spec in hf_inventory(hf):
        if spec.layer is None:
            (first if on_first_stage(spec) else last).append(spec)
            if "embed_tokens" in spec.name and tied_embeddings(hf):
                tied.append(dataclasses.replace(spec, name="output_layer.weight"))
        elif spec.expert is None:
            dense[spec.layer].append(spec)
        elif spec.expert == 0:
            experts[spec.layer] = (experts[spec.layer][0] + [spec], spec.experts)
    return _ParamIndex(tuple(first), tuple(last), tuple(tied), tuple(map(tuple, dense)),
                       tuple((tuple(s), n) for s, n in experts))


def _held(spec: TensorSpec, tp: int, rank: int) -> int:
    lo, hi = spec.rows(tp, rank)
    return (hi - lo) * spec.row_numel


# what a Mixtral expert's projections are called in actor.lora.target_modules
_TARGET_NAMES = dict(zip(MIXTRAL_EXPERT_PARTS, ("gate_proj", "up_proj", "down_proj")))
ATTENTION_TARGETS, MLP_TARGETS = LORA_TARGETS[:4], LORA_TARGETS[4:]


def lora_target(spec: TensorSpec) -> str | None:
    """The actor.lora.target_modules name of the projection a decoder layer's weight `spec` is, or None."""
    if spec.layer is None or not spec.name.endswith(".weight"):
        return None
    module = spec.name.split(".")[-2]
    module = _TARGET_NAMES.get(module, module)
    return module if module in LORA_TARGETS else None


def adaptable_targets(hf: dict) -> tuple[str, ...]:
    """The projections megarl's engine can put adapters on in this model (megarl/engine/lora.py refuses the others
    when it builds): no q/k/v of multi-latent attention, no attention projection of the hybrid (gated delta net and
    gated attention) families, no MLP projection where the experts are stacked in megarl's own module."""
    fields = language_fields(hf)
    model_type = fields.get("model_type")
    model_type = VISION_LANGUAGE[model_type][0] if model_type in VISION_LANGUAGE else model_type  # its language model
    refused = set()
    if "kv_lora_rank" in fields:
        refused |= {"q_proj", "k_proj", "v_proj"}
    if model_type in HYBRID_ATTENTION:
        refused |= set(ATTENTION_TARGETS)
    if model_type in STACKED_EXPERTS:
        refused |= set(MLP_TARGETS)
    return tuple(t for t in LORA_TARGETS if t not in refused)


def lora_fields(section) -> dict:
    """MemorySettings' LoRA fields for a run's actor.lora section."""
    return dict(lora_rank=section.rank, lora_targets=tuple(t for t in LORA_TARGETS if t in lora_targets(section)))


def _adapter_held(r: int, targets: tuple[str, ...], spec: TensorSpec, tp: int, tp_rank: int) -> int:
    """Adapter parameters of LoRA rank r that TP rank `tp_rank` of `tp` holds for `spec` (0 unless it is a targeted
    projection): column-parallel, A [r, in] whole and B [its rows, r]; row-parallel, A [r, its columns] and B [out, r]
    whole."""
    if lora_target(spec) not in targets:
        return 0
    lo, hi = spec.rows(tp, tp_rank)
    out, inp = spec.shape
    return r * (inp + hi - lo) if spec.dim == 0 else r * (hi - lo + out)


def stage_params(hf: dict, train: TrainLayout, stage: int, tp_rank: int = 0, etp_rank: int = 0) -> tuple[int, int]:
    """(dense, routed-expert) parameters held by a rank of `stage` with these TP and ETP ranks."""
    return _stage_count(hf, train, stage, tp_rank, etp_rank, _held)


def check_lora_targets(hf: dict, s: MemorySettings) -> None:
    """A ValueError naming actor.lora.target_modules when s adapts a projection the engine cannot adapt in `hf`."""
    refused = [t for t in s.lora_targets if t not in adaptable_targets(hf)] if s.lora_rank else []
    if refused:
        raise ValueError(f"actor.lora.target_modules (the planner's --lora-targets): {','.join(refused)} take no adapters in model_type="
                         f"{language_fields(hf).get('model_type')!r} (megarl/engine/lora.py: multi-latent and gated "
                         f"attention, gated delta nets, stacked experts); its adaptable projections: "
                         f"{','.join(adaptable_targets(hf))}")


def model_adapters(hf: dict, s: MemorySettings) -> int:
    """The LoRA adapter parameters of the whole model (every projection's A and B whole, every expert's)."""
    check_lora_targets(hf, s)
    return sum(_adapter_held(s.lora_rank, s.lora_targets, spec, 1, 0) for spec in hf_inventory(hf)) if s.lora_rank \
        else 0


def adapter_params(hf: dict, train: TrainLayout, stage: int, s: MemorySettings, tp_rank: int = 0,
                   etp_rank: int = 0) -> tuple[int, int]:
    """(dense, routed-expert) LoRA adapter parameters held by a rank of `stage` with these TP and ETP ranks: what
    megarl/engine/lora.py builds there (0, 0 without LoRA). A projection the engine cannot adapt in this model is a
    ValueError naming actor.lora.target_modules."""
    if not s.lora_rank:
        return 0, 0
    check_lora_targets(hf, s)
    return _stage_count(hf, train, stage, tp_rank, etp_rank,
                        functools.partial(_adapter_held, s.lora_rank, s.lora_targets))


def _stage_count(hf: dict, train: TrainLayout, stage: int, tp_rank: int, etp_rank: int, count) -> tuple[int, int]:
    """(dense, routed-expert) sums of count(spec, tp, rank) over the tensors of `stage`, for these TP and ETP ranks
    (each of the rank's num_experts / EP routed experts of a layer counted alike)."""
    index = _index(json.dumps(hf, sort_keys=True))
    dense_specs = [s for i in _stage_layers(train, stage) for s in index.dense[i]]
    if stage == 0:
        dense_specs += index.first
    if stage == train.pp - 1:
        dense_specs += index.last + (index.tied if train.pp > 1 else ())
    expert = 0
    for i in _stage_layers(train, stage):
        specs, experts = index.experts[i]
        if experts % train.ep:
            raise ValueError(f"ep={train.ep} does not divide the {experts} routed experts of layer {i}")
        expert += experts // train.ep * sum(count(s, train.etp, etp_rank) for s in specs)
    return sum(count(s, train.tp, tp_rank) for s in dense_specs), expert


def _stage_layers(train: TrainLayout, stage: int) -> range:
    first = train.first_layer(stage)
    return range(first, first + train.stage_layers[stage])


def rank_memory(hf: dict, train: TrainLayout, stage: int, s: MemorySettings, cp: int = 1, tp_rank: int = 0,
                etp_rank: int = 0) -> dict[str, float]:
    """Bytes on one GPU of `stage` (TP rank tp_rank, ETP rank etp_rank): static state, activations, the peak;
    and the host memory its optimizer offload takes. `train.dp` counts the CP x DP replicas. `params` counts the
    model's parameters the rank holds, `adapters` its LoRA adapters' (0 without LoRA)."""
    if train.dp % cp:
        raise ValueError(f"cp={cp} must divide the {train.dp} data-parallel replicas (CP x DP)")
    dense, expert = stage_params(hf, train, stage, tp_rank, etp_rank)
    params = dense + expert
    if s.lora_rank:  # the adapters train, the base (params) is frozen
        dense, expert = adapter_params(hf, train, stage, s, tp_rank, etp_rank)
    trained = dense + expert
    shards = dense / train.dp + expert / train.expert_dp if s.distributed_optimizer else trained
    on_cpu = s.offload_fraction * shards if s.optimizer_offload else 0.0
    # what leaves the GPU per offloaded parameter: Adam's two moments; the fp32 master copy too only with TE's
    # precision-aware optimizer (megarl's engine keeps it on the GPU)
    left_gpu = 3 * FP32 if s.te_precision_aware_optimizer else 2 * FP32
    adapters = trained if s.lora_rank else 0
    out = dict(params=params, adapters=adapters, weights=BF16 * (params + adapters), grads=FP32 * trained,
               optimizer=3 * FP32 * shards - left_gpu * on_cpu,
               reference=BF16 * params if s.reference and not s.lora_rank else 0.0, host=4 * FP32 * on_cpu)
    out["static"] = out["weights"] + out["grads"] + out["optimizer"] + out["reference"]
    layers = [_activations(hf, i, train, s, cp) for i in _stage_layers(train, stage)]
    in_flight = train.pp - stage if not s.micro_batches else min(train.pp - stage, s.micro_batches)
    out["activations"] = in_flight * sum(kept for kept, _, _ in layers)
    out["logits"] = 0.0
    if stage == train.pp - 1:
        vocab = -(-language_fields(hf)["vocab_size"] // train.tp)
        out["logits"] = 2 * FP32 * s.seq_len * s.micro_batch / cp * vocab
    out["backward_working"] = max((full + remade for _, remade, full in layers), default=0.0)
    # the optimizer step runs after the backward has freed the activations; the CPU updates the offloaded part
    out["step_transient"] = FP32 * (shards - on_cpu)
    out["peak"] = out["static"] + max(out["activations"] + out["logits"] + out["backward_working"],
                                      out["step_transient"])
    return out


def stage_memory(hf: dict, train: TrainLayout, s: MemorySettings, cp: int = 1) -> list[dict[str, float]]:
    """Per pipeline stage, the memory of its most loaded rank (TP/ETP shards differ only by padding)."""
    out = []
    for stage in range(train.pp):
        ranks = [rank_memory(hf, train, stage, s, cp, t, e) for t in range(train.tp) for e in range(train.etp)]
        out.append(max(ranks, key=lambda r: r["peak"]))
    return out


def predict_peak(hf: dict, train: TrainLayout, s: MemorySettings, cp: int = 1) -> float:
    """The per-GPU peak of a run, in bytes: the largest over its ranks (what the GPU runs compare with the
    measured torch.cuda.max_memory_allocated())."""
    return max(r["peak"] for r in stage_memory(hf, train, s, cp))


def host_per_node(hf: dict, train: TrainLayout, s: MemorySettings, gpus_per_node: int, cp: int = 1) -> float:
    """Host memory the optimizer offload takes on the most loaded node, in bytes (ranks numbered TP first,
    then CP x DP, then PP, as megatron does: a node holds consecutive ranks)."""
    per_stage = [rank_memory(hf, train, p, s, cp)["host"] for p in range(train.pp)]
    per_rank = [per_stage[train.coords(r)[2]] for r in range(train.world)]
    return max(sum(per_rank[n:n + gpus_per_node]) for n in range(0, train.world, gpus_per_node))
