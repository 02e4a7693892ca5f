"""Colocated weight transport: CUDA IPC handles through SGLang's /update_weights_from_tensor.

The sender keeps its tensors on its own GPU and posts only IPC handles (ForkingPickler payloads,
base64 in JSON), one payload per SGLang TP rank; each rank opens the handles and copies what its
model loader needs. The tensors must stay alive until the call returns, which this function
guarantees by holding the bucket for its duration.
"""

from __future__ import annotations

import torch


def _serializer():
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    # IPC handles name the GPU by UUID, so processes that see different CUDA_VISIBLE_DEVICES agree.
    monkey_patch_torch_reductions()
    return MultiprocessingSerializer


def send_bucket(server, bucket: list[tuple[str, torch.Tensor]], flush_cache: bool) -> None:
    """Load one bucket of HF-named CUDA tensors into a running server (megarl.rollout.sglang.SGLangServer)."""
    tensors = [(name, t.detach() if t.is_cuda else t.detach().cuda()) for name, t in bucket]
    payload = _serializer().serialize(tensors, output_str=True)
    server.post("/update_weights_from_tensor",
                {"serialized_named_tensors": [payload] * server.tp, "flush_cache": flush_cache})
    torch.cuda.synchronize()  # the server copied from our memory; only now may it change
    del tensors
