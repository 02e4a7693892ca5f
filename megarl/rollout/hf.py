"""A rollout engine on plain transformers: for CPU runs, tests and debugging only.

It generates with its own sampling loop over the model's KV cache, all prompts x n samples in one
left-padded batch, and reports the log-probability of each sampled token under the raw logits
(temperature 1, no top-k or top-p), as megarl.rollout.base requires. It has none of a serving engine's
throughput machinery (no continuous batching, paged attention or CUDA graphs); use SGLang on GPUs.

A Qwen2.5-VL or Qwen3-VL directory loads as its image-text-to-text model and takes prompts with images: the first
forward of a segment gets the rows' pixel_values and image_grid_thw and every step gets the M-RoPE position ids
megarl's Megatron model uses (megarl.models.qwen2_vl.mrope_positions: the same ids give the same log-probs). A response
never holds an image placeholder token (it is never sampled: a placeholder stands for image features the row does not
have); its log-probs are still those of the raw logits.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from typing import Callable, Iterable

import torch

from megarl.engine import offload
from megarl.rollout.base import (Generation, GroupCollector, ImageInputs, RolloutEngine, SamplingParams, check_images,
                                 derive_seed)
from megarl.rollout.hf_routing import RoutingRecorder
from megarl.rollout.partial import GenerationGate, Row, Segment, generate_rows
from megarl.utils.checksum import module_checksums
from megarl.utils.hf_config import TEXT_ONLY_TOWERS


class HFRolloutEngine(RolloutEngine):
    def __init__(self, model_path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0, fp32_lm_head: bool = False, record_routing: bool = False, adapters: bool = False):
        """`fp32_lm_head`: under a 16-bit dtype the output layer (and so the logits) in float32 (actor.fp32_lm_head).
        `record_routing`: each Generation carries the experts its tokens were routed to (hf_routing.py;
        actor.router_replay=rollout). `adapters`: syncs load LoRA adapters (load_lora_adapter) onto the base
        weights, which release_memory then keeps."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        self.device = torch.device(device)
        self.model_path = model_path
        config = AutoConfig.from_pretrained(model_path)
        self.vision = config.model_type in VISION_MODEL_TYPES  # prompts may have images (VisionInputs)
        # a text-only policy's checkpoint as its own multimodal class: AutoModelForCausalLM builds Qwen3.5's text class
        # from it, whose head is the text config's (untied, left random where the checkpoint ties it)
        multimodal = self.vision or config.model_type in TEXT_ONLY_TOWERS
        model_class = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
        self.model = model_class.from_pretrained(model_path, dtype=dtype).to(self.device).eval()
        with torch.no_grad():  # storages of our own: the loader's may map the file, which release_memory cannot free
            for p in self.model.parameters():  # (a tied lm_head is the same Parameter: it stays tied)
                p.data = p.data.clone()
        self.tied = bool(self.model.config.tie_word_embeddings)
        if fp32_lm_head and dtype != torch.float32:
            _fp32_output_layer(self.model.get_output_embeddings())
        text = self.model.config.get_text_config()  # a vision-language config holds the text model's pad id there
        self.eos_ids = _eos_ids(self.model)
        self.pad_id = text.pad_token_id if text.pad_token_id is not None else self.eos_ids[0]
        self.image_inputs = VisionInputs(config) if self.vision else None
        self.generator = torch.Generator().manual_seed(seed)  # the responses' seeds of unseeded calls
        self.gate = GenerationGate()  # pauses generation at weight updates (partial rollouts)
        self.released: list[tuple[torch.UntypedStorage, int]] = []  # storages freed by release_memory
        self._specs = None  # HF tensor specs, for sharded weight delivery
        self.routing = RoutingRecorder(self.model) if record_routing else None
        self.adapters = adapters
        self.lora_base: dict[str, torch.Tensor] = {}  # the base of each weight an adapter was merged into

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 images: list[ImageInputs | None] | None = None,
                 on_group: Callable[[int, list[Generation]], None] | None = None,
                 on_tokens: Callable[[int, int, list[int]], None] | None = None) -> list[Generation]:
        """Rows in segments between weight updates (megarl.rollout.partial): pause_generation from another thread
        stops a running segment between two decode steps. on_group: a prompt's group at the decode step its last
        row ends (a stop token or its budget), while the other rows go on. on_tokens(row, offset, token_ids): each
        decode step's token of every row still going (row: prompt * n + sample), as it is sampled (generate_rows)."""
        images = check_images(prompts, images, f"{type(self).__name__} ({self.model_path})", supported=self.vision)
        if self.released:
            raise RuntimeError("the rollout engine's weights were released and not pushed again; sync before generating")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if params.max_new_tokens < 1 or params.n < 1:
            raise ValueError(f"max_new_tokens and n must be >= 1, got {params.max_new_tokens} and {params.n}")
        # a seed per response: its draws follow from it and the positions alone (not from the batch it runs in)
        seeds = [derive_seed(params.seed, i, j) if params.seed is not None
                 else int(torch.randint(1 << 31, (1,), generator=self.generator)) for i in range(len(prompts))
                 for j in range(params.n)]
        rows = [Row(list(p), params.max_new_tokens, seed, images=image) for p, image, seed in zip(
            (p for p in prompts for _ in range(params.n)), (i for i in images for _ in range(params.n)), seeds)]
        groups = GroupCollector(params.n, on_group) if on_group is not None else None
        generate_rows(rows, self.gate, functools.partial(self._segment, params=params), params.max_interruptions,
                      None if groups is None else lambda k, row: groups.add(k, row.generation(k // params.n)),
                      on_tokens)
        return [row.generation(k // params.n) for k, row in enumerate(rows)]

    def pause_generation(self, partial: str = "resume") -> dict:
        return self.gate.pause(partial, abort=None)  # a running segment polls gate.stop between decode steps

    def resume_generation(self, version: int) -> None:
        self.gate.resume(version)

    def abort(self) -> None:
        """Cancel the running segments (over-sampling): their rows end with finish_reason "abort"."""
        self.gate.cancel()

    def _segment(self, *args, **kwargs) -> list[Generation]:
        with self.routing.recording() if self.routing else contextlib.nullcontext():
            return self._run_segment(*args, **kwargs)

    @torch.inference_mode()
    def _run_segment(self, rows: list[list[int]], limits: list[int], seeds: list[int], segment: Segment,
                     params: SamplingParams, images: list[ImageInputs | None] | None = None,
                     ended: Callable[[int, Generation], None] | None = None,
                     produced: Callable[[int, int, list[int]], None] | None = None) -> list[Generation]:
        """One segment: every row up to its limit or stop token, all in one left-padded batch; rows still going when
        the gate says stop end with finish_reason "abort". `ended(k, generation)`: row k has just ended.
        `produced(k, position, [token])`: row k has just sampled `token`, its `position`-th of the segment."""
        eos = set() if params.ignore_eos else set(self.eos_ids)
        stop_ids = set(params.stop_token_ids) | eos
        stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=self.device)
        tokens, mask = self._left_pad(rows)
        # a token's sampling draw follows from its index in the row; its rotary position is the same for text, and
        # M-RoPE's (which an image advances by less than its token count) for a vision-language model
        next_positions = mask.sum(-1)
        if self.vision:
            positions, image_kwargs = self.image_inputs.prefill(rows, images, tokens.shape[1])
            positions = positions.to(self.device)
            image_kwargs = {k: v.to(self.device) for k, v in image_kwargs.items()}
            next_rope = positions.amax((0, 2)) + 1
        else:
            positions, image_kwargs = (mask.cumsum(-1) - 1).clamp(min=0), {}
            next_rope = next_positions
        banned = self.image_inputs.placeholder_ids if self.vision else []
        limit = torch.tensor(limits, device=self.device)
        sampled, logprobs = [], []
        finished = torch.zeros(len(rows), dtype=torch.bool, device=self.device)
        out = None
        while not finished.all():
            if self.gate.stopping(segment):
                break
            if out is None:
                out = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True,
                                 **image_kwargs)
                if self.routing:
                    self.routing.take(*tokens.shape)
            else:
                mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
                step = (next_rope - 1)[:, None]
                out = self.model(input_ids=sampled[-1][:, None], attention_mask=mask,
                                 position_ids=step[None].expand(3, -1, -1) if self.vision else step,
                                 past_key_values=out.past_key_values, use_cache=True)
                if self.routing:
                    self.routing.take(len(rows), 1)
            logits = out.logits[:, -1].float()
            token = _sample(logits, params.temperature, params.top_p, seeds, next_positions.tolist(), banned,
                            params.top_k)
            token = torch.where(finished, self.pad_id, token)  # finished rows idle on padding
            sampled.append(token)
            logprobs.append(torch.log_softmax(logits, -1).gather(-1, token[:, None])[:, 0])
            was_finished = finished
            finished = finished | torch.isin(token, stop) | (len(sampled) >= limit)
            if produced is not None:
                for k, t in zip((~was_finished).nonzero().flatten().tolist(), token[~was_finished].tolist()):
                    produced(k, len(sampled) - 1, [t])
            if ended is not None:
                for k in (finished & ~was_finished).nonzero().flatten().tolist():
                    ended(k, self._routed(k, rows, self._cut([t[k].item() for t in sampled],
                                                             [lp[k].item() for lp in logprobs], stop_ids, limits[k])))
            next_positions, next_rope = next_positions + 1, next_rope + 1
        return [self._routed(k, rows, g) for k, g in enumerate(self._collect(sampled, logprobs, stop_ids, limits))]

    def _routed(self, k: int, rows: list[list[int]], generation: Generation) -> Generation:
        """Row k's generation with its record of the experts, where the engine records them."""
        if self.routing:
            generation.routed_experts = self.routing.row(k, len(rows[k]), len(generation.token_ids))
        return generation

    def _left_pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows)
        tokens = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
        return tokens.to(self.device), mask.to(self.device)

    @classmethod
    def _collect(cls, sampled, logprobs, stop_ids: set[int], limits: list[int]) -> list[Generation]:
        tokens = torch.stack(sampled, 1).tolist() if sampled else [[] for _ in limits]
        lps = torch.stack(logprobs, 1).tolist() if logprobs else [[] for _ in limits]
        return [cls._cut(row, lp, stop_ids, limit) for row, lp, limit in zip(tokens, lps, limits)]

    @staticmethod
    def _cut(row: list[int], lp: list[float], stop_ids: set[int], limit: int) -> Generation:
        """A row's tokens cut at its first stop token (kept) or its limit; a row that reached neither was stopped."""
        end = next((t + 1 for t, tok in enumerate(row[:limit]) if tok in stop_ids), None)
        reason = "stop" if end is not None else "length" if len(row) >= limit else "abort"
        end = end or min(len(row), limit)
        return Generation(prompt_index=0, token_ids=row[:end], logprobs=lp[:end], finish_reason=reason)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._check_idle()
        self._resume_weights()
        state = checkpoint_views(self.model)  # a tied lm_head is the embedding
        for name, tensor in named_tensors:
            self._copy_into(state, name, tensor, None)

    @torch.no_grad()
    def update_weight_shards(self, named_shards: Iterable[tuple[str, torch.Tensor]], gen_rank: int,
                             gen_tp: int) -> None:
        """Sharded delivery (megarl.reshard): the rows of each HF tensor that generation TP rank
        `gen_rank` of `gen_tp` holds, written where they belong (a CPU stand-in for an engine that loads
        pre-sharded tensors: a wrong row from the resharder lands in the wrong place and fails verification)."""
        from megarl.engine.weights import read_hf_config
        from megarl.reshard.inventory import hf_inventory

        if self._specs is None:
            self._specs = {s.name: s for s in hf_inventory(read_hf_config(self.model_path))}
        self._check_idle()
        self._resume_weights()
        state = checkpoint_views(self.model)
        for name, shard in named_shards:
            spec = self._specs.get(name)
            rows = None if spec is None or spec.dim is None else (spec.dim, *spec.rows(gen_tp, gen_rank))
            self._copy_into(state, name, shard, rows)

    @torch.no_grad()
    def load_lora_adapter(self, path: str) -> None:
        """Adapter-only sync (rollout.lora_sync=adapter): each weight a PEFT adapter directory adapts becomes its base
        plus the adapter's scale * B A, merged as the policy's export merges (lora_peft.merged), so the rollouts are
        those of a merged sync; SGLang serves the adapter beside its base weights instead."""
        from megarl.engine.lora_peft import merged, read_peft

        self._check_idle()
        config, pairs = read_peft(path)
        scale = config["lora_alpha"] / config["r"]
        state = checkpoint_views(self.model)
        for name, (A, B) in pairs.items():
            if name not in state:
                raise KeyError(f"load_lora_adapter: {path} adapts '{name}', which the model does not have")
            base = self.lora_base.setdefault(name, state[name].detach().clone())
            state[name].copy_(merged(base, A, B, scale))

    def _check_idle(self) -> None:
        """Weights change only while no generation runs (or it is paused): its tokens would mix two policies."""
        if not self.gate.idle():
            raise RuntimeError("weights updated while a generation is running: pause_generation first")

    @staticmethod
    def _copy_into(state: dict, name: str, tensor: torch.Tensor, rows: tuple[int, int, int] | None) -> None:
        if name not in state:
            raise KeyError(f"update_weights: the model has no weight named '{name}'")
        target = state[name] if rows is None else state[name].narrow(rows[0], rows[1], rows[2] - rows[1])
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"update_weights: '{name}'{'' if rows is None else f' rows {rows[1:]}'} has shape "
                             f"{tuple(tensor.shape)}, the model expects {tuple(target.shape)}")
        target.copy_(tensor)

    def release_memory(self) -> None:
        """Free the weights' storage, as a colocated SGLang does between rollouts: the values are gone. With adapter
        syncs the base weights stay (the syncs send adapters alone)."""
        if not self.released and not self.adapters:
            self.released = [(s, s.nbytes()) for s in offload.distinct_storages(self.model.parameters())]
            for storage, _ in self.released:
                storage.resize_(0)

    def resume_memory(self) -> None:
        """Storage back, filled with NaN: weights must be pushed before generating (a missed tensor shows)."""
        self._resume_weights()

    def _resume_weights(self) -> None:
        if not self.released:
            return
        for storage, nbytes in self.released:
            storage.resize_(nbytes)
        self.released = []
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(float("nan"))

    def resident_bytes(self) -> int:
        return offload.resident_bytes(self.model.parameters())

    def weight_checksums(self) -> dict[int, dict[int, dict[str, list]]]:
        """By checkpoint name, as the sender's (weight_layout's "hf" layout): each expert's own tensors."""
        return {0: {0: module_checksums(_Named(self._held()))}}

    def named_weights(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().clone() for name, t in self._held().items()}

    def _held(self) -> dict[str, torch.Tensor]:
        """Every weight (and persistent buffer) by checkpoint name, a tied lm_head once (as the embedding)."""
        return {name: t for name, t in checkpoint_views(self.model).items()
                if not (self.tied and name == "lm_head.weight")}


