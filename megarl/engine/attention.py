"""Core attention for megatron's local layer spec: PyTorch's fused kernels instead of megatron's unfused
DotProductAttention, so no TransformerEngine is needed for speed (gpu-anchors.md: 24% -> 42% MFU on an
H200 for a 1.4B model).

One module, SDPAttention, three ways in (megatron's core-attention signature):
- no mask, no packed_seq_params: SDPA with `is_causal=True` (flash attention on GPU, GQA without copying
  the key and value heads): rows that hold one sequence each;
- megatron's boolean mask (True = not allowed; the block-diagonal causal mask of packed rows), inverted
  to SDPA's convention (True = allowed): masked SDPA, which no flash kernel takes;
- packed_seq_params in the 'sbhd' layout (megatron passes it through to core attention untouched; multi-latent
  attention's in 'thd', [tokens, heads, d]) with cu_seqlens over the flattened rows: variable-length causal
  attention, each segment alone. On CUDA that is aten's flash attention over cu_seqlens (flash_varlen, CUDA
  only); elsewhere a per-segment SDPA loop, slow, but the same code path for the CPU tests.
`attention` (config): local (megatron's), sdpa (packed rows by mask), varlen (packed rows by cu_seqlens).

Under context parallelism (context_parallel.py) SDPAttention gathers the keys and values of the whole row
from the CP group and always takes the mask way: its mask (context_parallel.attention_mask) relates this
rank's queries to every key by position and segment. megatron's own attention refuses CP, and varlen's
cu_seqlens cannot describe queries that are a part of a row, so CP runs attention=sdpa only.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule

from megarl.engine import context_parallel

CORE_ATTENTIONS = ("local", "sdpa", "varlen")


class SDPAttention(MegatronModule):
    """Drop-in for megatron's DotProductAttention (same constructor and forward signature)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        # k_channels / v_channels: multi-latent attention's query-key and value head dims (they differ); the
        # kernels read them from the tensors' shapes.
        super().__init__(config=config)
        tp = pg_collection.tp.size() if pg_collection is not None else \
            parallel_state.get_tensor_model_parallel_world_size()
        self.cp_group = getattr(pg_collection, "cp", None) or parallel_state.get_context_parallel_group()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("SDPAttention takes no attention bias")
        if packed_seq_params is not None:
            return self._varlen(query, key, value, packed_seq_params)
        if self.config.context_parallel_size > 1:
            if attention_mask is None:
                raise ValueError("SDPAttention under context parallelism needs context_parallel.attention_mask")
            key, value = context_parallel.gather_keys_values(key, value, self.cp_group)
        s, b = query.shape[:2]
        # megatron: [s, b, heads, d]; SDPA: [b, heads, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        mask, gqa = None, self.heads != self.groups
        if attention_mask is not None:
            mask = ~attention_mask
            if gqa:  # the kernels that take a mask do not all take enable_gqa
                k = k.repeat_interleave(self.heads // self.groups, dim=1)
                v = v.repeat_interleave(self.heads // self.groups, dim=1)
                gqa = False
        dropout = self.dropout if self.training else 0.0
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                 is_causal=mask is None, scale=self.scale, enable_gqa=gqa)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _varlen(self, query, key, value, params: PackedSeqParams):
        if params.qkv_format not in ("sbhd", "thd"):
            raise ValueError(f"SDPAttention takes packed_seq_params in the 'sbhd' or 'thd' layout, not "
                             f"{params.qkv_format!r}")
        if self.dropout and self.training:
            raise ValueError("attention dropout is not supported with attention=varlen: use attention=sdpa")
        kernel = flash_varlen if query.is_cuda else segment_sdpa
        if params.qkv_format == "thd":  # [T, heads, d] in and out (multi-latent attention reshapes it itself)
            return kernel(query, key, value, params.cu_seqlens_q, params.max_seqlen_q, self.scale)
        s, b = query.shape[:2]
        # [s, b, heads, d] -> [b * s, heads, d]: the rows back to back, as cu_seqlens counts them
        q, k, v = (x.transpose(0, 1).reshape(b * s, *x.shape[2:]) for x in (query, key, value))
        out = kernel(q, k, v, params.cu_seqlens_q, params.max_seqlen_q, self.scale)
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()


def varlen_available() -> bool:
    """aten's flash attention over cu_seqlens (flash_varlen) runs here: a GPU is present."""
    return torch.cuda.is_available() and hasattr(torch.ops.aten, "_flash_attention_forward")


def flash_varlen(q, k, v, cu_seqlens, max_seqlen: int, scale: float):
    """Causal flash attention over the segments of cu_seqlens; q [T, heads, d], k and v [T, groups, d] (grouped-query
    attention as is: the kernel reads each group's keys for its heads)."""
    v_dim = v.shape[-1]
    if v_dim != q.shape[-1]:  # multi-latent attention: flash kernels take one head dim, so pad v and cut back
        v = F.pad(v, (0, q.shape[-1] - v_dim))
    return _FlashVarlen.apply(q, k, v, cu_seqlens, max_seqlen, scale)[..., :v_dim]


class _FlashVarlen(torch.autograd.Function):
    """aten's two flash kernels over cu_seqlens, called directly. torch.nn.attention.varlen calls the same two, but
    through custom ops whose Python dispatch and autograd wrappers cost ~0.65 ms of host time per layer call
    (forward and backward, profiled): at a 0.5B model and 10k-token micro-batches, where the update is bound by
    the host, the engine's step went from 565 to 393 ms without them (docs/benchmarks.md). No dropout (_varlen
    refuses it), so the random state is never read."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen: int, scale: float):
        out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.max_seqlen, ctx.scale = max_seqlen, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        unused = _no_random_state(q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, cu_seqlens, ctx.max_seqlen, ctx.max_seqlen, 0.0,
            True, unused[0], unused[1], scale=ctx.scale)
        return dq, dk, dv, None, None, None


@functools.cache
def _no_random_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The flash backward's random-state arguments, unread without dropout (made once per device)."""
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(0, device=device)


def segment_sdpa(q, k, v, cu_seqlens, max_seqlen: int, scale: float):
    """flash_varlen's result by one causal SDPA per segment (CPU; a reference, not fast)."""
    bounds = cu_seqlens.tolist()
    out = [F.scaled_dot_product_attention(*(x[start:end].transpose(0, 1) for x in (q, k, v)), is_causal=True,
                                          scale=scale, enable_gqa=k.shape[1] != q.shape[1]).transpose(0, 1)
           for start, end in zip(bounds[:-1], bounds[1:])]
    return torch.cat(out)


def with_core_attention(spec, core_attention: str):
    """The layer spec with its core attention swapped ('local' keeps megatron's DotProductAttention)."""
    if core_attention not in CORE_ATTENTIONS:
        raise ValueError(f"core attention {core_attention!r}: expected one of {', '.join(CORE_ATTENTIONS)}")
    if core_attention == "local":
        return spec
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def resolve_core_attention(name: str, device: str, context_parallel_size: int = 1,
                           local_only: str | None = None) -> str:
    """'auto': varlen on GPU (sdpa where this torch has no flash kernel over cu_seqlens); megatron's own
    attention on CPU (the reference the tests compare with); sdpa under context parallelism, the only
    core attention that runs it.
    local_only: the name of a model family whose layers bring their own core attention, which SDPAttention does
    not compute (Gemma 3's sliding windows): 'auto' is local, sdpa, varlen and context parallelism are refused."""
    if name not in ("auto", *CORE_ATTENTIONS):
        raise ValueError(f"attention={name!r}: expected auto, {', '.join(CORE_ATTENTIONS)}")
    if local_only:
        if name not in ("auto", "local") or context_parallel_size > 1:
            raise ValueError(f"actor.attention={name!r} (cp={context_parallel_size}): {local_only} runs megatron's "
                             "attention with its sliding windows only: use actor.attention=local or auto, cp=1")
        return "local"
    if context_parallel_size > 1:
        if name not in ("auto", "sdpa"):
            raise ValueError(f"attention={name!r} does not run context parallelism (cp={context_parallel_size}): "
                             "use attention=sdpa or auto")
        return "sdpa"
    if name == "auto":
        if device != "cuda":
            return "local"
        return "varlen" if varlen_available() else "sdpa"
    return name


def packed_attention_inputs(core_attention: str, mb: dict, latent: bool = False):
    """(attention_mask, packed_seq_params) for GPTModel.forward on micro-batch `mb` (packing.py).
    sdpa and varlen run rows of one sequence each as plain causal attention (no mask); packed rows go by
    the block-diagonal mask (local, sdpa) or by cu_seqlens (varlen). max_seqlen is the row width: megatron
    sizes its RoPE table by it, and the kernels take it as a bound. Under context parallelism every row goes
    by the mask of this rank's queries over the whole row's keys.
    `latent` (multi-latent attention): cu_seqlens in megatron's 'thd' layout, the only one its MLA takes packed
    (it drops the row dimension for any packed_seq_params, and applies RoPE by cu_seqlens only under 'thd');
    other attention keeps 'sbhd', which megatron passes to the core attention untouched."""
    from megarl.engine.packing import block_causal_mask

    if context_parallel.size() > 1:
        return context_parallel.attention_mask(mb["doc_ids"]), None
    if core_attention != "local" and not mb["packed"]:
        return None, None
    if core_attention == "varlen":
        width = mb["tokens"].shape[1]
        return None, PackedSeqParams(qkv_format="thd" if latent else "sbhd", cu_seqlens_q=mb["cu_seqlens"],
                                     cu_seqlens_kv=mb["cu_seqlens"], max_seqlen_q=width, max_seqlen_kv=width)
    return block_causal_mask(mb["doc_ids"]), None
