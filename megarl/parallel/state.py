"""Process groups of the training layout: torch.distributed + megatron's parallel_state.

megatron's parallel_state already answers the layout questions the engine asks (DP rank/size,
first/last pipeline stage, TP group ...), so this module only starts and stops it.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed


def init_parallel(rank: int, world_size: int, master_addr: str, master_port: int, tp: int = 1, pp: int = 1,
                  device: str = "cpu", seed: int = 1) -> None:
    """Join the job's process group and build megatron's TP/PP/DP groups (order tp-cp-ep-dp-pp).

    device="cpu": gloo plus the CPU compatibility layer; device="cuda": NCCL on GPU `rank % gpus`.
    """
    if world_size % (tp * pp):
        raise ValueError(f"world_size={world_size} is not divisible by tp*pp = {tp}*{pp}")
    if device == "cpu":
        from megarl.parallel.compat import install_cpu_compat

        install_cpu_compat()
        backend = "gloo"
    elif device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "nccl"
    else:
        raise ValueError(f"device={device!r}: expected 'cpu' or 'cuda'")
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=timedelta(minutes=30))
    parallel_state.initialize_model_parallel(tp, pp)
    torch.manual_seed(seed)
    # Seeds megatron's tracked RNG states: the same across DP replicas, distinct per TP rank.
    model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    """Tear down megatron's groups and the process group (call before the process exits)."""
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