class _Named:
    """Tensors by name, as module_checksums reads a model."""

    def __init__(self, named: dict[str, torch.Tensor]):
        self.named = named

    def named_parameters(self):
        return iter(self.named.items())


def checkpoint_views(model) -> dict[str, torch.Tensor]:
    """The model's weights and persistent buffers under their checkpoint names, as views of its own storage.
    transformers >= 5 holds a mixture-of-experts layer's experts fused (Qwen3-MoE, DeepSeek, Mixtral:
    experts.gate_up_proj [experts, 2 x ffn, hidden], each expert's gate rows then its up rows; experts.down_proj
    [experts, hidden, ffn]) and converts them from and to per-expert tensors on load and save: expert e's
    gate/up/down_proj.weight (Mixtral's w1/w3/w2.weight) are views of its slices here. Mixtral's checkpoints name the
    layer's MoE block block_sparse_moe where transformers 5 names it mlp. Qwen3-VL-MoE's checkpoints (and megarl's
    export) keep them stacked, input-major ([experts, hidden, 2 x ffn], [experts, ffn, hidden]): transposed views.
    gpt-oss's hold them stacked as transformers does (GptOssExperts): as they are."""
    mixtral = model.config.model_type == "mixtral"
    stacked = model.config.model_type == "qwen3_vl_moe"
    as_stored = model.config.model_type == "gpt_oss"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    views = {}
    for name, t in model.state_dict().items():
        name = _checkpoint_name(name, model.config.model_type)
        if mixtral:
            name = name.replace(".mlp.", ".block_sparse_moe.")
        prefix, _, fused = name.rpartition(".experts.")
        if stacked and fused in ("gate_up_proj", "down_proj"):
            views[name] = t.transpose(1, 2)
        elif as_stored:
            views[name] = t
        elif fused == "gate_up_proj" and t.dim() == 3:
            ffn = t.shape[1] // 2
            for e in range(t.shape[0]):
                views[f"{prefix}.experts.{e}.{gate}.weight"] = t[e, :ffn]
                views[f"{prefix}.experts.{e}.{up}.weight"] = t[e, ffn:]
        elif fused == "down_proj" and t.dim() == 3:
            for e in range(t.shape[0]):
                views[f"{prefix}.experts.{e}.{down}.weight"] = t[e]
        else:
            views[name] = t
    return views


