"""The RL loop: one driver, a handful of calls per step, each moving a Batch.

Read `RLTrainer.fit` top to bottom; everything else here is one small helper per stage.
"""

from __future__ import annotations

import time
from pathlib import Path

import ray
import torch

from megarl.algorithms.advantages import compute_advantages
from megarl.config import Config
from megarl.data.dataset import PromptDataset, sft_batch
from megarl.data.tasks import load_examples
from megarl.protocol import Batch
from megarl.rewards import get_reward_fn, score
from megarl.rollout.base import SamplingParams
from megarl.rollout.batching import generations_to_batch
from megarl.utils.timers import Timers
from megarl.utils.tracking import Tracker
from megarl.workers import weight_sync
from megarl.workers.group import TrainGroup, start_rollout


def resolve_device(cfg: Config) -> str:
    if cfg.trainer.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no GPU is visible")
    return cfg.trainer.device


def prepare_model(cfg: Config) -> str:
    """The policy's HF directory; the built-in tiny model is built offline on first use."""
    if cfg.model.path != "tiny":
        if not (Path(cfg.model.path) / "config.json").exists():
            raise FileNotFoundError(f"model.path={cfg.model.path}: no config.json there")
        return cfg.model.path
    from megarl.models.tiny import build_tiny_model
    m = cfg.model
    return str(build_tiny_model(Path(cfg.trainer.output_dir) / "tiny_model", hidden_size=m.tiny_hidden_size,
                                num_layers=m.tiny_num_layers, num_heads=m.tiny_num_heads,
                                num_kv_heads=m.tiny_num_kv_heads, tie_embeddings=m.tiny_tie_embeddings,
                                seed=cfg.trainer.seed))


