"""Linear attention (a gated delta net, Qwen3.5's "linear_attention" layers) on megatron's GatedDeltaNet, with rows
that hold several sequences, and without flash-linear-attention (fla) where it is not installed.

megatron-core 0.16's GatedDeltaNet holds the parameters megarl keeps (in_proj, whose output is [q; k; v; z; b; a]
of this TP rank's heads; the depthwise conv1d over q, k, v; dt_bias, A_log; out_norm over a value head; out_proj),
but its forward runs every row as one sequence, refuses packed_seq_params and needs fla's Triton kernels (it will
not even build without fla). megarl packs sequences back to back into rows (engine/packing.py), so the forward here
restarts the convolution and the recurrence at every sequence start, which it reads from what the attention layers
get: the block-causal mask (token t starts a sequence where it may not see t - 1), or cu_seqlens over the rows
flattened (attention=varlen); without either, each row is one sequence.
Tensor parallelism: each TP rank holds a share of the heads (in_proj's and conv1d's rows, dt_bias, A_log, out_proj's
columns) and the whole `out_norm` weight, which every value head uses; each rank's loss therefore gives that weight
the gradient of its own heads only. megatron's finalize_model_grads sums a replicated weight's gradient over TP only
where it is marked sequence_parallel (under SP) or named q_layernorm / k_layernorm, neither of which holds here, so
the forward sums it itself: the weight passes through megatron's copy_to_tensor_model_parallel_region (identity, its
gradient all-reduced over TP), with or without sequence parallelism (under which in_proj gathers the whole sequence
and out_proj scatters it again, so the layer sees every token of its heads either way).
The delta rule runs fla's chunk_gated_delta_rule over the flattened rows where fla imports (a GPU), and otherwise
`recurrent_gated_delta_rule`, a token-by-token torch loop: exact, but slow on long rows and it keeps every step's
state for the backward pass (fine for the CPU's tiny models; install fla for real ones).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from megatron.core.ssm import gated_delta_net as megatron_gdn
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
from torch import Tensor

L2NORM_EPS = 1e-6  # fla's l2norm and transformers' Qwen3.5 (which copies it)


def fla_chunk_rule():
    """fla's chunked gated delta rule, or None where fla does not import."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, starts: Tensor) -> Tensor:
    """The gated delta rule token by token, in float32: q, k [b, s, h, dk] (l2-normalised), v [b, s, h, dv],
    g (log decay) and beta [b, s, h], starts [b, s] (True where a sequence begins: the state is zero before it).
    Per head, S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - S'_t k_t))^T with S' the decayed state, out_t = S_t^T q_t
    / sqrt(dk). Returns [b, s, h, dv] in v's dtype."""
    dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    q = q * q.shape[-1] ** -0.5
    keep = (~starts).float()
    state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])  # [b, h, dk, dv]
    out = []
    for t in range(q.shape[1]):
        state = state * (g[:, t].exp() * keep[:, t, None])[..., None, None]
        remembered = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = (v[:, t] - remembered) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(out, 1).to(dtype)


def segmented_causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, segments: Tensor) -> Tensor:
    """Depthwise causal convolution of x [b, channels, s] with weight [channels, 1, K] (nn.Conv1d's), each position
    seeing only the earlier positions of its own segment (segments [b, s]: ids, equal within a sequence)."""
    width, length = weight.shape[-1], x.shape[-1]
    out = x * weight[:, 0, width - 1, None]
    for back in range(1, width):
        earlier = F.pad(x, (back, 0))[..., :length]
        same = F.pad(segments, (back, 0), value=-1)[..., :length] == segments
        out = out + earlier * same[:, None] * weight[:, 0, width - 1 - back, None]
    return out if bias is None else out + bias[:, None]