VISION_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")  # their rows may carry images; M-RoPE positions (VisionInputs)
# transformers >= 5 nests Qwen2.5-VL's modules (model.language_model, model.visual) where its checkpoints, and
# megarl's exported names, have them at the top (model.layers..., visual...); Qwen3-VL's checkpoints nest them too.
# Gemma 3's multimodal model holds model.language_model.*, model.vision_tower.* and model.multi_modal_projector.*
# where its checkpoints say language_model.model.*, vision_tower.* and multi_modal_projector.*
_CHECKPOINT_PREFIXES = {"qwen2_5_vl": (("model.language_model.", "model."), ("model.visual.", "visual.")),
                        "gemma3": (("model.language_model.", "language_model.model."),
                                   ("model.vision_tower.", "vision_tower."),
                                   ("model.multi_modal_projector.", "multi_modal_projector."))}


def _checkpoint_name(name: str, model_type: str) -> str:
    for module, checkpoint in _CHECKPOINT_PREFIXES.get(model_type, ()):
        if name.startswith(module):
            return checkpoint + name[len(module):]
    return name


class VisionInputs:
    """What a Qwen2.5-VL or Qwen3-VL forward needs beside the token ids: M-RoPE position ids of left-padded rows
    (megarl's Megatron model's, so both see the same positions) and the rows' images, concatenated in row order (the
    order their placeholder tokens come in the flattened batch)."""

    def __init__(self, config):
        self.image_token_id = config.image_token_id
        self.placeholder_ids = [config.image_token_id, config.video_token_id]  # never sampled
        self.merge = config.vision_config.spatial_merge_size

    def prefill(self, rows: list[list[int]], images: list[ImageInputs | None] | None,
                width: int) -> tuple[torch.Tensor, dict]:
        """([3, rows, width] position ids, 0 on the left padding; pixel_values and image_grid_thw, or none)."""
        from megarl.models.qwen2_vl import mrope_positions

        images = images or [None] * len(rows)
        positions = torch.zeros(3, len(rows), width, dtype=torch.long)
        for i, (row, image) in enumerate(zip(rows, images)):
            grid = torch.zeros(0, 3, dtype=torch.long) if image is None else image.image_grid_thw
            try:
                positions[:, i, width - len(row):] = mrope_positions(torch.tensor(row), grid, self.image_token_id,
                                                                     self.merge)
            except ValueError as e:
                raise ValueError(f"prompt row {i}: its image placeholder tokens do not match its images: {e}") from None
        given = [image for image in images if image is not None]
        if not given:
            return positions, {}
        return positions, {"pixel_values": torch.cat([image.pixel_values for image in given]),
                           "image_grid_thw": torch.cat([image.image_grid_thw for image in given])}


