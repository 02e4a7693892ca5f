"""Moving the policy from the training ranks into a rollout engine, and proving it arrived intact.

The training ranks stream buckets out of the resharder (megarl.parallel.reshard) into the rollout engine:
full HF-named tensors (`RolloutEngine.update_weights`), or each generation TP rank's rows of them
(`update_weight_shards`), recording a digest of every tensor or shard sent. Verification then asks
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
    # numpy() on a copy: a numpy view marks the tensor's storage non-resizable, and the resharder yields
    # views of the parameters themselves, which the engine must still be able to offload (offload.py)
    h.update(t.view(torch.uint8).clone().numpy() if t.numel() else b"")
    return h.hexdigest()


# What was sent is keyed by HF name, or by (name, dim, lo, hi) for rows [lo, hi) along `dim` of it (a TP shard).
Key = str | tuple[str, int, int, int]


def digests_of(named: dict[str, torch.Tensor], dtypes: dict[Key, torch.dtype]) -> dict[Key, str]:
    """Digests of an engine's own weights (or of the rows a key names), each cast to the dtype it was sent in."""
    out = {}
    for key, dtype in dtypes.items():
        name, rows = (key, None) if isinstance(key, str) else (key[0], key[1:])
        if name in named:
            t = named[name] if rows is None else named[name].narrow(rows[0], rows[1], rows[2] - rows[1])
            out[key] = tensor_digest(t.to(dtype))
    return out


def push_buckets(buckets: Iterable[list[tuple[str, torch.Tensor]]],
                 send: Callable[[list[tuple[str, torch.Tensor]]], None],
                 key: Callable[[str], Key] = lambda name: name) -> dict:
    """Send each bucket; return what was sent (dtype and digest per tensor, by `key(name)`) and how much, how fast."""
    sent, nbytes, start = {}, 0, time.perf_counter()
    for bucket in buckets:
        send(bucket)
        for name, t in bucket:
            sent[key(name)] = (t.dtype, tensor_digest(t))
            nbytes += t.numel() * t.element_size()
    return {"sent": sent, "bytes": nbytes, "seconds": time.perf_counter() - start}


def verify(sent: dict[Key, tuple[torch.dtype, str]], received: dict[Key, str]) -> None:
    """Raise WeightSyncError naming every tensor whose received digest differs from the sent one."""
    missing = sorted(set(sent) - set(received), key=str)
    wrong = sorted((n for n in sent if n in received and received[n] != sent[n][1]), key=str)
    if missing or wrong:
        raise WeightSyncError(
            f"rollout weights differ from the trained policy after sync: "
            f"{len(wrong)} tensor(s) differ {wrong[:8]}, {len(missing)} missing {missing[:8]}")