def sequence_starts(attention_mask: Tensor | None, packed_seq_params, rows: int, length: int,
                    device: torch.device) -> Tensor:
    """[rows, length] True where a sequence begins (module docstring)."""
    starts = torch.zeros(rows, length, dtype=torch.bool, device=device)
    if packed_seq_params is not None:
        bounds = packed_seq_params.cu_seqlens_q[:-1].long()
        starts.view(-1)[bounds[bounds < rows * length]] = True
    elif attention_mask is not None:
        blocked = attention_mask[:, 0].diagonal(offset=-1, dim1=-2, dim2=-1)  # [rows or 1, length - 1]
        starts[:, 1:] = blocked
    starts[:, 0] = True
    return starts


def tensor_parallel_sum_in_backward(weight: Tensor, tp_group) -> Tensor:
    """`weight` as it is, its gradient summed over the TP ranks (module docstring: the norm's weight)."""
    return weight if tp_group.size() == 1 else copy_to_tensor_model_parallel_region(weight, group=tp_group)


@contextlib.contextmanager
def _building_without_fla():
    """megatron's GatedDeltaNet.__init__ raises ImportError without fla, whose kernels only its forward (replaced
    here) calls."""
    had = megatron_gdn.HAVE_FLA
    megatron_gdn.HAVE_FLA = True
    try:
        yield
    finally:
        megatron_gdn.HAVE_FLA = had


class GatedDeltaNet(megatron_gdn.GatedDeltaNet):
    """megatron's layer (parameters, initialisation, checkpoint layout) with the forward of the module docstring."""

    def __init__(self, *args, **kwargs):
        with _building_without_fla():
            super().__init__(*args, **kwargs)
        self.chunk_rule = fla_chunk_rule()

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None, inference_context=None,
                packed_seq_params=None, inference_params=None, **unused):
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("megarl's gated delta net runs training and log-prob passes, not inference")
        tp = self.tp_size
        projected, _ = self.in_proj(hidden_states)  # [s, b, d] (the whole row under sequence parallelism)
        length, rows = projected.shape[:2]
        starts = sequence_starts(attention_mask, packed_seq_params, rows, length, projected.device)
        qk, v_dim, heads = self.qk_dim // tp, self.v_dim // tp, self.num_value_heads // tp
        qkv, z, b, a = projected.transpose(0, 1).split([2 * qk + v_dim, v_dim, heads, heads], dim=-1)
        conv = segmented_causal_conv1d(qkv.transpose(1, 2), self.conv1d.weight, self.conv1d.bias,
                                       starts.long().cumsum(1))
        q, k, v = self.act_fn(conv).transpose(1, 2).split([qk, qk, v_dim], dim=-1)
        q = q.reshape(rows, length, -1, self.key_head_dim)
        k = k.reshape(rows, length, -1, self.key_head_dim)
        v = v.reshape(rows, length, -1, self.value_head_dim)
        if self.num_value_heads != self.num_key_heads:  # each key head serves a run of consecutive value heads
            q, k = (x.repeat_interleave(self.num_value_heads // self.num_key_heads, dim=2) for x in (q, k))
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        beta = b.sigmoid()
        if self.chunk_rule is not None and q.is_cuda:
            cu_seqlens = F.pad(starts.view(-1).nonzero()[:, 0], (0, 1), value=rows * length)
            out, _ = self.chunk_rule(*(x.reshape(1, rows * length, *x.shape[2:]) for x in (q, k, v, g, beta)),
                                     cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
            out = out.reshape(rows, length, *out.shape[2:])
        else:
            out = recurrent_gated_delta_rule(l2norm(q), l2norm(k), v, g, beta, starts)
        # the gated norm: each value head normalised, then gated by silu(z) in float32 (transformers' and fla's order)
        head, norm = self.value_head_dim, self.out_norm
        weight = tensor_parallel_sum_in_backward(norm.weight, self.pg_collection.tp)
        out = F.rms_norm(out.reshape(-1, head), (head,), weight, norm.eps) * self.act_fn(z.reshape(-1, head).float())
        out = out.to(z.dtype).reshape(rows, length, -1).transpose(0, 1).contiguous()
        return self.out_proj(out)
