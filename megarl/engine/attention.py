"""Core attention for megatron's local layer spec: PyTorch SDPA instead of megatron's unfused
DotProductAttention, so no TransformerEngine is needed for speed (gpu-anchors.md: 24% -> 42% MFU on an
H200 for a 1.4B model).

SDPA gets `is_causal=True` when no mask is given (flash attention on GPU, GQA without copying the key
and value heads) and megatron's boolean mask otherwise (True = not allowed; the block-diagonal causal
mask of packed rows), inverted to SDPA's convention (True = allowed).
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule

CORE_ATTENTIONS = ("local", "sdpa")


class SDPAttention(MegatronModule):
    """Drop-in for megatron's DotProductAttention (same constructor and forward signature)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise ValueError("context parallelism needs TransformerEngine's attention; SDPAttention has none")
        tp = pg_collection.tp.size() if pg_collection is not None else \
            parallel_state.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention takes neither packed_seq_params (THD) nor an attention bias: "
                             "packed rows come with a block-diagonal attention_mask")
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


def with_core_attention(spec, core_attention: str):
    """The layer spec with its core attention swapped ('local' keeps megatron's DotProductAttention)."""
    if core_attention not in CORE_ATTENTIONS:
        raise ValueError(f"core attention {core_attention!r}: expected one of {', '.join(CORE_ATTENTIONS)}")
    if core_attention == "local":
        return spec
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def resolve_core_attention(name: str, device: str) -> str:
    """'auto': SDPA on GPU; megatron's own attention on CPU (the reference the tests compare with)."""
    if name == "auto":
        return "sdpa" if device == "cuda" else "local"
    if name not in CORE_ATTENTIONS:
        raise ValueError(f"attention={name!r}: expected auto, {', '.join(CORE_ATTENTIONS)}")
    return name


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def check_parallel_support(context_parallel: int, sequence_parallel: bool) -> None:
    """megatron-core implements context and sequence parallelism with TransformerEngine modules only."""
    if (context_parallel > 1 or sequence_parallel) and not transformer_engine_available():
        raise RuntimeError(f"context parallelism (cp={context_parallel}) and sequence parallelism "
                           f"(sequence_parallel={sequence_parallel}) need TransformerEngine, which is not "
                           "installed: install megarl[gpu] or set cp=1 and sequence_parallel=false")
    if context_parallel > 1 or sequence_parallel:
        raise NotImplementedError("context/sequence parallelism with TransformerEngine's layer spec is not "
                                  "wired into MegatronEngine yet (set cp=1 and sequence_parallel=false)")
