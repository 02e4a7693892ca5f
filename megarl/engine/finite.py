"""Which ranks of a training job saw a NaN or infinite loss or gradient in one optimizer update, agreed by all.

megatron-core's own checks do not do this here: its fp32 and bf16 optimizers (no loss scaler) never report
non-finite gradients (prepare_grads returns False), and a NaN grad norm makes clipping a no-op, so the step
writes NaN into the weights; DDP's check_for_nan_in_grad raises on the offending rank alone, before the
data-parallel collective, leaving the other ranks waiting in it, and cannot skip. So every rank fills its own
slot of one small table and a single all-reduce gives every rank the same verdict: all raise the same error,
or all skip the same update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class NonFinite:
    """What one update's check found; `losses`: rank -> (its first bad micro-batch, 1-based; its number of
    micro-batches, which packing makes differ between ranks; that loss)."""
    losses: dict[int, tuple[int, int, float]]
    grad_ranks: list[int]  # ranks whose gradient norm is NaN or infinite (after the data-parallel reduction)

    def __bool__(self) -> bool:
        return bool(self.losses or self.grad_ranks)

    def describe(self) -> str:
        if self.losses:
            where = ", ".join(f"rank {r} (micro-batch {m} of {count}, loss {v})"
                              for r, (m, count, v) in sorted(self.losses.items()))
            return f"non-finite loss on {where}"
        return ("non-finite gradient norm on rank(s) " + ", ".join(map(str, self.grad_ranks)) +
                " with finite losses (gradients add up over the micro-batches: none can be named)")


def check_update(losses: list[torch.Tensor], grad_buffers: list[torch.Tensor], device: torch.device) -> NonFinite:
    """Collective over the default group. `losses`: this rank's micro-batch losses, in order (none off the last
    pipeline stage); `grad_buffers`: its gradients after the data-parallel reduction. One host sync in all."""
    world, rank = dist.get_world_size(), dist.get_rank()
    table = torch.zeros(4, world, dtype=torch.float64, device=device)
    if losses:
        values = torch.stack(losses)
        bad = ~torch.isfinite(values)
        first = bad.int().argmax()
        table[0, rank] = torch.where(bad.any(), first + 1, 0)
        table[1, rank] = values[first].double()
        table[3, rank] = len(losses)
    # Squares of the norms: infinite exactly where the global norm overflows, NaN where a gradient is.
    table[2, rank] = sum((torch.linalg.vector_norm(g, dtype=torch.float32).double() ** 2 for g in grad_buffers),
                         torch.zeros((), dtype=torch.float64, device=device))
    dist.all_reduce(table)  # every slot has one contributor: a sum gathers them
    table = table.cpu()
    losses_found = {r: (int(table[0, r]), int(table[3, r]), float(table[1, r]))
                    for r in range(world) if table[0, r] > 0}
    grad_ranks = [r for r in range(world) if not math.isfinite(table[2, r])]
    return NonFinite(losses_found, grad_ranks)
