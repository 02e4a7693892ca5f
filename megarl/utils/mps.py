"""CUDA MPS (Multi-Process Service) shares: with MPS running, several processes' kernels run side by side on one
GPU (without it the device time-slices between processes), and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, read when a
process creates its CUDA context, caps the share of the SMs that process's kernels may occupy."""

from __future__ import annotations

import os


def mps_pipe_directory() -> str:
    return os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")


def mps_share_env(percent: int, key: str) -> dict[str, str]:
    """The environment that gives a process to start `percent` of the GPU's SMs under MPS ({} at 0). Without a
    running MPS control daemon the variable would be ignored silently: that fails here, naming `key`."""
    if not percent:
        return {}
    pipe = mps_pipe_directory()
    if not os.path.exists(os.path.join(pipe, "control")):
        raise RuntimeError(f"{key}={percent} needs CUDA MPS, which is not running (no control pipe in {pipe}): start "
                           f"it with `nvidia-cuda-mps-control -d` (with CUDA_MPS_PIPE_DIRECTORY set for every process "
                           f"if not the default) or set {key}=0 (docs/async.md)")
    return {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(percent)}
