"""The rollout-engine interface. `hf.py` (transformers, CPU/debug) and `sglang.py` (GPU) implement it.

Token in, token out: engines take prompt token ids and return response token ids with the
log-probability of each sampled token under the sampling distribution's logits at temperature 1
(i.e. the policy's own log-probs, so they are comparable with Megatron's).

Vision-language policies (Qwen2.5-VL): a prompt may come with its images, already processed (megarl/data/images.py):
the prompt ids hold the expanded image placeholder tokens, and `ImageInputs` the pixel values and patch grids.
"""

from __future__ import annotations

import abc
import hashlib
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Generator, Iterable, Iterator

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # sample among the k most likely tokens (before top_p); -1 or 0 = every token
    n: int = 1  # samples per prompt
    stop_token_ids: list[int] = field(default_factory=list)  # the tokenizer's EOS is a stop too, unless ignore_eos
    ignore_eos: bool = False  # fixed-length responses (benchmarks): EOS is sampled like any token
    # The call's random draws follow from this seed and its prompts alone (an engine keeps no random state
    # across calls), so a resumed run regenerates what the uninterrupted one drew; None: the engine's own
    # random state, not reproducible. SGLang honours it only in deterministic mode (rollout.deterministic).
    seed: int | None = None
    # partial rollouts (megarl.rollout.partial): a response interrupted by more weight updates than this ends there,
    # with finish_reason "abort" and its tokens so far, so a generate() call returns after at most this many updates
    max_interruptions: int = 4


def derive_seed(*parts: int | str) -> int:
    """A seed in [0, 2**31) that depends only on `parts`, the same in every process and run (Python's hash()
    of a string is salted per process). 31 bits: SGLang holds a request's sampling_seed in an int32."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (1 << 31)


@dataclass
class ImageInputs:
    """One prompt's images as the HF image processor makes them (all of the prompt's images together, in the order
    their placeholder runs appear in its ids)."""

    pixel_values: torch.Tensor  # [patches, channels * temporal_patch * patch * patch], every image's rows in order
    image_grid_thw: torch.Tensor  # [images, 3]: each image's (t, h, w) in patches, before the spatial merge

    def __post_init__(self):
        if self.image_grid_thw.dim() != 2 or self.image_grid_thw.shape[-1] != 3:
            raise ValueError(f"image_grid_thw must be [images, 3], got {tuple(self.image_grid_thw.shape)}")
        patches = int(self.image_grid_thw.prod(-1).sum())
        if self.pixel_values.dim() != 2 or self.pixel_values.shape[0] != patches:
            raise ValueError(f"pixel_values must be [patches, features] with {patches} patches (image_grid_thw's), "
                             f"got {tuple(self.pixel_values.shape)}")


def check_images(prompts: list[list[int]], images: list[ImageInputs | None] | None, engine: str,
                 supported: bool) -> list[ImageInputs | None]:
    """One entry per prompt (None: text only); an engine or model that cannot take images refuses any by name."""
    if images is None:
        return [None] * len(prompts)
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} image entries for {len(prompts)} prompts: one per prompt (None for text only)")
    if not supported and any(i is not None for i in images):
        raise ValueError(f"{engine} cannot take images: the prompts have images but the engine or its model is "
                         "text-only (a vision-language model, e.g. Qwen2.5-VL, takes them)")
    return list(images)


@dataclass
class Generation:
    prompt_index: int  # which prompt of the request this answers
    token_ids: list[int]  # response tokens, ending with the stop token when one was produced
    logprobs: list[float]  # one per response token
    finish_reason: str  # "stop", "length", or "abort" (cancelled, or interrupted past max_interruptions)
    # one per response token: the policy version that produced it (engine.resume_generation's); None where the
    # engine was never told a version (the caller knows it: the synchronous loop)
    versions: list[int] | None = None
    interruptions: int = 0  # weight updates that interrupted it (megarl.rollout.partial)
    # with routing recorded (actor.router_replay=rollout): [prompt + response - 1 tokens, layers, topk] int16, the
    # GLOBAL experts each layer routed every token the model was fed to (the last response token is never fed);
    # -1 for a dense layer
    routed_experts: torch.Tensor | None = None


class GroupCollector:
    """Rows of a generate() call as they end, handed on by prompt once all `n` of a prompt's have (thread-safe: the
    engines' rows end in several threads)."""

    def __init__(self, n: int, on_group: Callable[[int, list[Generation]], None]):
        self.n, self.on_group = n, on_group
        self.rows: dict[int, dict[int, Generation]] = {}  # prompt -> sample -> generation, until complete
        self.lock = threading.Lock()

    def add(self, row: int, generation: Generation) -> None:
        """Row `row` of the call (prompt row // n, sample row % n) has ended."""
        prompt = row // self.n
        with self.lock:
            group = self.rows.setdefault(prompt, {})
            group[row % self.n] = generation
            complete = len(group) == self.n and self.rows.pop(prompt)
        if complete:
            self.on_group(prompt, [complete[j] for j in range(self.n)])


