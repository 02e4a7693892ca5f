"""DeepSeek-V3 and DeepSeek-V2 (transformers' DeepseekV3ForCausalLM / DeepseekV2ForCausalLM): multi-latent
attention (MLA) on megatron-core's MLASelfAttention, the first `first_k_dense_replace` layers with a dense
SwiGLU MLP and the rest with DeepSeekMoE (megarl/models/deepseek_moe.py). The multi-token-prediction layers
(num_nextn_predict_layers) are not built.

MLA, as transformers computes it, per head: q = q_b(norm(q_a(x))) (V3; V2-Lite's q_lora_rank=null: q = q_proj(x)),
split into qk_nope_head_dim and qk_rope_head_dim; kv_a(x) gives a kv_lora_rank latent (normed, then kv_b makes
each head's k_nope and v, v_head_dim != qk_nope_head_dim) and one rope key shared by all heads. megatron's MLA
computes the same with these choices made here:
- Norms: megatron builds MLA's q/kv norms only from the spec (its own spec turns them into IdentityOp unless
  qk_layernorm is set). The spec here sets them explicitly and the config keeps qk_layernorm=False: with it
  set, megatron's finalize_model_grads sums every `q_layernorm` gradient over TP by name, which is right for
  per-head QK-norm but doubles MLA's, whose latent norm every TP rank computes whole. The latent norms see
  the same tokens as the down projections (a sequence-parallel slice under SP): norm.py's HiddenNorm, which
  marks them for megatron's SP gradient sum. transformers' latent norms keep RMSNorm's eps 1e-6 whatever
  rms_norm_eps says; so do these.
- Down projections (q_a, kv_a) are replicated on every TP rank, as with TransformerEngine's "duplicated" linear
  (megatron's local spec makes them column-parallel and gathers their output back every forward); the up
  projections (q_b or q_proj, kv_b) are column-parallel by head and o_proj row-parallel. So TP must divide
  num_attention_heads only. The rope key shared by all heads gets its gradient summed over TP (DeepseekMLA:
  megatron does so only under sequence parallelism).
- RoPE: DeepSeek's checkpoints keep each head's rope dims as interleaved pairs (x0, x1), (x2, x3) ...;
  transformers (V3's apply_rotary_pos_emb_interleave, V2's complex multiply) rotates each pair by one
  frequency. megatron's MLA does exactly that (its apply_rotary_pos_emb de-interleaves when
  multi_latent_attention is set, as V3 does), so the weights load unpermuted. V3's rope_interleave=false
  (non-interleaved checkpoints) is refused.
- YaRN: megatron's YarnRotaryEmbedding (the frequencies of transformers' yarn rope, truncated correction
  range, attention factor mscale(factor, mscale) / mscale(factor, mscale_all_dim), as DeepSeek's code and
  SGLang). transformers computes that factor differently when mscale_all_dim is 0 and mscale is not 1, or
  mscale is unset: those settings are refused by key. The softmax scale is (qk head dim)^-0.5 times
  mscale(factor, mscale_all_dim)^2, as DeepSeek's code, SGLang and transformers' DeepseekV3 do; transformers
  5.12's DeepseekV2Attention leaves out that factor, so for a V2 checkpoint with mscale_all_dim set megarl
  follows the model's definition and SGLang, not transformers (the published V2 checkpoints set it).
- Position ids: MLA computes its rotary table inside each layer for positions 0..L-1; packed rows restart
  positions per sequence, so engine/packing.reset_rotary_positions indexes each layer's table by the
  micro-batch's position ids (megatron's own packed path wants TransformerEngine's 'thd' layout, which
  megarl does not use: packed rows go by a block-diagonal mask or by cu_seqlens in the 'sbhd' layout).

Core attention (engine/attention.py): on CPU megatron's DotProductAttention ('local', the reference; packed rows
by the block-diagonal mask); on the GPU varlen flash attention over cu_seqlens (packed rows; v padded to the
qk head dim and cut back, as flash kernels take one head dim) or masked SDPA ('sdpa'). megatron's MLA passes
the softmax scale above to each.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from megatron.core.models.common.embeddings import _yarn_get_mscale
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.post_training.modelopt.layers import Linear as ReplicatedLinear
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megarl.models.decoder import DecoderFamily, rope_parameters
from megarl.models.norm import HiddenNorm
from megarl.models.sharding import WeightMap, replicated, split_dim

def _moe():
    """DeepSeekMoE's side (routing, experts, their weights): megarl/models/deepseek_moe.py, imported only for
    checkpoints with mixture-of-experts layers."""
    from megarl.models import deepseek_moe

    return deepseek_moe


def is_moe_layer(hf: dict, layer: int) -> bool:
    """transformers builds the first first_k_dense_replace layers dense, the rest as mixtures of experts."""
    return layer >= hf.get("first_k_dense_replace", 0) and _moe().is_moe_layer(hf, layer)


class DenseThenMoe:
    """The MLP side of a family whose first first_k_dense_replace layers are dense SwiGLU MLPs and the rest
    DeepSeekMoE (DeepSeek-V3/V2, GLM-4.5: deepseek_moe.py); mixed in before DecoderFamily."""

    def moe_config(self, hf: dict, ep: int) -> dict:
        if not any(is_moe_layer(hf, i) for i in range(hf["num_hidden_layers"])):
            return super().moe_config(hf, ep)  # every layer dense (EP > 1 is refused there)
        # Which layers are MoE, as megatron spells it: its dist checkpoints then key every layer by its own
        # index (dense and MoE layers hold different parameters; a stacked key over all layers cannot be saved).
        return _moe().moe_config(hf, ep) | dict(moe_layer_freq=[int(is_moe_layer(hf, i))
                                                                for i in range(hf["num_hidden_layers"])])

    def with_moe_mlp(self, spec: ModuleSpec, hf: dict, layer: int) -> ModuleSpec:
        """A layer spec with DeepSeekMoE as its `mlp` where `layer` is a MoE layer."""
        if is_moe_layer(hf, layer):
            spec.submodules.mlp = _moe().moe_mlp_spec(hf)
        return spec

    def mlp_maps(self, hf: dict, tp: int, layer: int) -> list[WeightMap]:
        if is_moe_layer(hf, layer):
            return _moe().moe_weight_maps(hf, tp, layer)
        return super().mlp_maps(hf, tp, layer)


LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm(q_lora_rank) / (kv_lora_rank): the default eps


class LatentNorm(HiddenNorm):
    """The q/kv latent RMSNorm (over q_lora_rank / kv_lora_rank), with transformers' eps."""

    def __new__(cls, config, hidden_size: int, eps: float = LATENT_NORM_EPS, **unused):
        return super().__new__(cls, config, hidden_size, eps=LATENT_NORM_EPS)


