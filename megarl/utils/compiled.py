"""A function compiled by torch.compile (inductor) on some device types, eager on the others.

The log-prob kernel's chunk functions are a few lines of torch each: inductor makes one kernel of each on the
GPU, where eager torch makes a pass over memory per operation (a call costs ~0.2 ms of host time in torch.compile's
wrappers: fine for these, called a few times a micro-batch; RoPE and SwiGLU, called in every layer, are Triton
kernels launched directly, models/kernels.py). On the CPU
they run eagerly (the same math, no compiler in the tests' way). A compilation that fails is reported once and
leaves the function eager: the result is the same, only slower."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class Compiled:
    """Call `fn` compiled where the first tensor argument lives on a device type in `on`, else eagerly."""

    def __init__(self, fn, on: tuple[str, ...] = ("cuda",), **options):
        self.fn, self.on, self.options = fn, on, options
        self.compiled = None  # torch.compile's wrapper, made at the first compiled call
        self.failed = False

    def active(self, device: torch.device) -> bool:
        """Whether a call with tensors on `device` runs compiled."""
        return device.type in self.on and not self.failed

    def __call__(self, *args):
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        if not self.active(device):
            return self.fn(*args)
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, **self.options)
        try:
            return self.compiled(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # any compiler failure: the eager function is the same math
            logger.warning("torch.compile of %s failed (%s: %s); running it eagerly", self.fn.__name__,
                           type(e).__name__, e)
            self.failed = True
            return self.fn(*args)
