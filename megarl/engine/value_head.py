"""A scalar value head on megatron's GPTModel: the critic and the reward model.

The head replaces GPTModel's vocab-parallel output layer with a [1, hidden] linear map, stored as HF's
`score.weight` (the name of transformers' *ForTokenClassification / *ForSequenceClassification heads
with num_labels=1), so a critic or reward model exports to, and loads from, an ordinary HF directory.
A checkpoint without `score.weight` (a policy) gives a zero-initialised head: values start at 0 and
the trunk starts from the policy.

The head is replicated on every TP rank: its input (the final norm's output) is the same on all of
them, so each computes the same values and the full gradient of its input, and megatron counts the
replicated weight once in the grad norm (it has no tensor_model_parallel attribute). Under sequence
parallelism the head first gathers the tokens of the TP group (what megatron's output layer does), with a
backward that keeps this rank's slice of the (replicated, complete) input gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from megarl.models.sharding import WeightMap, replicated

HEAD_NAME = "score.weight"


class ValueHead(torch.nn.Module):
    """Called as GPTModel calls its output layer: (hidden [s, b, h], weight=, runtime_gather_output=)
    -> (values [s, b, 1], bias None)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device, sequence_parallel: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return F.linear(hidden_states, self.weight), None


def attach_value_head(gpt, hidden_size: int, dtype: torch.dtype, device) -> None:
    """Swap the output layer of the last pipeline stage for a ValueHead (other stages have none)."""
    if getattr(gpt, "share_embeddings_and_output_weights", False):
        raise ValueError("a value model must not tie its output layer to the embedding: build the GPTModel "
                         "with share_embeddings_and_output_weights=False")
    if getattr(gpt, "post_process", False):
        gpt.output_layer = ValueHead(hidden_size, dtype, device, gpt.config.sequence_parallel)


def value_weight_maps(maps: list[WeightMap]) -> list[WeightMap]:
    """A family's weight maps with the LM output layer replaced by the value head."""
    kept = [m for m in maps if m.megatron != "output_layer.weight"]
    return kept + [WeightMap("output_layer.weight", (HEAD_NAME,), **replicated())]


class WithValueHead:
    """A checkpoint (SafetensorsCheckpoint) that also answers for `score.weight`: from the checkpoint
    when it has one, zeros [1, hidden] otherwise."""

    def __init__(self, checkpoint, hidden_size: int):
        self.checkpoint, self.hidden_size = checkpoint, hidden_size
        self.shapes = dict(checkpoint.shapes)
        if HEAD_NAME in self.shapes and self.shapes[HEAD_NAME] != (1, hidden_size):
            raise ValueError(f"{HEAD_NAME} has shape {self.shapes[HEAD_NAME]}; a value head is (1, {hidden_size})")
        self.initialised = HEAD_NAME not in self.shapes
        self.shapes[HEAD_NAME] = (1, hidden_size)

    def read(self, name: str, row: int | None = None) -> torch.Tensor:
        if name == HEAD_NAME and self.initialised:
            dtype = self.checkpoint.read("model.embed_tokens.weight").dtype
            return torch.zeros(1, self.hidden_size, dtype=dtype)
        return self.checkpoint.read(name, row)