def patch_mla_without_te() -> None:
    """megatron-core 0.16.1's MLA tests `isinstance(linear_proj, TELinear)` whenever its module imported megatron's
    TransformerEngine extension, which without TE defines TELinear as a MagicMock: a TypeError. Marking that
    module TE-less skips the test (an FP8 memory saving that needs TE anyway)."""
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention

    if not transformer_engine.HAVE_TE:
        multi_latent_attention.HAVE_TE = False


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; the gradient all-reduced over the TP group backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class DeepseekMLA(MLASelfAttention):
    """megatron's MLA with the shared rope key's gradient summed over TP also without sequence parallelism.

    The rope key comes out of the replicated kv down projection whole on every TP rank, and each rank's heads
    use it: its gradient is partial per rank. megatron sums it only through the sequence-parallel gather it applies
    under SP (whose backward is a reduce-scatter); at TP > 1 without SP the down projection and everything before
    it would get a partial gradient. Here the rope slice of the projection's output passes _SumGradOverTP in that
    case (megatron's own copy-to-TP-region would not do: its all-reduce works on `grad.contiguous()` and returns
    the original, so the slice's non-contiguous gradient comes back unreduced)."""

    def __init__(self, config, submodules, layer_number, **kwargs):
        super().__init__(config, submodules, layer_number, **kwargs)
        if self.tp_group.size() > 1 and not config.sequence_parallel:
            self.linear_kv_down_proj.register_forward_hook(self._sum_rope_key_grad_over_tp)

    def _sum_rope_key_grad_over_tp(self, module, args, output):
        kv, bias = output
        latent, rope_key = kv.split([self.config.kv_lora_rank, self.config.qk_pos_emb_head_dim], dim=-1)
        return torch.cat([latent, _SumGradOverTP.apply(rope_key, self.tp_group)], -1), bias


