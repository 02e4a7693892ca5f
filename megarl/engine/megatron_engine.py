"""MegatronEngine: one model on megatron-core inside one training rank.

GPTModel (local spec, core attention megatron's, SDPA or varlen flash: attention.py; sequence parallelism
without TE: megarl/models/norm.py; context parallelism without TE: context_parallel.py) + megatron DDP +
megatron's optimizer and LR scheduler; forward/backward runs through megatron's pipeline schedule (PP=1,
PP>1, interleaved virtual stages). Roles: the policy and its frozen KL reference (LM head), the critic and
the reward model (a scalar value head, value_head.py); trainable=False builds no optimizer. Micro-batches
are packed or padded (packing.py); offload()/onload() park the engine's memory on the host (offload.py).
Every rank of the job runs the same calls; each DP rank passes its own share of the batch, identical across
its TP/PP ranks.
"""

from __future__ import annotations

import contextlib
import math
from functools import partial
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from megarl.config import AlgorithmConfig, EngineConfig
from megarl.engine import (apex_ops, checkpoint, context_parallel, finite, fp32_head, lora, offload, output_positions,
                           weights)
from megarl.engine.attention import packed_attention_inputs, resolve_core_attention, with_core_attention
from megarl.engine.loss_kinds import LOSS_KINDS, LossKind, Totals
from megarl.engine.logprobs import vocab_parallel_logprobs, vocab_parallel_sum_squared_probs
from megarl.engine.options import optimizer_config, precision_dtype, with_engine_options, with_fused_kernels
from megarl.engine.packing import (IMAGE_INPUTS, align_to_tokens, empty_micro_batch, next_tokens, pack_micro_batches,
                                   reset_rotary_positions, sequence_lengths, unpack)
from megarl.engine.value_head import WithValueHead, attach_value_head, value_weight_maps
from megarl.models import checked_family, routing_replay
from megarl.models.decoder import decoder_block_spec, text_config
from megarl.models.router import expert_load_metrics, reset_expert_load, restore_expert_biases, snapshot_expert_biases
from megarl.protocol import Batch
from megarl.utils.hf_config import TEXT_ONLY_TOWERS


# actor.packing=one_row without pipeline stages: each micro-batch's row is cut to its used length rounded up to
# this (times the width multiple of SP / CP): little padding, and few distinct shapes for the kernels' caches.
ONE_ROW_TRIM_MULTIPLE = 64


