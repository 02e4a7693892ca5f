"""Moving the policy from the training ranks into a rollout engine, and proving it arrived intact.

The sender streams buckets of full HF-named tensors (MegatronEngine.export_hf_weights) into
`RolloutEngine.update_weights`, recording a digest of every tensor it sent. Verification then asks
the engine for the weights *as it holds them* (`named_weights`) and digests those on its side: a
mismatch anywhere (a dropped tensor, a wrong slice, one flipped element) fails loudly by name.
"""

from __future__ import annotations

import hashlib
import time
from typing import Callable, Iterable

import torch


class WeightSyncError(RuntimeError):
    """The rollout engine's weights differ from what the trainer sent."""


def tensor_digest(t: torch.Tensor) -> str:
    """Bitwise fingerprint of a tensor's values (dtype and shape included)."""
    t = t.detach().contiguous().cpu()
    h = hashlib.sha1(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def digests_of(named: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]) -> dict[str, str]:
    """Digests of an engine's own weights, each cast to the dtype it was sent in."""
    return {name: tensor_digest(named[name].to(dtype)) for name, dtype in dtypes.items() if name in named}


def push_buckets(buckets: Iterable[list[tuple[str, torch.Tensor]]],
                 send: Callable[[list[tuple[str, torch.Tensor]]], None]) -> dict:
    """Send each bucket; return what was sent (dtype and digest per tensor) and how much, how fast."""
    sent, nbytes, start = {}, 0, time.perf_counter()
    for bucket in buckets:
        send(bucket)
        for name, t in bucket:
            sent[name] = (t.dtype, tensor_digest(t))
            nbytes += t.numel() * t.element_size()
    return {"sent": sent, "bytes": nbytes, "seconds": time.perf_counter() - start}


def verify(sent: dict[str, tuple[torch.dtype, str]], received: dict[str, str]) -> None:
    """Raise WeightSyncError naming every tensor whose received digest differs from the sent one."""
    missing = sorted(set(sent) - set(received))
    wrong = sorted(n for n in sent if n in received and received[n] != sent[n][1])
    if missing or wrong:
        raise WeightSyncError(
            f"rollout weights differ from the trained policy after sync: "
            f"{len(wrong)} tensor(s) differ {wrong[:8]}, {len(missing)} missing {missing[:8]}")
