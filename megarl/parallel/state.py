"""Process groups of the training layout: torch.distributed + megatron's parallel_state.

megatron's parallel_state already answers the layout questions the engine asks (DP rank/size,
first/last pipeline stage, TP group ...), so this module only starts and stops it.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed


def init_parallel(rank: int, world_size: int, master_addr: str, master_port: int, tp: int = 1, pp: int = 1,
                  device: str = "cpu", seed: int = 1, ep: int = 1, cp: int = 1, etp: int | None = None) -> None:
    """Join the job's process group and build megatron's TP/CP/PP/DP groups (order tp-cp-ep-dp-pp) and its
    expert groups (etp-ep-dp-pp); etp None = tp.

    device="cpu": gloo plus the CPU compatibility layer; device="cuda": NCCL on GPU `rank % gpus`.
    """
    check_layout(world_size, tp, pp, ep, cp, etp)
    if device == "cpu":
        from megarl.parallel.compat import install_cpu_compat

        install_cpu_compat()
        backend = "gloo"
    elif device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "nccl"
    else:
        raise ValueError(f"device={device!r}: expected 'cpu' or 'cuda'")
    dist.init_process_group(backend, store=_rendezvous_store(rank, world_size, master_addr, master_port),
                            rank=rank, world_size=world_size, timeout=timedelta(minutes=30))
    build_model_parallel(tp, pp, seed, ep=ep, cp=cp, etp=etp)


def check_layout(world_size: int, tp: int, pp: int, ep: int = 1, cp: int = 1, etp: int | None = None) -> None:
    """The world-size rules megatron's groups need; a ValueError naming the sizes that break one."""
    if world_size % (tp * pp * cp):
        raise ValueError(f"world_size={world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}")
    if cp > 1 and ep > 1:
        raise ValueError(f"context parallelism (cp={cp}) with expert parallelism (ep={ep}) is not supported")
    stage_ranks = world_size // pp
    if stage_ranks % (ep * (etp or tp)):
        raise ValueError(f"ep * etp = {ep} * {etp or tp} must divide the {stage_ranks} ranks of a pipeline stage "
                         f"(tp*cp*dp; experts are split over ep x etp ranks, replicated over the rest)")


def build_model_parallel(tp: int, pp: int, seed: int, ep: int = 1, cp: int = 1, etp: int | None = None) -> None:
    """megatron's groups and seeds over the initialised process group (init_parallel, or a test changing the
    layout in place after destroy_model_parallel)."""
    check_layout(dist.get_world_size(), tp, pp, ep, cp, etp)
    parallel_state.initialize_model_parallel(tp, pp, context_parallel_size=cp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)
    torch.manual_seed(seed)
    # Seeds megatron's tracked RNG states: the same across DP replicas, distinct per TP rank.
    model_parallel_cuda_manual_seed(seed)


def _rendezvous_store(rank: int, world_size: int, master_addr: str, master_port: int) -> dist.TCPStore:
    """torch.distributed's key-value store, served by rank 0 on master_addr only.

    TCPStore's own server listens on every interface whatever host name it is given, so rank 0 binds
    the socket itself (loopback stays loopback) and hands it over.
    """
    timeout = timedelta(minutes=30)
    if rank != 0:
        return dist.TCPStore(master_addr, master_port, world_size, False, timeout=timeout)
    sock = socket.socket(socket.AF_INET6 if ":" in master_addr else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((master_addr, master_port))
    sock.listen(world_size)
    # the store owns the socket from here on; libuv's server does not accept a listening fd here
    return dist.TCPStore(master_addr, master_port, world_size, True, timeout=timeout,
                         master_listen_fd=sock.detach(), use_libuv=False)


def destroy_parallel() -> None:
    """Tear down megatron's groups and the process group (call before the process exits)."""
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