def _fp32_output_layer(head: torch.nn.Linear) -> None:
    """The output layer computes in float32 from its 16-bit weight and input (a cast per call, no float32 copy kept:
    weight updates write into the 16-bit parameter)."""
    def forward(hidden: torch.Tensor) -> torch.Tensor:
        bias = None if head.bias is None else head.bias.float()
        return torch.nn.functional.linear(hidden.float(), head.weight.float(), bias)
    head.forward = forward


def _eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        raise ValueError("the model defines no eos_token_id (generation_config.json or config.json)")
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def _sample(logits: torch.Tensor, temperature: float, top_p: float, seeds: list[int],
            positions: list[int], banned: list[int] = (), top_k: int = -1) -> torch.Tensor:
    """One token per row: argmax at temperature 0, else drawn from the tempered, top-k- then top-p-truncated
    distribution by inverting its CDF at a uniform that follows from the row's seed and the token's position alone,
    so a row's draws do not depend on the other rows of the batch, and a continued row (prompt + its tokens so far)
    draws what it would have drawn uninterrupted (as SGLang's seeded sampler, by position). `banned` tokens are never
    drawn; top_k -1 or 0 keeps every token (SGLang's order: top_k, then top_p over what it kept)."""
    if len(banned):
        logits = logits.index_fill(-1, torch.tensor(banned, device=logits.device), float("-inf"))
    if temperature == 0:
        return logits.argmax(-1)
    if 0 < top_k < logits.shape[-1]:
        # ties at the k-th value keep the k that topk picks, so never more than k tokens stay
        kept = logits.topk(top_k, -1).indices
        logits = torch.full_like(logits, float("-inf")).scatter(-1, kept, logits.gather(-1, kept))
    probs = torch.softmax(logits / temperature, -1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        # drop a token when the more likely tokens before it already cover top_p (the first always stays)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    cdf = probs.double().cumsum(-1)
    u = torch.tensor([_uniform(s, p) for s, p in zip(seeds, positions)], dtype=torch.float64, device=cdf.device)
    token = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return token.clamp(max=probs.shape[-1] - 1)


def _uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) from (seed, position): 53 bits of a hash."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)
