"""The experts a transformers mixture-of-experts model routes each token to, as the hf rollout engine generates
(actor.router_replay=rollout; megarl/models/routing_replay.py replays them in megatron).

Forward hooks on every MoE layer's `mlp.gate`: transformers' top-k routers (Qwen3-MoE, Mixtral) return (logits,
weights, indices), the indices GLOBAL expert ids [tokens, topk]. A gate that returns its logits alone (DeepSeek's,
GLM-4.5's: the MoE block chooses the experts from them, by groups and a bias) is refused at its first forward rather
than guessed at. Each forward of the sampling loop
(the prefill of a left-padded batch, then one token per row and step) is kept as [rows, tokens, layers, topk].
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch import Tensor

_GATE = re.compile(r"layers\.(\d+)\.mlp\.gate$")


class RoutingRecorder:
    def __init__(self, model):
        text = model.config.get_text_config()
        self.layers, self.topk = text.num_hidden_layers, text.num_experts_per_tok
        self.gates = [(int(m.group(1)), module) for name, module in model.named_modules()
                      if (m := _GATE.search(name))]
        if not self.gates:
            raise ValueError(f"actor.router_replay=rollout: {type(model).__name__} has no MoE gates "
                             "(model.layers.N.mlp.gate) whose routing the hf engine can record")
        self.forwards: list[Tensor] = []
        self._layers: dict[int, Tensor] = {}

    @contextlib.contextmanager
    def recording(self):
        """Hooks on the gates for a segment; `forwards` starts empty."""
        self.forwards, self._layers = [], {}
        handles = [gate.register_forward_hook(self._hook(layer)) for layer, gate in self.gates]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, layer: int):
        def keep(module, args, output):
            found = [t for t in (output if isinstance(output, tuple) else ()) if not t.is_floating_point()]
            if not found:
                raise ValueError(f"actor.router_replay=rollout: the hf engine cannot record {type(module).__name__}'s "
                                 "routing (it returns no expert indices); use rollout.engine=sglang")
            self._layers[layer] = found[-1].reshape(-1, self.topk)
        return keep

    def take(self, rows: int, tokens: int) -> None:
        """After a forward of `rows` x `tokens`: its experts, -1 for a dense layer."""
        out = torch.full((rows, tokens, self.layers, self.topk), -1, dtype=torch.int16)
        for layer, indices in self._layers.items():
            out[:, :, layer] = indices.reshape(rows, tokens, self.topk).to("cpu", torch.int16)
        self.forwards.append(out)
        self._layers = {}

    def row(self, k: int, fed: int, generated: int) -> Tensor:
        """Row k's record [fed + generated - 1, layers, topk]: its `fed` tokens at the prefill (the last columns of
        the left-padded batch), then each generated token but the last, fed one per later forward."""
        decoded = [step[k, 0] for step in self.forwards[1:generated]]
        record = torch.cat([self.forwards[0][k, -fed:], *(d[None] for d in decoded)])
        return record[:fed + generated - 1]