class RLTrainer:
    def __init__(self, cfg: Config):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.device = resolve_device(cfg)
        self.model_path = prepare_model(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        train, val = load_examples(cfg.data, cfg.trainer.seed)
        self.data = PromptDataset(train, self.tokenizer, cfg.data.prompts_per_step, cfg.trainer.seed)
        self.sft_data = PromptDataset(train, self.tokenizer, cfg.sft.batch_size, cfg.trainer.seed + 1)
        self.val = PromptDataset(val[:cfg.data.val_size], self.tokenizer, cfg.data.val_size, 0).next_batch()
        self.reward_fn = get_reward_fn(cfg.reward.name or cfg.data.task)
        self.tracker = Tracker(cfg.trainer.output_dir, cfg.trainer.loggers, cfg.to_dict())
        self.timers = Timers()
        self.actor = TrainGroup(cfg, self.model_path, self.device, total_steps=cfg.trainer.steps)
        self.rollout = start_rollout(cfg, self.model_path, self.device)
        self.version = 0  # policy version = optimizer steps of RL taken so far

    # ---- the loop -----------------------------------------------------------------------------------

    def fit(self) -> dict:
        """Warm start, then RL steps with evaluation; returns the held-out reward by step."""
        cfg = self.cfg
        self.prepare()
        metrics = self.validate()
        self.tracker.log(metrics, 0)
        history = {"val/reward": {0: metrics["val/reward"]}}
        for step in range(1, cfg.trainer.steps + 1):
            metrics = self.step()
            if step % cfg.trainer.eval_every == 0 or step == cfg.trainer.steps:
                metrics |= self.validate()
                history["val/reward"][step] = metrics["val/reward"]
            self.tracker.log(metrics, step)
        self.tracker.close()
        return history

    def prepare(self) -> None:
        if self.cfg.sft.steps:
            self.warm_start()
        if self.cfg.algorithm.kl_coef > 0:
            self.actor.call("snapshot_reference")
        self.sync_weights()

    def step(self) -> dict:
        """One RL step: the whole algorithm, stage by stage."""
        cfg, start = self.cfg, time.perf_counter()
        with self.timers("generate"):
            batch = self.generate(self.data.next_batch())
        with self.timers("reward"):
            batch = self.score(batch)
        with self.timers("old_logprobs"):
            policy = self.actor.compute_logprobs(batch, with_entropy=True)
            batch["old_logprobs"], batch["entropy"] = policy["logprobs"], policy["entropy"]
        if cfg.algorithm.kl_coef > 0:
            with self.timers("ref_logprobs"):
                batch.update(self.actor.compute_logprobs(batch, reference=True))  # ref_logprobs
        batch = compute_advantages(batch, cfg.algorithm)
        with self.timers("train"):
            metrics = {f"train/{k}": v for k, v in self.actor.train(batch).items()}
        self.version += 1
        with self.timers("sync"):
            metrics |= self.sync_weights()
        return metrics | self.batch_metrics(batch, time.perf_counter() - start) | self.timers.pop()

    # ---- one helper per stage -----------------------------------------------------------------------

    def warm_start(self) -> None:
        """Supervised warm start on the task's reference answers, through the same engine."""
        for step in range(1, self.cfg.sft.steps + 1):
            examples = self.sft_data.next_batch()
            m = self.actor.train(sft_batch(self.tokenizer, examples), loss="sft", lr=self.cfg.sft.lr)
            if step % max(1, self.cfg.sft.steps // 5) == 0 or step == self.cfg.sft.steps:
                self.tracker.log({"sft/loss": m["loss"]}, step)

    def generate(self, prompts: list[dict], evaluation: bool = False) -> Batch:
        r = self.cfg.rollout
        params = SamplingParams(max_new_tokens=r.max_new_tokens, n=r.eval_n_samples if evaluation else r.n_samples,
                                temperature=r.eval_temperature if evaluation else r.temperature,
                                top_p=1.0 if evaluation else r.top_p,
                                # the same random draws at every evaluation: differences come from the policy
                                seed=self.cfg.trainer.seed if evaluation else None)
        gens = ray.get(self.rollout.generate.remote([p["prompt_ids"] for p in prompts], params))
        return generations_to_batch(prompts, gens, self.tokenizer.pad_token_id, self.version, self.tokenizer)

    def score(self, batch: Batch) -> Batch:
        rewards, failed = score(batch, self.reward_fn)
        batch["rewards"] = torch.tensor(rewards, dtype=torch.float32)
        batch.meta["reward_failures"] = failed
        return batch

    def sync_weights(self) -> dict:
        """Stream the trained policy into the rollout engine; verify it arrived bit for bit."""
        report = self.actor.call("push_weights", self.rollout, self.cfg.trainer.sync_bucket_mb << 20)[0]
        if self.cfg.trainer.verify_weight_sync:
            self.verify_rollout_weights(report["sent"])
        return {"sync/bytes": report["bytes"], "sync/gb_per_s": report["bytes"] / max(report["seconds"], 1e-9) / 1e9}

    def verify_rollout_weights(self, sent: dict) -> None:
        """The rollout engine digests the weights it holds; any difference from what was sent raises."""
        dtypes = {n: dtype for n, (dtype, _) in sent.items()}
        weight_sync.verify(sent, ray.get(self.rollout.weight_digests.remote(dtypes)))

    def validate(self) -> dict:
        """The held-out prompts at rollout.eval_temperature: mean reward and exact-answer rate."""
        rewards = self.score(self.generate(self.val, evaluation=True))["rewards"]
        return {"val/reward": rewards.mean().item(), "val/accuracy": (rewards >= 1.0).float().mean().item()}

    def batch_metrics(self, batch: Batch, seconds: float) -> dict:
        mask = batch["loss_mask"]
        lengths = mask.sum(1)
        tokens = batch["attention_mask"].sum().item()
        return {"train/reward": batch["rewards"].mean().item(),
                "train/entropy": ((batch["entropy"] * mask).sum() / mask.sum().clamp(min=1)).item(),
                "train/response_length": lengths.mean().item(),
                "train/reward_failures": batch.meta["reward_failures"],
                "timing/step": seconds,
                "perf/tokens_per_s": tokens / seconds}

    def shutdown(self) -> None:
        self.actor.shutdown()
        ray.kill(self.rollout)
