"""MegatronEngine: the policy on megatron-core inside one training rank.

GPTModel (local spec) + megatron DDP + megatron's optimizer and LR scheduler; forward/backward runs
through megatron's pipeline schedule (PP=1 and PP>1 alike). Every rank of the job runs the same
calls; each DP rank passes its own share of the batch, identical across its TP/PP ranks.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from megarl.algorithms import losses
from megarl.config import ActorConfig, AlgorithmConfig
from megarl.engine import checkpoint, weights
from megarl.engine.logprobs import vocab_parallel_logprobs
from megarl.engine.micro_batches import micro_batches
from megarl.models import get_family
from megarl.protocol import Batch


def _params_dtype(precision: str, device: str) -> torch.dtype:
    if precision == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]


class MegatronEngine:
    def __init__(self, model_path: str, actor: ActorConfig, algorithm: AlgorithmConfig, device: str,
                 seed: int, total_steps: int, load_hf_weights: bool = True):
        """load_hf_weights=False: model_path needs only config.json; the weights come from a megatron
        checkpoint loaded next (load_checkpoint), e.g. in megarl.convert."""
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("MegatronEngine needs megarl.parallel.state.init_parallel() first")
        self.actor, self.algorithm, self.model_path = actor, algorithm, model_path
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
        self.hf_config = weights.read_hf_config(model_path)
        self.vocab_size = self.hf_config["vocab_size"]
        family = get_family(self.hf_config)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        self.params_dtype = _params_dtype(actor.precision, device)
        config = family.transformer_config(self.hf_config, tp, pp, self.params_dtype,
                                           use_cpu_initialization=device == "cpu",
                                           ep=parallel_state.get_expert_model_parallel_world_size())
        self.gpt = GPTModel(config, family.layer_spec(self.hf_config),
                            pre_process=parallel_state.is_pipeline_first_stage(),
                            post_process=parallel_state.is_pipeline_last_stage(),
                            **family.gpt_model_kwargs(self.hf_config, tp)).to(self.device)
        self.weight_maps = family.weight_maps(self.hf_config, tp)
        self.gpts = [self.gpt]  # the model chunks (one without virtual pipeline stages)
        self.layout = weights.PipelineLayout(self.gpt)
        if load_hf_weights:
            hf_checkpoint = weights.SafetensorsCheckpoint(model_path)
            weights.load_hf_weights(self.gpt, self.weight_maps, hf_checkpoint)
            self.hf_shapes = hf_checkpoint.shapes
        else:
            self.hf_shapes = checkpoint.hf_shapes_from_model(self.gpts, self.weight_maps, self.layout)

        # The local spec keeps norms in fp32; Float16Module casts the whole model to bf16 (as
        # Megatron's training loop does) and the outputs of the last stage back to fp32.
        module = Float16Module(config, self.gpt) if self.params_dtype == torch.bfloat16 else self.gpt
        self.model = DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                  use_distributed_optimizer=actor.use_distributed_optimizer),
            module)
        # The schedule calls these: DP grad all-reduce (+ tied-embedding grads across PP stages).
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = self.model.no_sync

        o = actor.optim
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                            adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                            clip_grad=o.clip_grad, bf16=self.params_dtype == torch.bfloat16,
                            params_dtype=self.params_dtype,
                            use_distributed_optimizer=actor.use_distributed_optimizer),
            [self.model])
        # Advanced once per policy train() call (one RL step), so warmup/decay count RL steps.
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=o.warmup_steps,
            lr_decay_steps=max(total_steps, o.warmup_steps + 1), lr_decay_style=o.decay_style,
            start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=max(total_steps, 1),
            wd_incr_style="constant")
        self._forward_backward = get_forward_backward_func()
        self._reference: list[torch.Tensor] | None = None
        self.step_count = 0

    @property
    def version(self) -> int:
        """Optimizer steps done: the policy version stamped on the samples it generates."""
        return self.step_count

    # ---------------------------------------------------------------------------------------------
    # Forward

    def _run_schedule(self, mbs: list[dict], loss_fn: Callable, forward_only: bool) -> list:
        """megatron's schedule over the micro-batches; the loss_fn outputs (last stage only)."""
        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            output = model(mb["tokens"], mb["position_ids"], mb["attn_mask"])
            return output, partial(loss_fn, mb)

        return self._forward_backward(
            forward_step_func=forward_step, data_iterator=iter(mbs), model=[self.model],
            num_microbatches=len(mbs), seq_length=mbs[0]["tokens"].shape[1],
            micro_batch_size=mbs[0]["tokens"].shape[0], forward_only=forward_only)

    def _aligned_logprobs(self, mb: dict, logits: torch.Tensor, with_entropy: bool):
        """[b, T] log p(tokens[t] | tokens[<t]) (and entropy of that distribution), 0 at t=0 and padding."""
        logprobs, entropy = vocab_parallel_logprobs(logits[:, :-1], mb["tokens"][:, 1:], self.vocab_size,
                                                    with_entropy)
        real = mb["attention_mask"][:, 1:] > 0

        def align(x):
            return None if x is None else torch.nn.functional.pad(torch.where(real, x, 0.0), (1, 0))

        return align(logprobs), align(entropy)

    @contextlib.contextmanager
    def _reference_weights(self):
        if self._reference is None:
            raise RuntimeError("no reference policy: call snapshot_reference() first")
        params = list(self.model.parameters())
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
        """Keep a copy of the current weights as the frozen KL reference policy."""
        self._reference = [p.detach().clone() for p in self.model.parameters()]

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch, with_entropy: bool = False, reference: bool = False) -> Batch:
        """'logprobs' (or 'ref_logprobs' with reference=True) and optionally 'entropy', [B, T] float32,
        the same on every rank of the model-parallel group."""
        self.model.eval()
        mbs = micro_batches(batch, [], self.actor.micro_batch_size, self.device)

        def loss_fn(mb, logits):
            logprobs, entropy = self._aligned_logprobs(mb, logits, with_entropy)
            out = {"logprobs": logprobs} | ({"entropy": entropy} if with_entropy else {})
            return logits.new_zeros(()), out

        with self._reference_weights() if reference else contextlib.nullcontext():
            outputs = self._run_schedule(mbs, loss_fn, forward_only=True)
        names = ["logprobs"] + (["entropy"] if with_entropy else [])
        B, T = batch["tokens"].shape
        rows, cols = len(mbs) * mbs[0]["tokens"].shape[0], mbs[0]["tokens"].shape[1]
        result = {}
        for name in names:
            if parallel_state.is_pipeline_last_stage():
                full = torch.cat([o[name] for o in outputs]).float()
            else:
                full = torch.empty(rows, cols, dtype=torch.float32, device=self.device)
            self._broadcast_from_last_stage(full)
            out = torch.zeros(B, T, dtype=torch.float32)
            out[:, :cols] = full[:B].cpu()
            result["ref_logprobs" if reference and name == "logprobs" else name] = out
        return Batch(result)

    def _broadcast_from_last_stage(self, tensor: torch.Tensor) -> None:
        if len(self.layout.ranks) > 1:
            dist.broadcast(tensor, src=self.layout.ranks[-1], group=self.layout.group)

    # ---------------------------------------------------------------------------------------------
    # Training

    def train(self, batch: Batch, loss: str = "policy", lr: float | None = None) -> dict[str, float]:
        """Optimizer steps over this DP rank's share of the batch; metrics averaged over the steps."""
        if loss not in ("policy", "sft"):
            raise ValueError(f"loss={loss!r}: expected 'policy' or 'sft'")
        self.model.train()
        if loss == "policy":
            self.scheduler.step(increment=1)
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        dp = parallel_state.get_data_parallel_world_size()
        mini = self.actor.mini_batch_size // dp if self.actor.mini_batch_size else len(batch)
        if mini < 1 or len(batch) % mini:
            raise ValueError(f"this DP rank's batch of {len(batch)} rows is not divisible into mini-batches of "
                             f"{mini} (actor.mini_batch_size={self.actor.mini_batch_size} over DP={dp})")
        epochs = self.actor.ppo_epochs if loss == "policy" else 1
        steps = [self._optimizer_step(mini_batch, loss) for _ in range(epochs) for mini_batch in batch.split(mini)]
        return {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}

    def _optimizer_step(self, batch: Batch, loss: str) -> dict[str, float]:
        dp_group = parallel_state.get_data_parallel_group()
        counts = torch.tensor([batch["loss_mask"].sum().item(), len(batch)], dtype=torch.float64,
                              device=self.device)
        dist.all_reduce(counts, group=dp_group)
        total_tokens, total_seqs = counts.tolist()
        keys = ["loss_mask"]
        if loss == "policy":
            keys += ["old_logprobs", "advantages"] + (["ref_logprobs"] if self.algorithm.kl_coef > 0 else [])
            if "old_logprobs" not in batch:  # the old policy's log-probs, as compute_logprobs names them
                batch = Batch(dict(batch.tensors, old_logprobs=batch["logprobs"]))
        mbs = micro_batches(batch, keys, self.actor.micro_batch_size, self.device)
        # Each loss_fn returns its micro-batch's share of the global mean; megatron divides it by the
        # number of micro-batches and DDP averages gradients over DP, so undo both.
        scale = len(mbs) * dist.get_world_size(dp_group)

        def loss_fn(mb, logits):
            logprobs, entropy = self._aligned_logprobs(mb, logits, with_entropy=loss == "policy")
            if loss == "policy":
                value, metrics = losses.actor_loss(self.algorithm, logprobs, entropy, mb, total_tokens, total_seqs)
            else:
                value, metrics = losses.sft_loss(logprobs, mb["loss_mask"], total_tokens), {}
            metrics = {"loss": value} | metrics
            return value * scale, {k: v.detach().float().reshape(()) for k, v in metrics.items()}

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run_schedule(mbs, loss_fn, forward_only=False)
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
        """Buckets of full HF-named tensors, the same on every rank; every rank must iterate to the end."""
        return weights.export_hf_weights(self.gpt, self.weight_maps, self.layout, self.hf_shapes,
                                         self.params_dtype, self.device, bucket_bytes)
