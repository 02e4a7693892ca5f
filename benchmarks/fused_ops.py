"""Per-call time of RoPE and SwiGLU (forward + backward) three ways: megatron's unfused torch ops, compiled by
torch.compile (the engine's earlier way: megatron's SwiGLU under bias_activation_fusion as it was; for
RoPE megatron's unfused function compiled, standing in for megarl's compiled one of the same math), and megarl's
Triton kernels launched directly (models/kernels.py, the engine's default on the GPU).

Two sizes per op: `tiny` (a few tokens: the GPU's work is negligible, so a call's time is its host time, what a
host-bound update pays per layer and micro-batch) and `e2e` (the update of the TRL comparison at 64 completions: one
micro-batch of 10,240 tokens of the Qwen2.5-0.5B shape: 14 query heads and 2 key-value groups of 64 channels, SwiGLU
over 2 x 4,864). Each: --warmup calls, then --calls timed back to back with one synchronisation at the end.

    python benchmarks/fused_ops.py --out $OUT/fused_ops.json          # GPU
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

SHAPES = {"tiny": dict(tokens=16), "e2e": dict(tokens=10240)}
HEADS, GROUPS, HEAD_DIM, FFN = 14, 2, 64, 4864


def rope_ways():
    from megatron.core.models.common.embeddings import rope_utils

    from megarl.models import kernels

    unfused = rope_utils._apply_rotary_pos_emb_bshd
    return {"unfused": unfused, "compiled": torch.compile(unfused, dynamic=True), "triton": kernels.rope}


def swiglu_ways():
    from megatron.core.fusions import fused_bias_swiglu

    from megarl.models import kernels

    def unfused(y):
        gate, up = y.chunk(2, -1)
        return F.silu(gate) * up

    return {"unfused": unfused, "compiled": lambda y: fused_bias_swiglu.bias_swiglu_impl(y, None),
            "triton": kernels.swiglu}


def timed(step, warmup: int, calls: int) -> float:
    """Microseconds per call of `step` (forward and backward)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device, dtype = "cuda", torch.bfloat16
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "us_per_call": {}}
    for size, shape in SHAPES.items():
        n = shape["tokens"]
        qkv = torch.randn(n, 1, HEADS + 2 * GROUPS, HEAD_DIM, device=device, dtype=dtype, requires_grad=True)
        freqs = torch.rand(n, 1, 1, HEAD_DIM, device=device) * 100
        y = torch.randn(n, 2 * FFN, device=device, dtype=dtype, requires_grad=True)
        for op, ways in (("rope", rope_ways()), ("swiglu", swiglu_ways())):
            for way, fn in ways.items():
                if op == "rope":  # the queries and the keys, strided views of one projection, as megatron's layer
                    def step(fn=fn):
                        q, k = qkv[:, :, :HEADS], qkv[:, :, HEADS:HEADS + GROUPS]
                        (fn(q, freqs).sum() + fn(k, freqs).sum()).backward()
                else:
                    def step(fn=fn):
                        fn(y).sum().backward()
                us = timed(step, args.warmup, args.calls)
                results["us_per_call"][f"{op}/{size}/{way}"] = round(us, 1)
                print(f"{op:6s} {size:4s} {way:8s} {us:9.1f} us per forward + backward", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
