"""How SGLang 0.5.17 holds the HF tensors it is sent: the "sglang" weight layout (megarl.rollout.weight_layout).

SGLang's decoders (qwen2, llama, qwen3, qwen3_moe, mistral (its llama model), mixtral, deepseek_v2/v3, glm4_moe,
qwen3_5, qwen3_next) at
TP=tp: stacked parameters as its `stacked_params_mapping` and `FusedMoE.make_expert_params_mapping` name them
(Mixtral's block_sparse_moe.experts.{e}.w1/w3/w2 into block_sparse_moe.experts.w13_weight/w2_weight, its router
block_sparse_moe.gate.weight as is); column-parallel rows and row-parallel columns as megarl's inventory cuts them
(K/V heads replicated above their count); vocabulary rows as VocabParallelEmbedding cuts a vocabulary padded to a
multiple of 64, its padding rows zero-filled (they add nothing to a checksum): `sglang_vocab_rows`.
With --ep-size EP (rollout.sglang_args), as FusedMoE holds routed experts with no DeepEP-class all-to-all and
the trivial expert location (layers/moe/fused_moe_triton/layer.py: num_local_experts, weight_loader's
_map_global_expert_id_to_local_expert_id; distributed/parallel_state.py's MoE groups, MoE TP fastest): TP
rank t holds experts [e * E / EP, (e + 1) * E / EP) of each layer for e = t // (TP / EP), at local indices
0..E / EP - 1 of w13/w2, each cut into TP / EP row blocks (block t % (TP / EP)); loads of the other experts are
dropped. Everything else (attention, dense MLPs, shared experts, the router) stays TP-cut over all TP ranks.
Settings that place weights otherwise (DeepEP, redundant experts, EPLB, DP attention ...) are refused by
megarl.config.sglang_args.sglang_ep_size, naming them.
DeepSeek (models/deepseek_v2.py, deepseek_common/deepseek_weight_loader.py), bf16 without quantization:
- MLA with q_lora_rank: q_a_proj and kv_a_proj_with_mqa concatenated into fused_qkv_a_proj_with_mqa
  (replicated); without it (V2-Lite) both stay as they are;
- shared experts' gate/up in shared_experts.gate_up_proj, TP-sharded as a dense MLP; where SGLang fuses the
  shared expert into the routed ones (`sglang_fuses_shared_experts`: DeepSeek-V3/R1's 256 experts with one
  shared expert, at --ep-size 1 without --disable-shared-experts-fusion) it is expert n_routed_experts of
  w13/w2;
- gate.e_score_correction_bias held in float32 whatever it is sent in (MoEGate creates it so; the
  loader's copy converts);
- derived tensors, neither parameters nor buffers: post_load_weights splits each layer's kv_b_proj (this
  rank's heads) into w_kc [heads, qk_nope, kv_lora] and w_vc [heads, kv_lora, v] (transposed), which the
  absorbed MLA decode multiplies by instead of kv_b_proj. SGLang reruns it at the end of every load_weights
  call for the layers whose kv_b_proj that call carried, so updates through any loader refresh them; they
  are checksummed (in logical element order, as every tensor) like parameters, so a stale one is named.
- a load_weights call fuses the a-projections only when it carries both: `keep_fused_pairs`.
GLM-4.5 (models/glm4_moe.py): q/k/v (and their biases) in qkv_proj, dense MLPs' and shared experts' gate/up in
gate_up_proj, routed experts in mlp.experts.w13_weight/w2_weight, the router's gate.weight and its float32
gate.e_score_correction_bias as they are; its one shared expert becomes routed expert n_routed_experts of w13/w2 where
SGLang fuses it (`sglang_fuses_shared_experts`).
Gemma 3 (models/gemma3_causal.py): q/k/v in qkv_proj, gate/up in gate_up_proj, its four norms per layer and
q_norm/k_norm as named; the embedding a plain nn.Embedding, whole on every rank (inventory's whole_for_generation),
which the head is tied to (lm_head.weight skipped). Its multimodal checkpoints, trained as text-only policies
(models/gemma3_mm.py there): the same under language_model.model.*, its Gemma3ForConditionalGeneration's own parameter
names (its load_weights hands those to Gemma3ForCausalLM's loader); the vision tower is never sent.
Qwen2.5-VL (models/qwen2_5_vl.py): the language model as qwen2's; the vision tower whole on every rank (megarl's
servers for a vision-language model run it data-parallel over TP, --mm-enable-dp-encoder: sglang_server.py), each
block's attn.qkv held as attn.qkv_proj, its mlp's gate/up (weights and biases) fused into gate_up_proj, the MLP's
width padded with zeros to a multiple of 8 (Qwen2_5_VisionTransformer's mlp_hidden_size: gate and up each take the
padded rows, down_proj's rows the padded length).
Qwen3-VL (models/qwen3_vl.py): its checkpoint's model.language_model.* held as model.* (the language model as qwen3's)
and model.visual.* as visual.*; the tower whole on every rank as Qwen2.5-VL's, each block's attn.qkv held as
attn.qkv_proj, everything else (the GELU MLP's linear_fc1/linear_fc2, the position embeddings, the mergers and the
DeepStack mergers) as it is.
Qwen3.5, Qwen3.5-MoE (models/qwen3_5.py) and Qwen3-Next (models/qwen3_next.py): the loaders drop the attention's
`self_attn.` (model.layers.{i}.qkv_proj, o_proj, q_norm, k_norm; q_proj's per-head query and gate rows are
QKVParallelLinear's q part, cut by heads). The gated delta nets under linear_attn.: Qwen3.5's in_proj_qkv and
in_proj_z held as in_proj_qkvz = [q; k; v; z] and in_proj_b / in_proj_a as in_proj_ba = [b; a], each part the rank's
TP block (MergedColumnParallelLinear); Qwen3-Next's in_proj_qkvz / in_proj_ba, grouped per key head in the
checkpoint, as contiguous row blocks (ColumnParallelLinear); conv1d in both as [q; k; v], each part's TP block
(mamba_v2_sharded_weight_loader); dt_bias and A_log by value heads, A_log held in float32; norm whole. The MoE
models' router gate, shared_expert_gate as they are, the shared expert's gate/up in shared_expert.gate_up_proj, routed
experts in w13/w2 as Qwen3-MoE's. Refused where this is not what SGLang would hold (`check_hybrid_rollout`): sharded
delivery at TP > 1 (those loaders cut the rank's rows of conv1d, dt_bias and A_log out of whatever they are given,
presharded or not, and in_proj_qkv's part by part, which megarl's row blocks do not express), and the MoE models
without --disable-shared-experts-fusion (SGLang may fold their gated shared expert into FusedMoE).

Sharded delivery (each rank's rows loaded as presharded weights) is refused before anything is sent where SGLang's
presharded loading would take other rows than megarl's: `check_presharded_vocab`, `check_presharded_tower`.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

from megarl.config.sglang_args import sglang_flags
from megarl.reshard.layout import sglang_generation
from megarl.utils.hf_config import GATED_SHARED_EXPERT, HYBRID_ATTENTION

SGLANG_VOCAB_PADDING = 64  # sglang's DEFAULT_VOCAB_PADDING_SIZE: VocabParallelEmbedding pads the vocabulary to it
# SGLang's fused parameters: HF tensor "<prefix><part>.<weight|bias>" -> "<prefix><fused>.<weight|bias>", the
# parts concatenated along dim 0 in this order (each part's TP rows of the rank); only where every part exists
# (DeepSeek-V2-Lite's MLA q_proj is no qkv_proj part: it has no k_proj)
_FUSED = (
    (re.compile(r"(.*\.self_attn\.)(q_proj|k_proj|v_proj)\.(weight|bias)$"), "qkv_proj",
     ("q_proj", "k_proj", "v_proj")),
    (re.compile(r"(.*\.mlp\.(?:shared_experts?\.)?)(gate_proj|up_proj)\.(weight|bias)$"), "gate_up_proj",
     ("gate_proj", "up_proj")),
    (re.compile(r"(.*\.self_attn\.)(q_a_proj|kv_a_proj_with_mqa)\.(weight)$"), "fused_qkv_a_proj_with_mqa",
     ("q_a_proj", "kv_a_proj_with_mqa")),
)
_EXPERT = re.compile(r"(.*\.(?:mlp|block_sparse_moe)\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
# a routed expert's projection (Mixtral's w1/w3/w2) -> its part of FusedMoE's w13 (gate, up) or w2 (down)
_EXPERT_PART = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_SHARED_EXPERT = re.compile(r"(.*\.mlp\.)shared_experts\.(gate|up|down)_proj\.weight$")
_KV_B = re.compile(r"(.*\.self_attn\.)kv_b_proj\.weight$")
# SGLang's Qwen2.5-VL vision tower (module docstring): the renamed qkv, and the MLP tensors of the padded width
_VISION_QKV = re.compile(r"((?:model\.)?visual\.blocks\.\d+\.attn\.)qkv\.(weight|bias)$")
# SGLang's Qwen3-VL (load_weights): the checkpoint's module prefixes -> its own
_SGLANG_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))
_VISION_MLP = re.compile(r"visual\.blocks\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.(weight|bias)$")
SGLANG_VISION_MLP_ALIGN = 8
# SGLang's Qwen3.5 / Qwen3.5-MoE / Qwen3-Next gated delta nets (module docstring): HF tensor -> (parameter, the
# part sizes SGLang cuts by TP one by one, given (qk, v, value heads)), the parameter's earlier parts from `_PRECEDING`
_LINEAR_PARTS = re.compile(r"(.*\.linear_attn\.)(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|conv1d)\.weight$")
_LINEAR_FUSED = {"in_proj_qkv": "in_proj_qkvz", "in_proj_z": "in_proj_qkvz", "in_proj_b": "in_proj_ba",
                 "in_proj_a": "in_proj_ba", "conv1d": "conv1d"}
_PRECEDING = {"in_proj_z": "in_proj_qkv", "in_proj_a": "in_proj_b"}
# parameters SGLang holds in another dtype than the policy's, whatever they are sent in
_HELD_DTYPE = ((re.compile(r".*\.mlp\.gate\.e_score_correction_bias$"), torch.float32),
               (re.compile(r".*\.linear_attn\.A_log$"), torch.float32))
# tensor attributes SGLang's modules derive from their parameters after loading; checksummed as parameters
DERIVED_ATTRIBUTES = ("w_kc", "w_vc")


def sglang_vocab_rows(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of a vocabulary of `vocab` rows that SGLang TP rank `rank` of `tp` holds (VocabParallelEmbedding:
    the vocabulary padded to a multiple of 64, cut into `tp` equal blocks; the padding rows are no HF rows)."""
    per = -(-vocab // SGLANG_VOCAB_PADDING) * SGLANG_VOCAB_PADDING // tp
    return min(rank * per, vocab), min((rank + 1) * per, vocab)


def sglang_fuses_shared_experts(hf: dict | None, ep: int = 1, sglang_args=()) -> bool:
    """Whether SGLang 0.5.17 makes a model's shared expert one more routed expert (determine_num_fused_shared_experts
    of DeepseekV2ForCausalLM and Glm4MoeForCausalLM): DeepseekV3ForCausalLM with 256 routed experts and one shared
    expert, or Glm4MoeForCausalLM with one shared expert (any number of routed ones), on an sm80+ NVIDIA GPU, at
    --ep-size 1 (on NVIDIA it fuses under expert parallelism only when enforced, which megarl.reshard.layout refuses;
    GLM never does), without --disable-shared-experts-fusion or DeepEP, and for DeepSeek without two-batch overlap
    (384 experts only for a quark checkpoint, which megarl never sends)."""
    if not hf or ep > 1 or "--disable-shared-experts-fusion" in sglang_flags(sglang_args):
        return False
    architecture = (hf.get("architectures") or [None])[0]
    if architecture == "Glm4MoeForCausalLM":
        return hf.get("n_shared_experts") == 1
    return (architecture == "DeepseekV3ForCausalLM" and hf.get("n_routed_experts") == 256
            and hf.get("n_shared_experts") == 1)


class SGLangLayout:
    """The "sglang" weight layout (module docstring; the interface: megarl.rollout.weight_layout.WeightLayout).
    `hf`: the model's config.json (what SGLang decides from it beyond the tensors' shapes:
    `sglang_fuses_shared_experts`); `sglang_args`: the servers' extra arguments (rollout.sglang_args: --ep-size
    places whole experts, and settings that place weights otherwise are refused by
    megarl.config.sglang_args.sglang_ep_size)."""

    def __init__(self, specs: list, tp: int = 1, hf: dict | None = None, sglang_args=()):
        self.specs = {s.name: s for s in specs}
        # SGLang's placement: TP rows, and with --ep-size whole experts (FusedMoE's contiguous blocks, MoE TP rows)
        self.gen = sglang_generation(tp, sglang_args)
        self.tp = self.gen.tp
        experts = [s.shape[0] for s in specs if s.name.endswith(".mlp.gate.weight")]
        # the index of the shared expert among the routed ones in w13/w2, where SGLang fuses it
        fused = sglang_fuses_shared_experts(hf, self.gen.ep, sglang_args)
        self.shared_expert = experts[0] if experts and fused else None
        # Qwen3.5 / Qwen3-Next: SGLang's loaders drop the attention's self_attn. (module docstring)
        self.hybrid = any(".linear_attn." in name for name in self.specs)

    def rows(self, name: str, rank: int) -> tuple[int, int] | None:
        spec = self.specs[name]
        if spec.pad_vocab and not spec.whole_for_generation:
            return sglang_vocab_rows(spec.length, self.tp, rank)
        return self.gen.rows(spec, rank)

    def piece(self, key, tensor: torch.Tensor, rank: int, presharded: bool):
        name = key if isinstance(key, str) else key[0]
        spec = self.specs[name]
        rows = self.rows(name, rank)
        if rows is None:
            return None
        piece = tensor
        linear = _LINEAR_PARTS.match(name)
        if spec.dim is not None and not presharded and not spec.parts:
            piece = tensor.narrow(spec.dim, rows[0], rows[1] - rows[0])
        if linear and spec.parts:  # sent whole; SGLang cuts each of its parts by TP: the rank's part of each
            parts = tensor.split(self._linear_part_sizes(linear.group(1)), 0)
            piece = torch.cat([_tp_block(name, part, self.tp, rank % self.tp) for part in parts])
        param, offset = self.place(name, rank)
        if name.endswith("mlp.down_proj.weight") and _VISION_MLP.match(name):  # rows of the padded width
            return param, piece, offset, _vision_mlp_width(spec.shape[1])
        return param, piece, offset, None

    def _held_numel(self, name: str, rank: int) -> int:
        """Elements of HF tensor `name` that engine rank `rank` holds, with the padding SGLang adds to them."""
        spec = self.specs[name]
        lo, hi = self.rows(name, rank)
        if spec.dim is None and _VISION_MLP.match(name) and "down_proj" not in name:  # gate/up: padded rows
            return _vision_mlp_width(spec.shape[0]) * spec.numel // spec.shape[0]
        return (hi - lo) * spec.row_numel

    def place(self, name: str, rank: int) -> tuple[str, int]:
        """SGLang's parameter holding HF tensor `name` on rank `rank` (which holds some of it), and the element
        offset of its piece there."""
        param, offset = self._place(name, rank)
        if self.hybrid:
            param = param.replace(".self_attn.", ".")
        for prefix, sglang_prefix in _SGLANG_PREFIXES:
            if param.startswith(prefix):
                return sglang_prefix + param[len(prefix):], offset
        return param, offset

    def _place(self, name: str, rank: int) -> tuple[str, int]:
        expert = self._expert(name)
        if expert:
            prefix, index, part = expert
            spec = self.specs[name]
            lo, hi = self.rows(name, rank)
            shard = (hi - lo) * spec.row_numel  # one expert's gate, up or down shard: all three alike in size
            if spec.expert is not None:  # FusedMoE's local index: the expert's place in its EP rank's block
                index -= self.gen.expert_owner(spec) * (spec.experts // self.gen.ep)
            if part == "down":
                return prefix + "w2_weight", index * shard
            return prefix + "w13_weight", (2 * index + (part == "up")) * shard
        linear = _LINEAR_PARTS.match(name)
        if linear:  # in_proj_qkvz = [q; k; v; z], in_proj_ba = [b; a], each part the rank's TP block
            prefix, part = linear.groups()
            before = self.specs.get(f"{prefix}{_PRECEDING.get(part)}.weight")
            return f"{prefix}{_LINEAR_FUSED[part]}.weight", before.numel // self.tp if before else 0
        for pattern, fused, parts in _FUSED:
            match = pattern.match(name)
            if match:
                prefix, part, suffix = match.groups()
                siblings = [f"{prefix}{p}.{suffix}" for p in parts]
                if not all(s in self.specs for s in siblings):
                    break
                offset = sum(self._held_numel(sibling, rank) for sibling in siblings[:parts.index(part)])
                return f"{prefix}{fused}.{suffix}", offset
        if _VISION_QKV.match(name):
            return _VISION_QKV.sub(r"\1qkv_proj.\2", name), 0
        return name, 0

    def _linear_part_sizes(self, prefix: str) -> list[int]:
        """Rows of the q, k and v parts of a gated delta net's in_proj_qkv and conv1d (`prefix`: its linear_attn.)."""
        v = self.specs[prefix + "out_proj.weight"].shape[1]
        qk = (self.specs[prefix + "conv1d.weight"].shape[0] - v) // 2
        return [qk, qk, v]

    def _expert(self, name: str) -> tuple[str, int, str] | None:
        """(w13/w2's module prefix, expert index, gate/up/down) of a routed expert's tensor, or of the shared
        expert's where SGLang fuses it into the routed ones."""
        match = _EXPERT.match(name)
        if match:
            return match.group(1), int(match.group(2)), _EXPERT_PART[match.group(3)]
        match = _SHARED_EXPERT.match(name) if self.shared_expert is not None else None
        if match:
            return match.group(1) + "experts.", self.shared_expert, match.group(2)
        return None

    def parameters(self, rank: int) -> list[str]:
        names = dict.fromkeys(self.place(name, rank)[0] for name in self.specs if self.rows(name, rank) is not None)
        for name in self.specs:
            match = _KV_B.match(name)
            if match:
                names.update(dict.fromkeys(match.group(1) + a for a in DERIVED_ATTRIBUTES))
        return list(names)

    def as_held(self, param: str, piece: torch.Tensor) -> torch.Tensor:
        for pattern, dtype in _HELD_DTYPE:
            if pattern.match(param) and piece.dtype != dtype:
                return piece.to(dtype)
        return piece

    def derived(self, name: str, piece: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """SGLang's MLA w_kc and w_vc from kv_b_proj (DeepseekV2WeightLoaderMixin.post_load_weights)."""
        match = _KV_B.match(name)
        if not match:
            return []
        prefix = match.group(1)
        spec = self.specs[name]
        v = self.specs[prefix + "o_proj.weight"].shape[1] // spec.units
        nope = spec.shape[0] // spec.units - v
        heads = piece.unflatten(0, (-1, nope + v))  # [heads of the rank, nope + v, kv_lora]
        return [(prefix + "w_kc", heads[:, :nope]), (prefix + "w_vc", heads[:, nope:].transpose(1, 2))]


def _tp_block(name: str, part: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """TP rank `rank`'s block of `part`'s rows, as SGLang's loaders cut it (they assert TP divides it)."""
    if part.shape[0] % tp:
        raise ValueError(f"{name}: SGLang cuts its part of {part.shape[0]} rows by TP={tp}, which does not divide it")
    size = part.shape[0] // tp
    return part.narrow(0, rank * size, size)


def _vision_mlp_width(width: int) -> int:
    return -(-width // SGLANG_VISION_MLP_ALIGN) * SGLANG_VISION_MLP_ALIGN


def check_presharded_vocab(specs: list, tp: int) -> None:
    """SGLang's presharded embedding/lm_head loading takes exactly vocab // tp rows on every rank, placed at the
    rank's block of the vocabulary padded to a multiple of 64 (`sglang_vocab_rows`); megarl's shards (inventory
    TensorSpec.rows) must be those rows, else refuse before anything is sent."""
    for spec in specs:
        if not spec.pad_vocab or spec.whole_for_generation:
            continue
        vocab = spec.length
        for rank in range(tp):
            ours, theirs = spec.rows(tp, rank), sglang_vocab_rows(vocab, tp, rank)
            if ours != theirs or ours[1] - ours[0] != vocab // tp:
                raise ValueError(
                    f"{spec.name}: vocabulary of {vocab} rows at TP={tp}: SGLang's presharded loading takes rows "
                    f"{list(theirs)} on rank {rank} and needs {vocab // tp} (vocab // tp) there, megarl's shard is "
                    f"{list(ours)}; sharded delivery into SGLang needs a vocabulary that is a multiple of "
                    f"{SGLANG_VOCAB_PADDING} and of TP: use rollout.weight_delivery=full")


def check_presharded_tower(specs: list) -> None:
    """Sharded delivery loads every tensor into SGLang as its rank's shard, as sent (sglang_loader.load_presharded),
    which skips the zero padding SGLang's loader adds to a vision tower MLP whose width is not a multiple of 8 (its
    shape assertion then fails): refuse before anything is sent."""
    for spec in specs:
        if _VISION_MLP.match(spec.name) and spec.name.endswith("gate_proj.weight") and \
                spec.shape[0] % SGLANG_VISION_MLP_ALIGN:
            raise ValueError(f"{spec.name}: the vision tower's MLP width {spec.shape[0]} is not a multiple of "
                             f"{SGLANG_VISION_MLP_ALIGN}; SGLang pads it while loading whole tensors only: use "
                             "rollout.weight_delivery=full")


def check_hybrid_rollout(hf: dict, tp: int, delivery: str, sglang_args=()) -> str | None:
    """Why SGLang at TP `tp` cannot take a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next policy as the layout models it, or None.
    Sharded delivery at TP > 1: SGLang's loaders of conv1d, dt_bias and A_log cut the rank's rows out of what they
    are given even when it is presharded, and in_proj_qkv's is cut part by part, which megarl's row blocks do not
    express. The MoE models' gated shared expert: SGLang may fold a shared expert as wide as the routed ones into
    its FusedMoE (Qwen2MoeSparseMoeBlock's shared-expert fusion), which the layout does not model: it needs
    --disable-shared-experts-fusion."""
    model_type = hf.get("model_type")
    if model_type not in HYBRID_ATTENTION:
        return None
    if delivery == "sharded" and tp > 1:
        return (f"model_type={model_type} at rollout.sglang_tp={tp}: SGLang cuts its linear-attention conv1d, dt_bias, "
                "A_log and in_proj_qkv from whole tensors itself, which sharded delivery does not send: set "
                "rollout.weight_delivery=full")
    if model_type in GATED_SHARED_EXPERT and "--disable-shared-experts-fusion" not in sglang_flags(sglang_args):
        return (f"model_type={model_type}: SGLang may fold its gated shared expert into the routed experts, a place "
                "the weight sync's layout does not model: add --disable-shared-experts-fusion to rollout.sglang_args")
    return None


def keep_fused_pairs(buckets: Iterable[list]) -> Iterator[list]:
    """The buckets, but a DeepSeek q_a_proj never without its layer's kv_a_proj_with_mqa: it waits for the bucket
    that carries it. SGLang's DeepSeek loader (do_load_weights) builds fused_qkv_a_proj_with_mqa only when one
    load_weights call carries both (it caches the first in a dict local to the call): split by a bucket boundary,
    both halves are dropped without a word and the fused parameter keeps its old values. Every transport loads a
    bucket per call. megarl's buckets put q_a_proj first (the inventory's order); a q_a_proj arriving after its
    kv_a_proj_with_mqa was sent is refused."""
    waiting: list = []
    sent: set[str] = set()  # the kv_a_proj_with_mqa sent so far
    for bucket in buckets:
        bucket = waiting + list(bucket)
        names = {name for name, _ in bucket}
        late = sorted(n for n in names if n.endswith(".q_a_proj.weight") and _partner(n) in sent)
        if late:
            raise ValueError(f"{late[0]} comes after {_partner(late[0])} was sent: SGLang fuses the two only when "
                             "one load carries both")
        lone = {n for n in names if n.endswith(".q_a_proj.weight") and _partner(n) not in names}
        waiting = [(n, t) for n, t in bucket if n in lone]
        sent.update(n for n in names if n.endswith(".kv_a_proj_with_mqa.weight"))
        bucket = [(n, t) for n, t in bucket if n not in lone]
        if bucket:
            yield bucket
    if waiting:
        raise ValueError(f"{waiting[0][0]} without {_partner(waiting[0][0])}: SGLang cannot load one without the other")


def _partner(q_a_proj: str) -> str:
    return q_a_proj.replace(".q_a_proj.", ".kv_a_proj_with_mqa.")