class MLADotProductAttention(DotProductAttention):
    """megatron's unfused core attention ('local') for MLA: megatron's own takes neither the query-key head dim
    nor the value head dim that MLA passes (k_channels, v_channels) and sizes its output by kv_channels."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if v_channels is not None:  # megatron's Attention base builds a first core attention without it
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


def _rope_config(hf: dict) -> dict:
    """MLATransformerConfig's RoPE fields for the checkpoint's rope_parameters (module docstring: YaRN)."""
    params = rope_parameters(hf)
    rope_type = params["rope_type"]
    if rope_type == "default":
        # mscale_all_dim 0: no softmax-scale factor; rotary_scaling_factor is read by that factor only.
        return dict(rope_type="rope", rotary_base=float(params["rope_theta"]), rotary_scaling_factor=1.0,
                    mscale_all_dim=0.0)
    if rope_type != "yarn":
        raise ValueError(f"rope_parameters.rope_type={rope_type!r} is not supported for DeepSeek (default or yarn)")
    for key in ("attention_factor",):
        if params.get(key) is not None:
            raise ValueError(f"rope_parameters.{key} is not supported for DeepSeek (megatron derives it from mscale)")
    if params.get("truncate", True) is not True:
        raise ValueError("rope_parameters.truncate=false is not supported (megatron rounds YaRN's correction range)")
    for key in ("factor", "original_max_position_embeddings"):
        if params.get(key) is None:
            raise ValueError(f"rope_parameters.{key} is required for YaRN RoPE")
    factor = float(params["factor"])
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    # transformers' attention factor (modeling_rope_utils._compute_yarn_parameters) against megatron's
    hf_factor = (_yarn_get_mscale(factor, mscale) / _yarn_get_mscale(factor, mscale_all_dim)
                 if mscale and mscale_all_dim else _yarn_get_mscale(factor))
    megatron_factor = _yarn_get_concentration_factor(factor, float(mscale or 0.0), float(mscale_all_dim or 0.0))
    if not math.isclose(hf_factor, megatron_factor, rel_tol=1e-12):
        raise ValueError(f"rope_parameters.mscale={mscale} with mscale_all_dim={mscale_all_dim}: transformers' "
                         f"YaRN attention factor ({hf_factor}) is not DeepSeek's ({megatron_factor}); set both")
    return dict(rope_type="yarn", rotary_base=float(params["rope_theta"]), rotary_scaling_factor=factor,
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
                mscale=float(mscale or 0.0), mscale_all_dim=float(mscale_all_dim or 0.0))


class Deepseek(DenseThenMoe, DecoderFamily):
    """DeepSeek-V3 and DeepSeek-V2: the module docstring says how MLA maps onto megatron."""

    name = "DeepSeek"
    architectures = ("DeepseekV3ForCausalLM", "deepseek_v3", "DeepseekV2ForCausalLM", "deepseek_v2")

    def check_supported(self, hf: dict) -> None:
        super().check_supported(hf)
        if hf.get("rope_interleave", True) is not True:
            raise ValueError(f"{self.name} with rope_interleave=false is not supported (megatron's MLA rotates "
                             "interleaved rope dims, as DeepSeek's checkpoints store them)")

    def transformer_config(self, hf: dict, tp: int, pp: int, params_dtype: torch.dtype,
                           use_cpu_initialization: bool, **layout) -> MLATransformerConfig:
        """The decoder's TransformerConfig (`layout`: its pipeline/expert keywords) as an MLATransformerConfig."""
        heads = hf["num_attention_heads"]
        if heads % tp:
            raise ValueError(f"TP={tp} must divide num_attention_heads={heads} (each TP rank holds whole heads)")
        # MLA has no key/value heads of its own: give the GQA checks one group per head.
        base = super().transformer_config({**hf, "num_key_value_heads": heads}, tp, pp, params_dtype,
                                          use_cpu_initialization, **layout)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(TransformerConfig) if f.init}
        fields |= dict(num_query_groups=heads, kv_channels=hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
                       qk_layernorm=False, multi_latent_attention=True)  # norms by the spec (module docstring)
        return MLATransformerConfig(
            **fields, q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
            qk_head_dim=hf["qk_nope_head_dim"], qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
            **_rope_config(hf))

    def rope_kwargs(self, hf: dict) -> dict:
        return {}  # each MLA layer has its own rotary embedding (MLATransformerConfig's fields)

    def layer_spec(self, hf: dict, layer: int) -> ModuleSpec:
        patch_mla_without_te()
        spec = get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm")
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = HiddenNorm
        spec.submodules.self_attention.module = DeepseekMLA
        attention = spec.submodules.self_attention.submodules
        attention.q_layernorm = attention.kv_layernorm = LatentNorm
        # megatron's replicated linear (the "local" one MLA accepts besides TE's): whole on every TP rank, its
        # gradient marked for the sum over TP under sequence parallelism
        attention.linear_q_down_proj = attention.linear_kv_down_proj = ReplicatedLinear
        attention.core_attention = MLADotProductAttention  # engine/attention.py may swap it for SDPA
        return self.with_moe_mlp(spec, hf, layer)

    def attention_maps(self, hf: dict, tp: int, layer: int) -> list[WeightMap]:
        attn, h = f"decoder.layers.{layer}.self_attention.", f"model.layers.{layer}.self_attn."
        if hf.get("q_lora_rank") is None:
            maps = [WeightMap(attn + "linear_q_proj.weight", (h + "q_proj.weight",), **split_dim(0))]
        else:
            maps = [WeightMap(attn + "linear_q_down_proj.weight", (h + "q_a_proj.weight",), **replicated()),
                    WeightMap(attn + "q_layernorm.weight", (h + "q_a_layernorm.weight",), **replicated()),
                    WeightMap(attn + "linear_q_up_proj.weight", (h + "q_b_proj.weight",), **split_dim(0))]
        # kv_a's rows: the kv_lora_rank latent, then the shared rope key (megatron splits them the same way);
        # kv_b's rows per head: k_nope then v (megatron's [heads, qk_head_dim + v_head_dim] view).
        return maps + [
            WeightMap(attn + "linear_kv_down_proj.weight", (h + "kv_a_proj_with_mqa.weight",), **replicated()),
            WeightMap(attn + "kv_layernorm.weight", (h + "kv_a_layernorm.weight",), **replicated()),
            WeightMap(attn + "linear_kv_up_proj.weight", (h + "kv_b_proj.weight",), **split_dim(0)),
            WeightMap(attn + "linear_proj.weight", (h + "o_proj.weight",), **split_dim(1))]


FAMILY = Deepseek()