def stream_callbacks(run: Callable[[Callable], object]) -> Generator:
    """The calls `run(callback)` makes to its callback, as a generator of their arguments (one argument: itself, more:
    a tuple), each as soon as it is made: `run` goes on in a thread of its own meanwhile; its error is raised here, its
    return value is the generator's (what `yield from` gives)."""
    made: queue.Queue = queue.Queue()
    done, returned = object(), []

    def work() -> None:
        try:
            returned.append(run(lambda *args: made.put(args[0] if len(args) == 1 else args)))
            made.put(done)
        except BaseException as error:  # noqa: B036  (raised in the consumer)
            made.put(error)

    threading.Thread(target=work, name="megarl-stream-callbacks", daemon=True).start()
    while (item := made.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item
    return returned[0]


class RolloutEngine(abc.ABC):
    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 images: list[ImageInputs | None] | None = None,
                 on_group: Callable[[int, list[Generation]], None] | None = None) -> list[Generation]:
        """`params.n` generations per prompt, grouped by prompt in order. `images`: one entry per prompt, None for a
        text-only prompt (every sample of a prompt sees its images); engines that cannot take images refuse any.
        `on_group(i, generations)`: prompt i's n generations, as soon as all of them have ended (GroupCollector),
        before the call returns, from a thread of the call's."""

    def generate_groups(self, prompts: list[list[int]], params: SamplingParams,
                        images: list[ImageInputs | None] | None = None) -> Iterator[tuple[int, list[Generation]]]:
        """generate()'s groups as they end, in that order: (prompt index, its n generations). generate() runs in a
        thread of its own meanwhile; its error is raised here."""
        return stream_callbacks(lambda on_group: self.generate(prompts, params, images, on_group=on_group))

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named full tensors (one bucket of them per call); names not given keep their values."""

    @abc.abstractmethod
    def named_weights(self) -> dict[str, torch.Tensor]:
        """The weights as the engine holds them, by HF name (for verifying a sync)."""

    def weight_checksums(self) -> dict[int, dict[int, dict[str, list]]]:
        """server -> engine TP rank -> parameter -> [dtype, shape, sum 0, sum 1, is_buffer]: checksums
        (megarl.utils.checksum) of every parameter and persistent buffer as the engine holds them, computed
        where they live (for verifying a sync against megarl.rollout.weight_layout's expected checksums)."""
        raise NotImplementedError(f"{type(self).__name__} cannot checksum its weights: use "
                                  "trainer.verify_weight_sync_deep=true")

    def pause_generation(self, partial: str = "resume") -> dict:
        """Before a weight update, from another thread than a running generate(): new requests wait, and with
        partial resume or restart the running ones stop, keeping their tokens so far (finish: they run to their
        end). Returns once nothing generates (megarl.rollout.partial), with what the pause did."""
        raise NotImplementedError(f"{type(self).__name__} has no partial rollouts")

    def resume_generation(self, version: int) -> None:
        """After a weight update: the engine holds policy `version`, which the tokens generated from now on carry;
        the paused requests go on (resume: from their tokens; restart: from their prompt)."""
        raise NotImplementedError(f"{type(self).__name__} has no partial rollouts")

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
