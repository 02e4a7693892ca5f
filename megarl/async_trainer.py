"""The asynchronous modes (trainer.mode one_step_off and async): rollouts for the next steps are generated while
the trainer trains, with bounded staleness. docs/async.md tells the whole story; in short:

  rollout thread (RolloutLoop.run)               trainer (AsyncRLTrainer.step, the main thread)
    wait for admission (rollout_buffer.py)         take data.prompts_per_step groups from the buffer
    AsyncSampler.sample_batch(): generate, each    RLTrainer.train_step: log-probs, advantages, update, and
      group scored as it ends, DAPO ...
    put its groups in the buffer                   publish: pause the rollout engine, sync, resume it

The rollout thread's AsyncSampler is the synchronous loop's Sampler (megarl/sampler.py) with each group scored as it
ends, and the trainer runs the synchronous loop's train_step, so async with async.max_staleness=0 is the sync loop,
bit for bit. The rollout engine stamps every token with the policy version that produced it
(resume_generation), and pauses itself around a weight update (pause_generation: async.partial), so no lock is
held across an update. one_step_off is the deterministic special case: step t+1's batch is generated whole from
the policy one version older while step t trains, and the update to the next version waits for it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import torch

from megarl.config import Config, ConfigError
from megarl.data.inputs import read_model_config
from megarl.protocol import Batch
from megarl.recovery import Recovery
from megarl.resume import Start, plan_resume
from megarl.reshard.memory import GiB, MemorySettings, lora_fields, predict_peak
from megarl.reshard.plan import train_layout
from megarl.rewards import build_reward
from megarl.rollout_buffer import RolloutBuffer, Taken, staleness_metrics
from megarl.sampler import AsyncSampler
from megarl.trainer import RLTrainer, resolve_device
from megarl.utils.timers import Timers
from megarl.workers.group import WorkerError

ASYNC_BUFFER_FILE = "async_buffer.pt"  # the rollout buffer in a checkpoint (RolloutBuffer.state_dict)


def build_trainer(cfg: Config, start: Start | None = None) -> RLTrainer:
    """The trainer for trainer.mode; `start`: where it starts (megarl/resume.py), planned here if not given."""
    return RLTrainer(cfg, start) if cfg.trainer.mode == "sync" else AsyncRLTrainer(cfg, start)


def with_async_objective(cfg: Config) -> Config:
    """The config the training engines get: async.decoupled_ppo turns on the decoupled PPO objective
    (algorithm.rollout_correction.decoupled: the PPO ratio against the proximal policy, the weights before the
    update, times the capped weight proximal / rollout policy per token, as AReaL). auto: on from max_staleness 1
    (at 0 every sample is on-policy and the objective is the synchronous loop's), unless the algorithm already
    corrects with the rollout's log-probs (algorithm.tis, rollout_correction.rollout_is or bypass_mode: the same
    weight twice; async.decoupled_ppo=on with those is refused by validation)."""
    a, correction = cfg.async_, cfg.algorithm.rollout_correction
    corrects = cfg.algorithm.tis or correction.rollout_is != "none" or correction.bypass_mode
    if a.decoupled_ppo == "off" or (a.decoupled_ppo == "auto" and (a.max_staleness == 0 or corrects)):
        return cfg
    decoupled = dataclasses.replace(correction, decoupled=True)
    return dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, rollout_correction=decoupled))


def check_resident_memory(cfg: Config, model_config: dict, gpu_bytes: float) -> None:
    """Colocated SGLang servers stay resident beside the training engines in the asynchronous modes: their share of
    each policy GPU (rollout.sglang_mem_fraction) and the training state's peak must fit in it. The peak is the
    planner's memory model (megarl/reshard/memory.py: weights, gradients, Adam, a micro-batch's activations) at
    sequences of the response budget alone, a lower bound, so only a run that surely cannot fit is refused, with
    the numbers, before any worker starts."""
    p, r = cfg.actor.parallel, cfg.rollout
    train = train_layout(model_config, {"tp": p.tp, "pp": p.pp, "cp": p.cp, "dp": p.dp, "ep": p.ep,
                                        "etp": p.etp or p.tp}, p.pp_first_stage_layers, p.pp_last_stage_layers)
    responses = cfg.agent.max_response_tokens if cfg.agent.enabled else r.max_new_tokens
    settings = MemorySettings(seq_len=responses, micro_batch=cfg.actor.micro_batch_size, recompute=cfg.actor.recompute,
                              distributed_optimizer=cfg.actor.use_distributed_optimizer,
                              reference=cfg.algorithm.kl_coef > 0, **lora_fields(cfg.actor.lora))
    training, rollout = predict_peak(model_config, train, settings, p.cp), r.sglang_mem_fraction * gpu_bytes
    if training + rollout > gpu_bytes:
        raise ConfigError(f"trainer.mode={cfg.trainer.mode} keeps the training engines and colocated SGLang resident "
                          f"together: training needs at least {training / GiB:.1f} GiB per GPU (the planner's "
                          f"estimate) beside rollout.sglang_mem_fraction={r.sglang_mem_fraction} of "
                          f"{gpu_bytes / GiB:.0f} GiB ({rollout / GiB:.1f} GiB): lower rollout.sglang_mem_fraction, "
                          "give SGLang GPUs of its own (rollout.sglang_gpus), or use trainer.mode=sync with its "
                          "offload cycle")


class PromptSource:
    """The rollout thread's prompts: requeued ones (async.stale=regenerate) first, then the data loader's."""

    def __init__(self, data, buffer: RolloutBuffer):
        self.data, self.buffer = data, buffer

    def next_batch(self, size: int | None = None) -> list[dict]:
        size = size or self.data.batch_size
        again = self.buffer.take_requeued(size)
        return again + (self.data.next_batch(size - len(again)) if len(again) < size else [])


class RolloutLoop:
    """The rollout thread's loop: rollout batches as the buffer admits them, sampled by an AsyncSampler of its own,
    put in the buffer. It shares nothing mutable with the trainer but the buffer and the data loader, which only
    this thread draws from while the trainer runs."""

    def __init__(self, sampler: AsyncSampler, buffer: RolloutBuffer):
        self.sampler, self.buffer, cfg = sampler, buffer, sampler.cfg
        # one_step_off generates each step's batch alone, one version behind the trainer (0 or 1 there)
        self.batches_at_once = 1 if cfg.trainer.mode == "one_step_off" else cfg.async_.batches_at_once
        if self.batches_at_once != 1 and (cfg.algorithm.dynamic_sampling or cfg.agent.oversample_groups):
            # their rounds and carried groups belong to one step-batch each: the synchronous loop's, batch by batch
            print(f"async.batches_at_once={self.batches_at_once}: 1 with DAPO dynamic sampling or over-sampling, "
                  "which fill each step-batch in rounds of their own", flush=True)
            self.batches_at_once = 1

    def retire_stale_groups(self, trained_at: int) -> dict:
        """Over-sampling's unfinished groups carried into a batch trained at version `trained_at` (at the latest) are
        continued only if their oldest token would be within async.max_staleness then: the others would be dropped
        at the take after all their generation, so they are not continued; as the take does with a stale group, their
        prompts are dropped or go back first in line (async.stale=regenerate). Returns the count, a metric."""
        cfg = self.sampler.cfg
        if not cfg.agent.oversample_groups:
            return {}
        bound, kept, stale = trained_at - cfg.async_.max_staleness, [], []
        for prompt, group in self.sampler.partial_groups:  # (a conversation without a model token yet has no age)
            oldest = min((t.policy_version for t in group if any(t.loss_mask)), default=bound)
            (stale if oldest < bound else kept).append((prompt, group))
        self.sampler.partial_groups = kept
        if cfg.async_.stale == "regenerate":
            self.buffer.requeue([prompt for prompt, _ in stale])
        return {"agent/groups_stale": len(stale)}

    def run(self) -> None:
        """Rollout batches as the buffer admits them, up to async.batches_at_once of those admitted at once in one
        engine call, until it is closed."""
        sampler = self.sampler
        try:
            while (begun := self.buffer.begin_batches(self.batches_at_once)) is not None:
                numbered, sampler.version, waited = begun
                retired = self.retire_stale_groups(numbered[0][1])  # (over-sampling: one batch at a time)
                with sampler.timers("rollout"):
                    batches = sampler.sample_batches(len(numbered))
                sampler.reward_failures.end_step(numbered[-1][0])  # failing past its limit: the trainer stops
                shared = sampler.timers.pop() | retired | {
                    "async/rollout_wait_s": waited, "async/rollout_version": sampler.version,
                    "async/batches_at_once": len(numbered)}
                for (number, _), (batch, metrics) in zip(numbered, batches):  # in the order they began
                    self.buffer.put_batch(number, batch, metrics | shared | {
                        "train/reward_failures": batch.meta["reward_failures"]})
        except BaseException as error:  # noqa: B036  (raised in the trainer, at its next take)
            self.buffer.fail(error)


def merge_rollout_metrics(metrics: list[dict]) -> dict:
    """The rollout metrics of the batches a step's groups came from: a phase from its first start to its last end,
    counts (train/reward_failures) summed, everything else averaged."""
    merged = {}
    for key in dict.fromkeys(k for m in metrics for k in m):
        values = [m[key] for m in metrics if key in m]
        merged[key] = (min(values) if key.endswith("/start") else max(values) if key.endswith("/end")
                       else sum(values) if key == "train/reward_failures" else sum(values) / len(values))
    return merged


class AsyncRLTrainer(RLTrainer):
    def __init__(self, cfg: Config, start: Start | None = None):
        origin = time.perf_counter()  # phase times (phase/<name>/start|end) count from here, on both threads
        if cfg.sglang_colocated() and resolve_device(cfg) == "cuda" and cfg.model.path != "tiny":
            check_resident_memory(cfg, read_model_config(cfg.model.path), torch.cuda.mem_get_info()[1])
        # planned from the config as given: its settings, not the objective derived from them, are the run's
        super().__init__(with_async_objective(cfg), start if start is not None else plan_resume(cfg), origin)
        # the rollout thread's own sampler, reward function and timers: the trainer's evaluate meanwhile
        self.rollout_sampler = AsyncSampler(self.cfg, self.tokenizer, self.rollout, None,
                                            build_reward(self.cfg.reward, self.cfg.data.task), Timers(origin))
        self.open_buffer()
        self.rollout_thread: threading.Thread | None = None
        self.recovery = Recovery(self, settings=cfg)  # restarts planned as the run was: from the config as given

    def open_buffer(self) -> None:
        """An empty rollout buffer, and the rollout thread's prompts and loop on it."""
        a = self.cfg.async_
        self.buffer = RolloutBuffer(self.cfg.data.prompts_per_step, a.max_staleness, a.buffer_batches, a.stale,
                                    self.cfg.trainer.steps)
        self.rollout_sampler.data = PromptSource(self.data, self.buffer)
        self.rollout_loop = RolloutLoop(self.rollout_sampler, self.buffer)

    def fit(self) -> dict:
        try:
            return super().fit()
        finally:
            self.stop_rollout_thread()

    def step(self) -> dict:
        """One RL step on groups the rollout thread generated (RLTrainer.train_step does the rest)."""
        start = time.perf_counter()
        if self.rollout_thread is None:
            self.rollout_thread = threading.Thread(target=self.rollout_loop.run, name="megarl-rollout", daemon=True)
            self.rollout_thread.start()
        with self.timers("wait"):
            taken = self.buffer.take(self.version)
        batch = Batch.concat([g.batch for g in taken.groups])
        batch["group"] = [i for i, g in enumerate(taken.groups) for _ in range(len(g.batch))]  # distinct per step
        rollout = merge_rollout_metrics(list({id(g.metrics): g.metrics for g in taken.groups}.values()))
        batch.meta["reward_failures"] = rollout.pop("train/reward_failures")
        metrics = rollout | self.take_metrics(taken) | staleness_metrics(batch, self.version,
                                                                         self.cfg.async_.max_staleness)
        return self.train_step(batch, metrics, start)

    def take_metrics(self, taken: Taken) -> dict:
        return {"async/trainer_wait_s": taken.waited_s, "async/stale_dropped": taken.dropped,
                "async/stale_regenerated": taken.regenerated, "async/buffer_groups": taken.ready,
                "async/policy_version": self.version}

    def publish_policy(self) -> dict:
        """The rollout engine pauses (async.partial: in-flight generation stopped keeping its tokens, begun again,
        or finished first), the policy goes in, and generation goes on stamped with the new version."""
        if self.cfg.trainer.mode == "one_step_off" and self.rollout_thread is not None:
            with self.timers("wait_rollout"):  # the next step's batch, whole from the policy before this update
                self.buffer.wait_finished(min(self.version + 1, self.cfg.trainer.steps))
        with self.timers("pause"):
            metrics = self.rollout_call("pause_generation", self.cfg.async_.partial)
        metrics |= super().publish_policy()
        # compared while generation is paused: a request into SGLang now takes no lock a generation holds, and
        # the next update (in the next train_step) may train on what these weights generate first
        metrics |= self.check_rollout_weights()
        self.rollout_call("resume_generation", self.version)
        self.buffer.publish(self.version)
        return metrics

    def validate(self) -> dict:
        """Evaluation on the policy the trainer holds (the rollout engine holds it too, from the sync before)."""
        return super().validate() | {"val/policy_version": self.version}

    # ---- checkpoints: the buffer is saved with them (docs/async.md) -----------------------------------

    def save_checkpoint(self, step: int) -> Path:
        with self.buffer.paused_between_batches():  # the prompts drawn and the buffer agree
            return super().save_checkpoint(step)

    def save_beside(self, staging: Path) -> None:
        torch.save(self.buffer.state_dict() | {"partial_groups": self.rollout_sampler.partial_groups},
                   staging / ASYNC_BUFFER_FILE)

    def resume(self) -> int:
        """RLTrainer.resume, then the buffer as the checkpoint saved it: its groups are trained on next, those over
        async.max_staleness (a smaller bound than the saved run's) dropped or regenerated at the take. (A checkpoint
        missing the buffer it was written with is damaged by its manifest: megarl/resume.py skips it.)"""
        done = super().resume()
        path = self.start.checkpoint
        saved = path / ASYNC_BUFFER_FILE if path is not None else None
        if saved is not None and saved.exists():
            state = torch.load(saved, weights_only=False)
            self.buffer.load_state_dict(state)
            self.rollout_sampler.partial_groups = state["partial_groups"]
        else:
            self.buffer.start_at(done)
        return done

    def stop_rollout_thread(self, timeout: float = 60) -> bool:
        """Close the buffer; the rollout thread ends after the batch it is making, if any (a daemon: a run
        stopped by an error does not wait for it past `timeout`). Whether it ended."""
        self.buffer.close()
        if self.rollout_thread is not None:
            self.rollout_thread.join(timeout=timeout)
            return not self.rollout_thread.is_alive()
        return True

    # ---- in-job recovery: the rollout side (megarl/recovery.py) --------------------------------------

    def use_rollout(self, rollout) -> None:
        super().use_rollout(rollout)
        self.rollout_sampler.rollout = rollout

    def stop_generating(self, rollout_live: bool) -> None:
        """The rollout thread ended, and an empty buffer for the resume to fill from the checkpoint (the next step
        starts a new thread on it). The thread's batch in the making is finished and dropped: it drew its prompts
        from the data loader, which the resume puts back. A live rollout actor's generation is resumed first: a fault
        inside publish_policy leaves it paused, the thread's call waiting on it for good; its weights may be half
        synced, and what it generates meanwhile goes nowhere. A lost one was killed: the thread's call has ended."""
        self.buffer.close()
        if rollout_live:
            self.rollout_call("resume_generation", self.version)
        deadline = self.cfg.trainer.worker_timeout_s  # what the thread's own call waits at most
        if not self.stop_rollout_thread(timeout=deadline + 60 if deadline else None):
            raise WorkerError(f"the rollout thread did not end within {deadline + 60:g} s of the restart "
                              "(trainer.worker_timeout_s + 60): stopping")
        self.rollout_thread = None
        self.open_buffer()

    def forget_reward_failures_after(self, step: int) -> None:
        """The rollout thread's window counts rollout batches: those after the restored buffer's are scored again."""
        super().forget_reward_failures_after(step)
        self.rollout_sampler.reward_failures.forget_after(self.buffer.begun)
