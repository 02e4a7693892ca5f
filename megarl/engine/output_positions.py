"""The LM output layer (the vocabulary projection) at the real token positions of a micro-batch only.

A micro-batch's padding (packing.py: doc id 0) needs no logits, and the vocabulary projection plus the
log-prob / entropy pass over [positions, V / TP] are the costliest per-position work after the decoder. A
forward pre-hook on GPTModel's output_layer replaces its input, the final hidden states [s, b, h], by the
hidden states of the selected positions [N, 1, h] (the rows laid end to end, `index` into [b * s]); GPTModel
then returns logits [1, N, V / TP], which vocab_parallel_logprobs takes as they are, and the engine scatters
the per-position results back into the rows (`to_rows`). Under sequence parallelism the hidden states are
this TP rank's slice of the positions: the hook gathers them first and runs the output layer without its own
sequence-parallel gather for that call (as megatron's inference path does for its last-token logits); the
gather's backward then takes this rank's slice of a gradient the output layer has already all-reduced.
Hooks, not a wrapper module: the module tree (and the checkpoint keys) stay megatron's.
"""

from __future__ import annotations

from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from torch import Tensor


class OutputPositions:
    """Hooks on one GPTModel's output layer; `index` (set around a forward call, None = every position)."""

    def __init__(self, gpt):
        self.index: Tensor | None = None
        self._restore_sequence_parallel = False
        gpt.output_layer.register_forward_pre_hook(self._select, with_kwargs=True)
        gpt.output_layer.register_forward_hook(self._restore)

    def _select(self, layer, args, kwargs):
        if self.index is None:
            return None
        hidden = args[0]
        if layer.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
            layer.sequence_parallel, self._restore_sequence_parallel = False, True
        # [s, b, h] -> the rows end to end [b * s, h] -> the selected positions [N, 1, h]
        hidden = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])[self.index].unsqueeze(1)
        return (hidden, *args[1:]), kwargs

    def _restore(self, layer, args, output):
        if self._restore_sequence_parallel:
            layer.sequence_parallel, self._restore_sequence_parallel = True, False


def real_positions(doc_ids: Tensor) -> Tensor:
    """The flat indices into the rows laid end to end ([rows * L]) of every non-padding position."""
    return (doc_ids.reshape(-1) > 0).nonzero().squeeze(1)


def to_rows(selected: Tensor, mb: dict) -> Tensor:
    """Per selected position [1, N] (or [rows, L] already: returned as is) -> [rows, L], 0 at the others;
    differentiable."""
    if "output_positions" not in mb:
        return selected
    rows = mb["tokens"].shape
    full = selected.new_zeros(rows.numel())
    return full.index_copy(0, mb["output_positions"], selected.reshape(-1)).view(rows)


def select(per_position: Tensor, mb: dict) -> Tensor:
    """[rows, L] -> [1, N] at the micro-batch's selected positions (as is when none are selected)."""
    if "output_positions" not in mb:
        return per_position
    return per_position.reshape(-1)[mb["output_positions"]].unsqueeze(0)
