"""megarl's weight loader inside SGLang (each TP worker imports this module by its --custom-weight-loader name,
`PERSISTENT_LOADER`): a flat bucket (flat_bucket.py) posted by CUDA IPC with a JSON header, loaded whole or as this
rank's presharded rows, its buffer kept mapped for the next sync; and the requests about the weights held (their
checksums for verification, a test hook that flips a bit). It runs in SGLang's process: it imports only torch and
megarl's light modules.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from megarl.rollout.sglang_layout import DERIVED_ATTRIBUTES
from megarl.rollout.transports.flat_bucket import Bucket, unpack

PERSISTENT_LOADER = "megarl.rollout.transports.sglang_loader.load_flat_bucket"

_MAPPED: dict[int, torch.Tensor] = {}  # inside SGLang: slot -> the sender's buffer, kept mapped
# Benchmarks set MEGARL_TIME_WEIGHT_LOADS=1 in a server's environment: each load then prints its seconds to the
# server's log (`LOAD_TIMING` lines), which splits a post's time into SGLang's load and the request's way there and
# back; a verification's checksums print theirs (`CHECKSUM_TIMING`: seconds of the request's work, and the GPU
# seconds of the sums).
TIME_LOADS = os.environ.get("MEGARL_TIME_WEIGHT_LOADS") == "1"
LOAD_TIMING = "megarl weight load"
CHECKSUM_TIMING = "megarl checksums"


def load_flat_bucket(model, named_tensors: Bucket) -> None:
    """SGLang custom weight loader (runs in each SGLang TP worker): one (layout JSON, flat buffer) pair. A
    "presharded" header: the buffer holds this TP rank's own rows of each HF tensor (cuda_ipc.ShardedIpcSender). A
    header without a layout is a request about the weights held (inspect_weights)."""
    start = time.perf_counter()
    ((header, flat),) = named_tensors
    header = json.loads(header)
    if header.get("release"):  # the sender is closing (cuda_ipc.CudaIpcSender.close): let go of its buffers
        _MAPPED.clear()
        return
    if "layout" not in header:  # not weights: a request about the weights held
        inspect_weights(model, header)
        return
    bucket = unpack(flat, header["layout"])
    if header.get("presharded"):
        load_presharded(model, bucket)
    else:
        model.load_weights(bucket)
    queued = time.perf_counter()  # the loaders' Python work is done; the copies may still run
    if flat.is_cuda:  # the sender reuses the buffer once this call has returned
        torch.cuda.current_stream().synchronize()
    _MAPPED[header["slot"]] = flat
    if TIME_LOADS:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        print(f"{LOAD_TIMING}: rank {rank} bytes {flat.numel()} queued {queued - start:.6f} "
              f"seconds {time.perf_counter() - start:.6f}", file=sys.stderr, flush=True)


def derived_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor attribute named in weight_layout.DERIVED_ATTRIBUTES (SGLang's MLA w_kc and
    w_vc, which post_load_weights derives from kv_b_proj) that a module of `model` holds beside its parameters and
    buffers: verification checks them as parameters."""
    modules = model.named_modules() if isinstance(model, torch.nn.Module) else []
    found = []
    for prefix, module in modules:
        for attribute in DERIVED_ATTRIBUTES:
            value = module.__dict__.get(attribute)
            if isinstance(value, torch.Tensor):
                found.append((f"{prefix}.{attribute}" if prefix else attribute, value))
    return found


def inspect_weights(model, header: dict) -> None:
    """Inside an SGLang TP worker, on its GPU. {"checksums": file} writes to `file`, atomically, the checksums of
    every parameter, persistent buffer and derived tensor (`derived_tensors`) this rank holds now
    (megarl.utils.checksum.module_checksums); the caller reads it once the request returned. A verified sync asks
    for them after the rollout its weights generated, before the trainer trains on it (Trainer.check_rollout_weights):
    off the sync's path, of the same memory (generation only reads the weights). {"flip_bit": name} flips a bit of
    that tensor (a test hook standing for memory corrupted after a load: the next verification must name it; None:
    on another rank)."""
    from megarl.utils.checksum import flip_bit, module_checksums

    if "flip_bit" in header:
        if header["flip_bit"] is None:
            return
        held = dict(model.named_parameters()) | dict(derived_tensors(model))
        if header["flip_bit"] not in held:
            raise KeyError(f"no parameter {header['flip_bit']!r} (this rank holds {sorted(held)[:4]} ...)")
        flip_bit(held[header["flip_bit"]])
        return
    start = time.perf_counter()
    timed = TIME_LOADS and torch.cuda.is_available()
    if timed:
        events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        events[0].record()
    held = module_checksums(model, extra=derived_tensors(model))
    if timed:
        events[1].record()
    staging = header["checksums"] + ".tmp"
    with open(staging, "w") as f:
        json.dump(held, f)
    os.replace(staging, header["checksums"])
    if TIME_LOADS:
        gpu_s = events[0].elapsed_time(events[1]) / 1e3 if timed else 0.0
        print(f"{CHECKSUM_TIMING}: params {len(held)} seconds {time.perf_counter() - start:.6f} gpu {gpu_s:.6f}",
              file=sys.stderr, flush=True)


def load_presharded(model, bucket: Bucket) -> None:
    """The model's own load_weights (it fuses q/k/v and gate/up by shard id) with every layer that has SGLang's
    `use_presharded_weights` switched on, so its weight_loader copies each tensor as this rank's shard instead
    of narrowing it; the switches are restored afterwards, also when a load fails. A wrong shape fails in the
    loaders' assertions, re-raised naming the tensor being loaded."""
    switched = [(m, m.use_presharded_weights) for m in model.modules() if hasattr(m, "use_presharded_weights")]
    current = ("(before the first tensor)", ())

    def tracked():
        nonlocal current
        for name, tensor in bucket:
            current = (name, tuple(tensor.shape))
            yield name, tensor

    try:
        for module, _ in switched:
            module.use_presharded_weights = True
        model.load_weights(tracked())
    except Exception as error:
        raise RuntimeError(f"presharded weight load failed at {current[0]} (rows of shape {list(current[1])}): "
                           f"{type(error).__name__}: {error}") from error
    finally:
        for module, before in switched:
            module.use_presharded_weights = before
