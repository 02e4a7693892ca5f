"""The rollout-engine interface. `hf.py` (transformers, CPU/debug) and `sglang.py` (GPU) implement it.

Token in, token out: engines take prompt token ids and return response token ids with the
log-probability of each sampled token under the sampling distribution's logits at temperature 1
(i.e. the policy's own log-probs, so they are comparable with Megatron's).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Iterable

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    n: int = 1  # samples per prompt
    stop_token_ids: list[int] = field(default_factory=list)  # the tokenizer's EOS is a stop too, unless ignore_eos
    ignore_eos: bool = False  # fixed-length responses (benchmarks): EOS is sampled like any token
    seed: int | None = None


@dataclass
class Generation:
    prompt_index: int  # which prompt of the request this answers
    token_ids: list[int]  # response tokens, ending with the stop token when one was produced
    logprobs: list[float]  # one per response token
    finish_reason: str  # "stop" or "length"


class RolloutEngine(abc.ABC):
    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """`params.n` generations per prompt, grouped by prompt in order."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named full tensors (one bucket of them per call); names not given keep their values."""

    @abc.abstractmethod
    def named_weights(self) -> dict[str, torch.Tensor]:
        """The weights as the engine holds them, by HF name (for verifying a sync)."""

    def release_memory(self) -> None:
        """Free weights and cache memory (colocated mode); a no-op where nothing is shared."""

    def resume_memory(self) -> None:
        """Take back what release_memory freed; weights must be pushed again afterwards."""

    def resume_kv_cache(self) -> None:
        """Take back the KV cache before a rollout phase (engines that release it between rollouts)."""

    def resident_bytes(self) -> int | None:
        """Bytes of weights the engine holds in memory now; None where only the device can tell (SGLang)."""
        return None

    def shutdown(self) -> None:
        """Stop what the engine started outside this process (SGLang's servers); a no-op for in-process engines."""