class MegatronEngine:
    def __init__(self, model_path: str, section: EngineConfig, algorithm: AlgorithmConfig, device: str,
                 seed: int, total_steps: int, load_hf_weights: bool = True, head: str = "lm",
                 trainable: bool = True, skip_nonfinite_updates: bool = False):
        """load_hf_weights=False: model_path needs only config.json; the weights come from a megatron
        checkpoint loaded next (load_checkpoint), e.g. in megarl.convert.
        head='value': a scalar value head instead of the LM head (critic, reward model: value_head.py).
        trainable=False: no DDP, optimizer or gradients (a frozen reference or a scoring reward model).
        `section` is the role's config section (ActorConfig, CriticConfig, RewardModelConfig).
        skip_nonfinite_updates: an update with a NaN or infinite loss or gradient norm is skipped (counted in the
        metrics) instead of raising FloatingPointError (trainer.skip_nonfinite_updates)."""
        if head not in ("lm", "value"):
            raise ValueError(f"head={head!r}: expected 'lm' or 'value'")
        self.head, self.trainable, self.skip_nonfinite_updates = head, trainable, skip_nonfinite_updates
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("MegatronEngine needs megarl.parallel.state.init_parallel() first")
        self.section, self.algorithm, self.model_path = section, algorithm, model_path
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
        self.hf_config = weights.read_hf_config(model_path)
        self.vocab_size = text_config(self.hf_config)["vocab_size"]
        family = self.family = checked_family(self.hf_config, f"{model_path}/config.json")
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        self.params_dtype = precision_dtype(section.precision, device)
        config = family.transformer_config(self.hf_config, tp, pp, self.params_dtype,
                                           use_cpu_initialization=device == "cpu",
                                           ep=parallel_state.get_expert_model_parallel_world_size(),
                                           etp=parallel_state.get_expert_tensor_parallel_world_size(),
                                           first_stage_layers=section.parallel.pp_first_stage_layers,
                                           last_stage_layers=section.parallel.pp_last_stage_layers)
        config = with_fused_kernels(with_engine_options(config, section), section, device)
        apex_ops.install(wgrad_fusion=config.gradient_accumulation_fusion)
        self.core_attention = resolve_core_attention(section.attention, device, config.context_parallel_size,
                                                     family.name if family.local_attention_only else None)
        def spec(layer: int):  # each layer's spec by its global index (DeepSeek: dense layers, then MoE)
            return with_core_attention(family.layer_spec(self.hf_config, layer), self.core_attention)
        gpt_kwargs = family.gpt_model_kwargs(self.hf_config, tp)
        if head == "value":
            gpt_kwargs["share_embeddings_and_output_weights"] = False
        self.gpts = self._build_chunks(config, spec, gpt_kwargs)
        self.gpt = self.gpts[0]  # the whole model unless section.parallel.vpp > 1 (then use self.gpts)
        # actor.router_replay=rollout: the routers replay the batch's routed_experts (routing_replay.py)
        self._replays = self._install_router_replay(config, pp)
        self.weight_maps = family.weight_maps(self.hf_config, tp)
        if head == "value":
            self.weight_maps = value_weight_maps(self.weight_maps)
        self.layout = weights.PipelineLayout(self.gpts)
        if load_hf_weights:
            hf_checkpoint = weights.SafetensorsCheckpoint(model_path)
            if head == "value":
                hf_checkpoint = WithValueHead(hf_checkpoint, config.hidden_size)
            for gpt in self.gpts:
                weights.load_hf_weights(gpt, self.weight_maps, hf_checkpoint)
        # actor.lora: adapters on the frozen base (lora.py), in place before the cast and before DDP takes the
        # parameters that need gradients
        lora_section = getattr(section, "lora", None)
        self.lora = lora.install(self.gpts, lora_section, seed) if lora_section and lora_section.rank else None

        # The local spec keeps norms in fp32; Float16Module casts the whole model to bf16 (as
        # Megatron's training loop does) and the outputs of the last stage back to fp32.
        modules = [Float16Module(config, gpt) if self.params_dtype == torch.bfloat16 else gpt for gpt in self.gpts]
        # ...but not the logits: Float16Module's float32 copy of [positions, V / TP] (6.2 GB at 10240 x 151936) and
        # that of its gradient are two more passes over the largest tensors of a step; the log-prob kernel and the
        # value readers compute in float32 from the bf16 values themselves, to the same numbers.
        self._forward_kwargs = {"fp32_output": False} if self.params_dtype == torch.bfloat16 else {}
        if section.freeze_vision_tower and self.hf_config.get("model_type") not in TEXT_ONLY_TOWERS:
            self._freeze_vision_tower()
        # after the cast: each HF tensor's dtype is its parameter's (DeepSeek-V3's routing bias stays fp32)
        self.hf_tensors = checkpoint.hf_tensors_from_model(self.gpts, self.weight_maps, self.layout)
        self._forward_backward = get_forward_backward_func(pp_size=pp, vp_size=section.parallel.vpp
                                                           if section.parallel.vpp > 1 else None)
        self._reference: list[torch.Tensor] | None = None
        self._offloader = offload.Offloader()
        self.step_count = 0
        if not trainable:
            for module in modules:
                module.requires_grad_(False)
            self.models, self.model, self.optimizer, self.scheduler = modules, modules[0], None, None
            return
        # One DDP per virtual-pipeline chunk; only the first buckets its grads (as megatron's training does).
        self.models = [DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                  use_distributed_optimizer=section.use_distributed_optimizer),
            module, disable_bucketing=i > 0) for i, module in enumerate(modules)]
        self.model = self.models[0]  # the whole model unless section.parallel.vpp > 1 (then use self.models)
        # The schedule calls these: DP grad all-reduce (+ tied-embedding grads across PP stages).
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = [m.no_sync for m in self.models] if len(self.models) > 1 else self.model.no_sync

        self.optimizer = get_megatron_optimizer(optimizer_config(section, self.params_dtype, self.device), self.models)
        o = section.optim
        # Advanced once per policy train() call (one RL step), so warmup/decay count RL steps.
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=o.warmup_steps,
            lr_decay_steps=max(total_steps, o.warmup_steps + 1), lr_decay_style=o.decay_style,
            start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=max(total_steps, 1),
            wd_incr_style="constant", override_opt_param_scheduler=True,  # a resume keeps this run's schedule
            use_checkpoint_opt_param_scheduler=False)

    def _install_router_replay(self, config, pp: int) -> list:
        if getattr(self.section, "router_replay", "off") == "off":
            return []
        # the backward's recompute re-routes: with one stage it follows its own forward at once, under the pipeline
        # schedules other micro-batches' forwards come between, whose experts it would replay
        if pp > 1 and (config.recompute_granularity == "full" or "moe" in (config.recompute_modules or [])):
            raise ValueError("actor.router_replay=rollout with pipeline stages (actor.parallel.pp > 1) cannot "
                             "recompute the MoE layers (actor.recompute=full, or selective with moe)")
        return routing_replay.install(self.gpts)

    def _build_chunks(self, config, spec: Callable[[int], object], gpt_kwargs: dict) -> list[GPTModel]:
        """This rank's GPTModel, or its section.parallel.vpp virtual-pipeline chunks (interleaved layers)."""
        vpp = self.section.parallel.vpp
        self._output_positions: list[output_positions.OutputPositions] = []
        # megatron's tied-embedding and grad-finalising code reads the virtual size from parallel_state.
        parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
        chunks = []
        for stage in range(vpp):
            vp_stage = stage if vpp > 1 else None
            gpt = self.family.model_class(config, decoder_block_spec(spec, config, vp_stage), vp_stage=vp_stage,
                           pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                           post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                           **gpt_kwargs).to(self.device)
            reset_rotary_positions(gpt)
            if self.head == "value":
                attach_value_head(gpt, config.hidden_size, self.params_dtype, self.device)
            elif gpt.post_process:  # the LM head projects the real positions only (output_positions.py)
                self._output_positions.append(output_positions.OutputPositions(gpt))
                if self.section.fp32_lm_head and self.params_dtype == torch.bfloat16:
                    fp32_head.install(gpt)
            chunks.append(gpt)
        return chunks

    def _freeze_vision_tower(self) -> None:
        """No gradients for the vision tower (on the first pipeline stage); megatron's DDP and optimizer then
        leave it out. A text-only policy's tower (TEXT_ONLY_TOWERS) is never built: the caller skips it."""
        if getattr(self.family.model_class, "has_vision_tower", False) is not True:
            raise ValueError(f"freeze_vision_tower=true but {self.model_path} is a {self.family.name} model, "
                             "which has no vision tower")
        for gpt in self.gpts:
            if gpt.visual is not None:
                gpt.visual.requires_grad_(False)

    @property
    def version(self) -> int:
        """Optimizer steps done: the policy version stamped on the samples it generates."""
        return self.step_count

    # ---------------------------------------------------------------------------------------------
    # Forward

    def _micro_batches(self, batch: Batch, keys: list[str], group_size: int = 1) -> list[dict]:
        """Micro-batches of actor.packing (packing.py): one row per micro-batch (one_row, the default) of
        actor.max_tokens_per_micro_batch tokens, or at 0 of micro_batch_size x the longest sequence (attention=varlen,
        the GPU's default; padded rows with a dense mask), cut to its used length where shapes may vary (PP=1, no
        EP); or rows (packed by the token budget, or at 0 micro_batch_size padded rows). The stages of one pipeline
        hold the same sequences, so they lay out the same widths; DP ranks may differ in widths and micro-batch counts
        (gradients are reduced after the schedule, and each loss_fn's scale undoes its own rank's count). With virtual
        pipeline stages the number of micro-batches is made a multiple of PP with empty ones, as the interleaved
        schedule needs.
        Under sequence parallelism the row width is a multiple of TP (each TP rank holds a slice of the tokens),
        under context parallelism of 2 * CP (context_parallel.py's chunks), under both of their product.
        With experts split over data-parallel ranks (EP > 1) every micro-batch's token exchange spans ranks holding
        different sequences: they agree on the row width and the number of micro-batches (empty ones pad)."""
        config = self.gpt.config
        width_multiple = config.tensor_model_parallel_size if config.sequence_parallel else 1
        width_multiple *= 2 * config.context_parallel_size if config.context_parallel_size > 1 else 1
        experts = (parallel_state.get_expert_tensor_and_model_parallel_group()
                   if config.num_moe_experts and parallel_state.get_expert_model_parallel_world_size() > 1 else None)
        longest = self._agreed_max(max(sequence_lengths(batch["attention_mask"])), experts) if experts else 0
        batch = self.family.with_model_inputs(self.hf_config, batch)
        if "routed_experts" in batch and not self._replays:  # recorded, but this engine routes for itself
            batch = Batch({k: v for k, v in batch.tensors.items() if k != "routed_experts"}, batch.non_tensors,
                          batch.meta)
        if self._replays and "rollout_logprobs" in batch and "routed_experts" not in batch:
            raise ValueError("actor.router_replay=rollout, and the rollout's batch has no routed_experts: its engine "
                             "did not record the experts it routed the tokens to")
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        # one_row: pipeline stages exchange fixed-shape activations and EP ranks agree on shapes, so rows stay
        # max_tokens wide there; elsewhere each row is cut to its used length
        trim = 0 if pp > 1 or experts else math.lcm(ONE_ROW_TRIM_MULTIPLE, width_multiple)
        layout = self.section.packing
        if not self.section.max_tokens_per_micro_batch and self.core_attention != "varlen":
            # one_row's automatic width (micro_batch_size x the longest sequence) costs nothing extra where attention
            # runs per segment (varlen's cu_seqlens); a dense mask (local, sdpa, CP) is W x W, micro_batch_size
            # times the padded rows' masks in memory and compute: padded rows there
            layout = "rows"
        mbs = pack_micro_batches(batch, keys, self.device, self.section.micro_batch_size,
                                 self.section.max_tokens_per_micro_batch, group_size, width_multiple, longest,
                                 layout=layout, trim_multiple=trim)
        # the LM head at the real positions only; under CP a rank holds chunks of each row: every position there
        if self._output_positions and config.context_parallel_size == 1:
            for mb in mbs:
                mb["output_positions"] = output_positions.real_positions(mb["doc_ids"])
        if len(self.models) > 1:
            mbs += [empty_micro_batch(mbs[0]) for _ in range(-len(mbs) % pp)]
        if experts:  # counts that are multiples of PP (above) have a maximum that is one too
            mbs += [empty_micro_batch(mbs[0]) for _ in range(self._agreed_max(len(mbs), experts) - len(mbs))]
        return mbs

    def _agreed_max(self, value: int, group) -> int:
        t = torch.tensor([value], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(t.item())

    def _run_schedule(self, mbs: list[dict], loss_fn: Callable, forward_only: bool) -> list:
        """megatron's schedule over the micro-batches; the loss_fn outputs (last stage only)."""
        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            mask, packed_seq_params = packed_attention_inputs(self.core_attention, mb,
                                                              self.gpt.config.multi_latent_attention)
            images = {k: mb[k] for k in IMAGE_INPUTS if k in mb}  # a vision-language model's (packing.py)
            for selection in self._output_positions:
                selection.index = mb.get("output_positions")
            if self._replays:
                routed = mb.get("routed_experts")
                if routed is not None:
                    routed = routing_replay.router_order(
                        context_parallel.local(routed), self.gpt.config.sequence_parallel,
                        parallel_state.get_tensor_model_parallel_world_size(),
                        parallel_state.get_tensor_model_parallel_rank())
                routing_replay.set_targets(self._replays, routed)
            try:
                output = model(context_parallel.local(mb["tokens"]), context_parallel.local(mb["position_ids"]),
                               mask, packed_seq_params=packed_seq_params, **images, **self._forward_kwargs)
            finally:
                for selection in self._output_positions:
                    selection.index = None
            return output, partial(loss_fn, mb)

        # The interleaved schedule runs each chunk over every micro-batch: one iterator per chunk.
        data = [iter(mbs) for _ in self.models] if len(self.models) > 1 else iter(mbs)
        try:
            return self._forward_backward(
                forward_step_func=forward_step, data_iterator=data, model=self.models,
                num_microbatches=len(mbs), seq_length=mbs[0]["tokens"].shape[1],
                micro_batch_size=mbs[0]["tokens"].shape[0], forward_only=forward_only)
        finally:
            routing_replay.set_targets(self._replays, None)

    def aligned_logprobs(self, mb: dict, logits: torch.Tensor, with_entropy: bool):
        """Per sequence [S, T]: log p(tokens[t] | tokens[<t]) (and the entropy of that distribution), 0 at
        t=0 and padding. Under context parallelism `logits` are this CP rank's positions of the rows; with
        mb['output_positions'] the logits [1, N, V / TP] of those positions only (output_positions.py)."""
        self._require_head("lm")
        targets = output_positions.select(context_parallel.local(next_tokens(mb["tokens"])), mb)
        logprobs, entropy = vocab_parallel_logprobs(logits, targets, self.vocab_size, with_entropy,
                                                    entropy_grad=self.algorithm.entropy_coef != 0)
        return (self._per_sequence(mb, logprobs), None if entropy is None else self._per_sequence(mb, entropy))

    @staticmethod
    def _per_sequence(mb: dict, per_position: torch.Tensor) -> torch.Tensor:
        """A per-position output of the LM head ([rows, L] of this CP rank, or [1, N] at mb['output_positions'])
        -> per sequence [S, T], aligned to the tokens (align_to_tokens)."""
        rows = context_parallel.gather_rows(output_positions.to_rows(per_position, mb))
        return align_to_tokens(unpack(rows, mb), mb)

    def aligned_values(self, mb: dict, output: torch.Tensor) -> torch.Tensor:
        """Per sequence [S, T]: V(tokens[<t]), the value of the state in which token t is generated (the
        layout of log-probs and of GAE's values), 0 at t=0 and padding."""
        self._require_head("value")
        return align_to_tokens(unpack(context_parallel.gather_rows(output[..., 0].float()), mb), mb)

    def last_token_values(self, mb: dict, output: torch.Tensor) -> torch.Tensor:
        """Per sequence [S]: the value head read at the sequence's last token (a reward model's score)."""
        self._require_head("value")
        values = unpack(context_parallel.gather_rows(output[..., 0].float()), mb)
        positions = torch.arange(values.shape[1], device=values.device)
        last = (positions * (mb["attention_mask"] > 0)).max(1).values
        return values[torch.arange(len(values), device=values.device), last]

    def _require_head(self, head: str) -> None:
        if self.head != head:
            raise ValueError(f"this engine has head={self.head!r}; the call needs head={head!r} "
                             "(log-probs: 'lm'; values and rewards: 'value')")

    def _parameters(self) -> list[torch.nn.Parameter]:
        return [p for m in self.models for p in m.parameters()]

    def _set_mode(self, training: bool) -> None:
        for m in self.models:
            m.train(training)

    @contextlib.contextmanager
    def _reference_weights(self):
        if self.lora is not None:  # the base model, whose weights never change
            with self.lora.disabled():
                yield
            return
        if self._reference is None:
            raise RuntimeError("no reference policy: call snapshot_reference() first")
        params = self._parameters()
        current = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, ref in zip(params, self._reference):
                p.copy_(ref)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, cur in zip(params, current):
                    p.copy_(cur)

    def snapshot_reference(self) -> None:
        """Keep a copy of the current weights as the frozen KL reference policy (with LoRA none: the reference is
        the base, the adapters off)."""
        if self.lora is not None:
            return
        self._reference = [p.detach().clone() for p in self._parameters()]

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch, with_entropy: bool = False, reference: bool = False,
                         with_sum_pi_squared: bool = False) -> Batch:
        """'logprobs' (or 'ref_logprobs' with reference=True) and optionally 'entropy' and 'sum_pi_squared' (sum
        over the vocabulary of p^2, the optimal token baseline's), [B, T] float32, the same on every rank of the
        model-parallel group."""
        def outputs(mb, logits):
            logprobs, entropy = self.aligned_logprobs(mb, logits, with_entropy)
            out = {"logprobs": logprobs} | ({"entropy": entropy} if with_entropy else {})
            if with_sum_pi_squared:
                squares = vocab_parallel_sum_squared_probs(logits, self.vocab_size)
                out["sum_pi_squared"] = self._per_sequence(mb, squares)
            return out

        with self._reference_weights() if reference else contextlib.nullcontext():
            result = self._forward(batch, outputs)
        if reference:
            result["ref_logprobs"] = result.tensors.pop("logprobs")
        return result

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        """The critic's 'values' [B, T] float32: V(tokens[<t]) at every real position t >= 1 (GAE reads
        the response positions), the same on every rank of the model-parallel group."""
        return self._forward(batch, lambda mb, output: {"values": self.aligned_values(mb, output)})

    @torch.no_grad()
    def compute_rewards(self, batch: Batch) -> Batch:
        """A reward model's 'rewards' [B] float32: the value head at each sequence's last token."""
        return self._forward(batch, lambda mb, output: {"rewards": self.last_token_values(mb, output)})

    def _forward(self, batch: Batch, outputs: Callable[[dict, torch.Tensor], dict]) -> Batch:
        """Forward-only pass; `outputs(mb, model output)` gives per-sequence tensors ([S, T] or [S]), which
        come back in batch order on every rank."""
        self._set_mode(False)
        mbs = self._micro_batches(batch, [])

        def loss_fn(mb, output):
            return output.new_zeros(()), outputs(mb, output)

        results = self._run_schedule(mbs, loss_fn, forward_only=True)
        return Batch(self._collect(mbs, results, batch))

    def _collect(self, mbs: list[dict], results: list[dict], batch: Batch) -> dict[str, torch.Tensor]:
        """Per-micro-batch, per-sequence results -> [B, ...] in batch order, broadcast from the last stage."""
        B, T = batch["tokens"].shape
        L = mbs[0]["packed_index"].shape[1]  # the per-sequence width (packing.py)
        last_stage = parallel_state.is_pipeline_last_stage()
        names = [None]
        if last_stage:
            names = [{name: value.dim() for name, value in results[0].items()}]
        if len(self.layout.ranks) > 1:
            dist.broadcast_object_list(names, src=self.layout.ranks[-1], group=self.layout.group)
        collected = {}
        for name, dims in names[0].items():
            full = torch.zeros((B, L)[:dims], dtype=torch.float32, device=self.device)
            if last_stage:
                for mb, result in zip(mbs, results):
                    full[mb["seq_index"]] = result[name].float()
            self._broadcast_from_last_stage(full)
            if dims == 2:  # per token: back to the batch's width (L may exceed T: packing.py's width_multiple)
                collected[name] = torch.zeros(B, T, dtype=torch.float32)
                collected[name][:, :min(L, T)] = full.cpu()[:, :T]
            else:
                collected[name] = full.cpu()
        return collected

    def _broadcast_from_last_stage(self, tensor: torch.Tensor) -> None:
        if len(self.layout.ranks) > 1:
            dist.broadcast(tensor, src=self.layout.ranks[-1], group=self.layout.group)

    # ---------------------------------------------------------------------------------------------
    # Training

    def train(self, batch: Batch, loss: str = "policy", lr: float | None = None) -> dict[str, float]:
        """Optimizer steps over this DP rank's share of the batch, of the loss kind `loss` (loss_kinds.py: policy,
        value, bradley_terry, sft); metrics averaged over the steps applied, and 'skipped_updates': those skipped for
        a non-finite loss or gradient norm (skip_nonfinite_updates; the LR schedule advances all the same: it counts
        RL steps)."""
        kind = LOSS_KINDS.get(loss)()
        if not self.trainable:
            raise RuntimeError("this engine was built with trainable=False (no optimizer)")
        self._require_head(kind.head)
        missing = [key for key in kind.section_keys if not hasattr(self.section, key)]
        if missing:
            raise ValueError(f"loss={loss!r} reads {', '.join(missing)}, which this engine's section "
                             f"({type(self.section).__name__}) does not have")
        self._set_mode(True)
        reset_expert_load(self.models)
        if kind.schedule_step:
            self.scheduler.step(increment=1)
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        dp = parallel_state.get_data_parallel_world_size()
        mini = self.section.mini_batch_size // dp if self.section.mini_batch_size else len(batch)
        if mini < 1 or len(batch) % mini:
            raise ValueError(f"this DP rank's batch of {len(batch)} rows is not divisible into mini-batches of "
                             f"{mini} (actor.mini_batch_size={self.section.mini_batch_size} over DP={dp})")
        epochs = self.section.ppo_epochs if kind.repeats else 1
        updates = epochs * (len(batch) // mini)
        kind.check(batch, updates)
        step = f"RL step {self.scheduler.num_steps}, " if kind.repeats else ""
        mini_batches = [mini_batch for _ in range(epochs) for mini_batch in batch.split(mini)]
        steps = [self._optimizer_step(mini_batch, loss, kind, f"{step}update {i + 1} of {updates} of this call")
                 for i, mini_batch in enumerate(mini_batches)]
        applied = [s for s in steps if s is not None]
        metrics = ({k: sum(s[k] for s in applied) / len(applied) for k in applied[0]} if applied
                   else {"lr": self.optimizer.param_groups[0]["lr"]})
        # Per-expert load of DeepSeek's MoE layers (tokens routed in this call's training forwards), collective.
        load = expert_load_metrics(self.models, self.gpt.config)
        return metrics | {"skipped_updates": float(len(steps) - len(applied))} | load

    def _optimizer_step(self, batch: Batch, loss: str, kind: LossKind, where: str) -> dict[str, float] | None:
        """One update of the loss kind `kind` (named `loss`); None if skipped (a non-finite loss or gradient norm
        under skip_nonfinite_updates)."""
        dp_group = parallel_state.get_data_parallel_group()
        lm_tokens = batch["lm_mask"].sum().item() if "lm_mask" in batch else 0.0
        counts = torch.tensor([batch["loss_mask"].sum().item(), len(batch), lm_tokens], dtype=torch.float64,
                              device=self.device)
        dist.all_reduce(counts, group=dp_group)
        if len(batch) % kind.group_size:
            raise ValueError(f"{loss} needs {kind.groups}; this mini-batch has {len(batch)} rows")
        mbs = self._micro_batches(batch, kind.batch_keys(batch, self.algorithm), group_size=kind.group_size)
        micro_batch_loss = kind.micro_batch_loss(self, batch, Totals(*counts.tolist()))
        # Each micro-batch's loss is its share of the global mean; megatron divides it by the number of
        # micro-batches and DDP averages gradients over DP, so undo both.
        scale = len(mbs) * dist.get_world_size(dp_group)
        mb_losses = []  # this stage's micro-batch losses in order (the last stage's), checked after the schedule

        def loss_fn(mb, output):
            value, metrics = micro_batch_loss(mb, output)
            metrics = {"loss": value} | metrics
            mb_losses.append(value.detach())
            return value * scale, {k: v.detach().float().reshape(()) for k, v in metrics.items()}

        for model in self.models:
            model.zero_grad_buffer()
        self.optimizer.zero_grad()
        biases = snapshot_expert_biases(self.models)  # the schedule's finalize_model_grads moves them
        outputs = self._run_schedule(mbs, loss_fn, forward_only=False)
        found = finite.check_update(mb_losses, [g for m in self.models for g in offload.ddp_grad_buffers(m)],
                                    self.device)
        if found:
            restore_expert_biases(biases)  # the update is not applied: neither is the routing bias's move
            message = (f"{found.describe()}, in {loss} training ({where}; the engine's update "
                       f"{self.step_count + 1})")
            if not self.skip_nonfinite_updates:
                raise FloatingPointError(f"{message}: the update was not applied and the run stops (set "
                                         "trainer.skip_nonfinite_updates=true to skip such updates instead)")
            if dist.get_rank() == 0:
                print(f"megarl: skipped an optimizer update: {message}", flush=True)
            return None
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("optimizer step skipped (non-finite gradients)")
        if grad_norm is None:  # clipping disabled: megatron does not compute the norm itself
            grad_norm = self.optimizer.get_grad_norm()
        self.step_count += 1
        metrics = self._reduce_metrics(outputs)
        return metrics | {"grad_norm": float(grad_norm), "lr": self.optimizer.param_groups[0]["lr"]}

    def _reduce_metrics(self, outputs: list[dict]) -> dict[str, float]:
        """Sum the micro-batch contributions on the last stage, over DP, and share with all stages."""
        metrics = None
        if parallel_state.is_pipeline_last_stage():
            names = sorted(outputs[0])
            sums = torch.stack([sum(o[k] for o in outputs) for k in names]).double()
            dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
            metrics = dict(zip(names, sums.tolist()))
        if len(self.layout.ranks) > 1:
            box = [metrics]
            dist.broadcast_object_list(box, src=self.layout.ranks[-1], group=self.layout.group)
            metrics = box[0]
        return metrics

    # ---------------------------------------------------------------------------------------------
    # Memory between phases (offload.py)

    def _state_tensors(self) -> list[torch.Tensor]:
        kept, remade = self._offload_plan()
        return kept + remade

    def _offload_plan(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(kept: their values go to the host and back; re-made: gradient buffers, zeroed before every update,
        and bf16 weights, re-made from the optimizer's fp32 master copies after onload)."""
        params = self._parameters()
        if not self.trainable:
            return params + (self._reference or []), []
        remade = [t for m in self.models for t in offload.ddp_grad_buffers(m)]
        master_copied = {id(weight) for weight, _ in offload.master_weight_pairs(self.optimizer)}
        remade += [p for p in params if id(p) in master_copied]
        kept = [p for p in params if id(p) not in master_copied] + (self._reference or [])
        kept += [t for m in self.models for t in offload.ddp_param_buffers(m)]
        # State the optimizer keeps in host memory itself (section.optimizer_cpu_offload) stays where it is.
        kept += [t for t in offload.optimizer_tensors(self.optimizer) if t.device == self.device]
        return kept, remade

    @property
    def offloaded(self) -> bool:
        return self._offloader.active

    def offload(self) -> dict[str, int]:
        """Free the device memory of weights, gradient buffers, optimizer state and the KL reference (e.g. while
        a colocated rollout engine generates); only what cannot be re-made is copied to host memory (offload.py).
        Returns {'copied': bytes copied to the host (and back at onload), 'freed': bytes freed}. Call onload()
        before using the engine."""
        return self._offloader.offload(*self._offload_plan())

    @torch.no_grad()
    def onload(self) -> None:
        """Bring back what offload() freed: weights, optimizer state and reference exactly as before."""
        self._offloader.onload()
        if self.trainable:
            for weight, master in offload.master_weight_pairs(self.optimizer):
                weight.copy_(master)  # as the optimizer's update leaves them: the master copy rounded

    def resident_bytes(self) -> int:
        """Bytes of engine state currently allocated on its device (0 while offloaded)."""
        return offload.resident_bytes(self._state_tensors())

    # ---------------------------------------------------------------------------------------------
    # Checkpoints (megarl.engine.checkpoint): collective, every rank calls them

    def save_checkpoint(self, directory: str, weights_only: bool = False) -> None:
        """Model, optimizer, LR scheduler, RNG and the KL reference into a dist checkpoint directory."""
        checkpoint.save_engine(self, directory, weights_only=weights_only)

    def load_checkpoint(self, directory: str, optimizer: bool = True) -> dict:
        """Restore from save_checkpoint's directory, at any TP/PP/DP layout; returns its engine.json."""
        return checkpoint.load_engine(self, directory, optimizer=optimizer)

    # ---------------------------------------------------------------------------------------------
    # Weights out

    def export_hf_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of full HF-named tensors, the same on every rank; every rank must iterate to the end. With LoRA
        the adapted weights merged with their adapters."""
        return weights.export_hf_weights(self.gpts, self.weight_maps, self.layout, self.hf_tensors, self.device,
                                         bucket_bytes, local=self.lora.local_tensor if self.lora else None)
