"""Run a function in N gloo processes (one per rank) and fail the test if any rank fails.

`run_distributed(fn, world_size, *args, tp=1, pp=1)` starts `world_size` processes; each sets one
torch thread, calls megarl.parallel.state.init_parallel on the CPU, runs `fn(rank, *args)` and tears
down. `fn` must be a module-level function (it is pickled by reference). An exception or failed
assert in any rank is re-raised here with that rank's traceback. Rank 0's return value comes back
(through a file: a pipe would block a large result while the parent waits in join).

The ranks are forked from a forkserver (one per test session) that imported torch, megatron-core and
transformers once: a freshly spawned interpreter per rank spent ~4 s of CPU importing them, about 8 s of
every 4-rank call on 2 cores. Each rank is still a process of its own, from a parent that ran no torch op
(no thread pool to inherit), with the environment of the session at its first call.
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time

import torch
import torch.multiprocessing as mp


_draw = random.SystemRandom()  # a test's random.seed() would repeat the draws


def free_port() -> int:
    """A port no other test takes meanwhile: the kernel's ephemeral ports (32768+) go to any socket between the probe
    and rank 0's bind, and Ray's workers take 10002-19999; each xdist worker draws from a range of its own below them."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    low = 20000 + (index % 4) * 3000
    for _ in range(100):
        port = _draw.randrange(low, low + 3000)
        with socket.socket() as s:
            try:
                s.bind(("", port))  # every interface: Slurm's daemons bind there
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{low + 2999}")


# Imported once by the forkserver (the ranks' common imports); an import that fails there is skipped.
PRELOAD = ["torch", "torch.distributed", "megatron.core", "megarl.parallel.state", "megarl.engine",
           "transformers.modeling_utils", "transformers.models.qwen2.modeling_qwen2", "safetensors.torch"]


def _rank_main(rank, world_size, port, tp, pp, seed, fn, args, result_path):
    torch.set_num_threads(1)
    from megarl.parallel.state import destroy_parallel, init_parallel

    init_parallel(rank, world_size, "127.0.0.1", port, tp=tp, pp=pp, device="cpu", seed=seed)
    try:
        out = fn(rank, *args)
        if rank == 0:
            torch.save(out, result_path)
    finally:
        destroy_parallel()


def run_distributed(fn, world_size: int, *args, tp: int = 1, pp: int = 1, seed: int = 1,
                    timeout: float = 300.0):
    """fn(rank, *args) on every rank of a CPU/gloo job laid out as tp x pp x dp; rank 0's return value."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "rank0.pt")
        mp.set_forkserver_preload(PRELOAD)  # read when the forkserver starts: the session's first call
        context = mp.start_processes(_rank_main, nprocs=world_size, join=False, start_method="forkserver",
                                     args=(world_size, free_port(), tp, pp, seed, fn, args, result_path))
        deadline = time.monotonic() + timeout
        # join() raises ProcessRaisedException (with the rank's traceback) if any rank fails.
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"distributed test did not finish within {timeout:.0f} s")
        return torch.load(result_path, weights_only=False) if os.path.exists(result_path) else None
