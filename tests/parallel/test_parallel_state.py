"""init_parallel on gloo and the CPU compatibility layer megatron-core needs there."""

import pytest
import torch

from tests.dist_utils import run_distributed


def _check_rank(rank):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from megarl.parallel.compat import install_cpu_compat

    assert (ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size()) == (2, 1)
    assert ps.get_tensor_model_parallel_rank() == rank and ps.is_pipeline_last_stage()

    # The CUDA calls megatron makes land on the CPU.
    stack = torch._C._len_torch_function_stack()
    install_cpu_compat()  # idempotent: no second mode on the stack
    assert torch._C._len_torch_function_stack() == stack
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.ones(2, device=torch.cuda.current_device()).device.type == "cpu"
    t = torch.randn(3)
    assert t.cuda() is t and t.to("cuda").device.type == "cpu"
    assert torch.nn.Parameter(t).type() == "torch.cuda.FloatTensor"
    assert t.type(torch.float64).dtype == torch.float64
    torch.cuda.synchronize()

    # The model-parallel RNG state differs between TP ranks and leaves the default stream untouched.
    state = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        draw = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), state)
    draws = [torch.empty(4) for _ in range(2)]
    dist.all_gather(draws, draw)
    assert not torch.equal(draws[0], draws[1])
    return True


def test_init_parallel_with_cpu_compat_on_two_ranks():
    assert run_distributed(_check_rank, 2, tp=2)


def test_init_parallel_rejects_a_bad_layout_or_device():
    from megarl.parallel.state import init_parallel

    with pytest.raises(ValueError, match="not divisible by tp"):
        init_parallel(0, 3, "127.0.0.1", 1, tp=2)
    with pytest.raises(ValueError, match="device='tpu'"):
        init_parallel(0, 1, "127.0.0.1", 1, device="tpu")
