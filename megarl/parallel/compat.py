"""CPU compatibility layer for megatron-core (used only when no GPU is present).

megatron-core 0.16 calls CUDA in a handful of places even when every tensor lives on the CPU
(see /work/shared/notes/megatron-cpu.md). With these patches the same megatron code paths (GPTModel,
the pipeline schedules, DDP, the optimizer, grad clipping) run unchanged on gloo. Nothing else in
megarl knows about CUDA-on-CPU; on a GPU this module is never installed.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_installed = False


def _is_cuda_device(value) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and value.startswith("cuda")


class _CudaOnCpuMode(TorchFunctionMode):
    """Runs megatron's CUDA-flavoured tensor calls on the CPU.

    - `torch.zeros(..., device="cuda")` / `device=torch.cuda.current_device()` (schedules.py,
      transformer/utils.py, dot_product_attention.py) -> device="cpu".
    - `Tensor.cuda()` (language_module.py moves tied embeddings with PP) -> a no-op.
    - `Tensor.to("cuda")` -> stays on cpu.
    - `Tensor.type()` with no argument reports `torch.cuda.*Tensor`, because megatron's DDP buffers,
      optimizer and clip_grads compare `param.type()` against those strings.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        device = kwargs.get("device")
        # An int device is a CUDA index (e.g. torch.cuda.current_device()); this build has no CUDA.
        if _is_cuda_device(device) or (isinstance(device, int) and not isinstance(device, bool)):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda_device(a) or (isinstance(a, int) and not isinstance(a, bool)
                                                      and i == 1) else a for i, a in enumerate(args))
        return func(*args, **kwargs)


def _cpu_rng_tracker_class():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    class CpuRNGStatesTracker(CudaRNGStatesTracker):
        """megatron's RNG tracker (model-parallel seeds for init and dropout) over CPU generator states.

        The stock tracker reads and writes `torch.cuda` RNG states, which a CPU build does not have.
        """

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    return CpuRNGStatesTracker


def install_cpu_compat() -> None:
    """Install the CPU patches once per process (idempotent)."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():
        raise RuntimeError("install_cpu_compat() is for machines without a GPU; this one has CUDA")
    from megatron.core.tensor_parallel import random as mp_random

    # GlobalMemoryBuffer, p2p_communication, attention and the MoE token gather/scatter allocate on
    # device=torch.cuda.current_device(). A CPU device rather than an index: some of those calls run in
    # autograd's backward pass (megatron's sequence-parallel gather in the MoE allgather dispatcher),
    # where the TorchFunctionMode below is not active (torch does not carry modes into backward).
    torch.cuda.current_device = lambda: torch.device("cpu")
    # p2p_communication synchronizes the CUDA stream around pipeline sends; gloo is synchronous.
    torch.cuda.synchronize = lambda device=None: None
    # model_parallel_cuda_manual_seed / get_cuda_rng_tracker() find this tracker already in place.
    mp_random._CUDA_RNG_STATE_TRACKER = _cpu_rng_tracker_class()()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Activation recompute (CheckpointFunction) saves and restores the "device" RNG around the recomputed
    # forward; on the CPU that generator is torch's default one.
    mp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    # Entered for the life of the process: megatron's CUDA calls happen deep inside its modules.
    _CudaOnCpuMode().__enter__()
    _installed = True


def patch_moe_without_te() -> None:
    """megatron-core 0.16.1 MoE routers call `te_general_gemm`, a name that moe_utils defines only when
    TransformerEngine imports (router_gating_linear then fails with NameError without TE, on CPU and GPU
    alike). Defining it as None selects the plain torch.mm path megatron has for that case."""
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
