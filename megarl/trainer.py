"""The RL loop: one driver, a handful of calls per step, each moving a Batch.

Read `RLTrainer.fit` and `RLTrainer.train_step` top to bottom: sample (generate and score: megarl/sampler.py),
shape the rewards, log-probs and values, advantages, update, sync the policy into the rollout engine, log.
Everything else here is one small helper per stage.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from megarl import stops
from megarl.algorithms import rollout_correction
from megarl.algorithms.advantages import compute_advantages
from megarl.algorithms.dapo import overlong_reward_shaping
from megarl.algorithms.filtering import PolicyFilter
from megarl.algorithms.kl import kl_controller
from megarl.config import Config
from megarl.config.model_layout import check_model_layout, check_rollout_model
from megarl.config.run_defaults import training_device
from megarl.data.dataset import sft_batch
from megarl.data.evaluation import eval_metrics
from megarl.data.inputs import (eos_disagreement, load_tokenizer, prompt_datasets, prompt_limit,
                                 read_model_config)
from megarl.engine.checkpoint_dir import Checkpoints, read_checkpoint_file
from megarl.protocol import Batch
from megarl.recovery import Recovery
from megarl.resume import Start, checkpoint_estimate, plan_resume
from megarl.rewards import build_reward
from megarl.rewards.mixing import ScoreMixer, ends_with
from megarl.rollout.agent import agent_metrics, observation_renderer
from megarl.rollout.weight_layout import merge as merge_checksums
from megarl.sampler import Sampler
from megarl.utils.hf_config import TEXT_ONLY_TOWERS
from megarl.utils.progress import phases
from megarl.utils.timers import Timers
from megarl.utils.tracking import Tracker, run_dir
from megarl.workers import weight_sync
from megarl.workers.colocation import Colocation
from megarl.workers.group import (TrainGroup, WorkerError, call_rollout, rollout_hang_behind, start_rollout,
                                  stop_rollout)


def resolve_device(cfg: Config) -> str:
    if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no GPU is visible")
    return training_device(cfg.trainer.device)


def evaluates_after(step: int, eval_every: int, steps: int) -> bool:
    """Whether RL step `step` of `steps` ends with a held-out evaluation: every eval_every-th step and the last;
    eval_every=0: the last only (fit also evaluates before RL, always)."""
    return step == steps or (eval_every > 0 and step % eval_every == 0)


def prepare_model(cfg: Config) -> str:
    """The policy's HF directory; the built-in tiny model is built offline on first use."""
    if cfg.model.path != "tiny":
        read_model_config(cfg.model.path)  # an InputError naming a missing or unreadable config.json
        return cfg.model.path
    from megarl.models.tiny import build_tiny_model
    m = cfg.model
    return str(build_tiny_model(Path(cfg.trainer.output_dir) / "tiny_model", hidden_size=m.tiny_hidden_size,
                                num_layers=m.tiny_num_layers, num_heads=m.tiny_num_heads,
                                num_kv_heads=m.tiny_num_kv_heads, tie_embeddings=m.tiny_tie_embeddings,
                                intermediate_size=m.tiny_intermediate_size or None,
                                vocab_multiple=m.tiny_vocab_multiple,
                                seed=cfg.trainer.seed))


# over-sampling's unfinished groups (Sampler.partial_groups) in a checkpoint, continued by the resumed run
PARTIAL_GROUPS_FILE = "partial_groups.pt"
PF_PPO_FILE = "pf_ppo.pt"  # PolicyFilter.state_dict


class RLTrainer:
    def __init__(self, cfg: Config, start: Start | None = None, origin: float | None = None):
        """origin: a time.perf_counter() reading that phase times count from (the asynchronous modes: both threads'
        timers share it, megarl/utils/timers.py)."""
        self.cfg = cfg
        # the checkpoint to resume, checked and its settings compared, before any worker starts (megarl/resume.py)
        self.start = start if start is not None else plan_resume(cfg)
        self.device = resolve_device(cfg)
        self.model_path = prepare_model(cfg)
        self.tokenizer = load_tokenizer(self.model_path)
        if eos := eos_disagreement(self.model_path, self.tokenizer, cfg.rollout.engine):
            print(f"warning: {eos}", flush=True)
        # every prompt checked now (empty, unencodable, longer than the model's positions leave), its row named
        model_config, where = read_model_config(self.model_path), str(Path(self.model_path) / "config.json")
        check_model_layout(cfg.actor, "actor", model_config, where)  # a ConfigError naming the key, before workers
        check_rollout_model(cfg, model_config, where)  # SGLang cannot start from a quantized checkpoint
        limit = prompt_limit(cfg, model_config, where)
        prompts = prompt_datasets(cfg, self.tokenizer, limit)
        self.data, self.sft_data, self.val = prompts.train, prompts.sft, prompts.val
        self.renderer = observation_renderer(self.tokenizer, cfg.agent.observation_template)  # tool results
        reward_fn = build_reward(cfg.reward, cfg.data.task)  # one that does not load: a ConfigError, before workers
        self.kl_ctl = kl_controller(cfg.algorithm)  # fixed, or adaptive towards algorithm.kl_target
        # PF-PPO: the batch filtered by reward before the update (algorithm.pf_ppo)
        pf_ppo = cfg.algorithm.pf_ppo
        self.policy_filter = PolicyFilter(pf_ppo, cfg.trainer.seed) if pf_ppo.method != "none" else None
        # the run's own log directory under the output root, its id kept by a resume (megarl/utils/tracking.py)
        self.tracker = Tracker(run_dir(cfg.trainer.output_dir, self.start.run_id), cfg.trainer.loggers,
                               {"run_id": self.start.run_id} | cfg.to_dict())
        self.timers = Timers(origin, on_start=self.tracker.stage)
        self.start_training()
        self.score_mixer = ScoreMixer.from_config(cfg.reward_model)  # its scores normalised, mixed with the rule's
        # colocated SGLang servers go on the policy's GPUs; disaggregated ones on GPUs of their own
        with phases(f"starting the rollout engine ({cfg.rollout.engine})"):
            self.rollout = start_rollout(cfg, self.model_path, self.device,
                                         self.actor.gpus() if cfg.sglang_colocated() else None)
        self.colocation = self.colocate()
        # a step's prompts generated, scored and assembled into its Batch (evaluation's too): megarl/sampler.py
        self.sampler = Sampler(cfg, self.tokenizer, self.rollout, self.data, reward_fn, self.timers)
        self.version = 0  # policy version = optimizer steps of RL taken so far
        self.syncs = 0  # weight syncs done (trainer.verify_weight_sync_every counts them)
        self.rollout_buffers = None  # the rollout engine's non-weight buffers' checksums at the first verification
        # the parameters no sync sends (a text-only policy's vision tower): verified unchanged, as buffers are
        self.kept_weights = TEXT_ONLY_TOWERS.get(model_config.get("model_type"), ())
        self.unchecked = None  # the last verified sync's expected checksums, until check_rollout_weights compares
        self.history = {"val/reward": {}}  # held-out reward by step
        self.checkpoints = Checkpoints(cfg.trainer.checkpoint_dir or Path(cfg.trainer.output_dir) / "checkpoints",
                                       cfg.trainer.keep_last, cfg.trainer.verify_checkpoint,
                                       checkpoint_estimate(cfg, model_config, self.device))
        self.recovery = Recovery(self)  # a lost rank or rollout actor replaced in the job (trainer.max_restarts)

    def start_training(self) -> None:
        """The training ranks: the policy's; PPO's critic (for GAE) and a reward model, each on its own ranks, layout
        and optimizer (the critic's LR schedule also counts VAPO's value-pretraining steps,
        algorithm.gae.critic_warmup_steps)."""
        cfg = self.cfg
        with phases(f"starting {cfg.actor.parallel.world_size} training rank(s) (the policy's model)"):
            self.actor = TrainGroup(cfg, self.model_path, self.device, total_steps=cfg.trainer.steps)
        critic_steps = cfg.trainer.steps + cfg.algorithm.gae.critic_warmup_steps
        self.critic = (TrainGroup(cfg, cfg.critic.path or self.model_path, self.device, critic_steps, "critic")
                       if cfg.algorithm.advantage == "gae" else None)
        self.reward_model = (TrainGroup(cfg, cfg.reward_model.path, self.device, cfg.trainer.steps, "reward_model")
                             if cfg.reward_model.path else None)

    def use_rollout(self, rollout) -> None:
        """A new rollout actor (megarl/recovery.py): the samplers call it, its engine's buffers are checked afresh."""
        self.rollout, self.sampler.rollout, self.rollout_buffers = rollout, rollout, None

    def stop_generating(self, rollout_live: bool) -> None:
        """Before a restart restores a checkpoint (megarl/recovery.py), nothing draws prompts or generates beside it:
        the synchronous loop generates inside its steps alone. rollout_live: the rollout actor stays up."""

    def forget_reward_failures_after(self, step: int) -> None:
        """A restart from step `step`'s checkpoint scores the steps after it again: their calls leave the window."""
        self.sampler.reward_failures.forget_after(step)

    def colocate(self) -> Colocation:
        """Which of the training engines and the rollout engine holds the device memory (workers/colocation.py)."""
        return Colocation([g for g in (self.actor, self.critic, self.reward_model) if g is not None], self.rollout,
                          self.cfg.offload_enabled(self.device), self.cfg.trainer.worker_timeout_s)

    # ---- the loop -----------------------------------------------------------------------------------

    def fit(self) -> dict:
        """Warm start (or resume), then RL steps with evaluation and checkpoints; returns the held-out
        reward by step."""
        cfg = self.cfg
        done = self.resume()
        if done == 0:
            self.prepare()
            metrics = self.validate()
            self.tracker.log(metrics, 0)
            self.history["val/reward"][0] = metrics["val/reward"]
        with self.tracker.steps("RL", cfg.trainer.steps, done):  # the step lines say step N/T and the ETA
            # stops.steps's: a SIGINT/SIGTERM makes this step the last; a lost process (megarl/recovery.py) is
            # replaced and the steps after the newest checkpoint run again
            for step in self.recovery.steps(done + 1, cfg.trainer.steps):
                with self.recovery.attempt(step):
                    metrics = self.step()
                    if evaluates_after(step, cfg.trainer.eval_every, cfg.trainer.steps):
                        metrics |= self.validate()
                        self.history["val/reward"][step] = metrics["val/reward"]
                    self.tracker.log(metrics, step)
                    if cfg.trainer.save_every and (step % cfg.trainer.save_every == 0 or step == cfg.trainer.steps
                                                   or stops.requested()):
                        self.save_checkpoint(step)
        self.check_rollout_weights()  # the last sync's: no update follows, but a corrupt engine still stops the run
        if cfg.actor.lora.peft_dir:
            self.colocation.to_training()  # the adapters back where they were offloaded
            self.actor.call("save_peft", cfg.actor.lora.peft_dir)
        self.tracker.close()
        return self.history

    def prepare(self) -> None:
        if self.cfg.sft.steps:
            self.warm_start()
        if self.cfg.algorithm.kl_coef > 0:
            self.actor.call("snapshot_reference")
        self.publish_policy()
        self.timers.pop()  # the warm-started policy's sync is no step's
        if warmup := self.cfg.algorithm.gae.critic_warmup_steps:
            with self.tracker.steps("critic warm-up", warmup, label="critic warm-up"):
                for step in range(1, warmup + 1):
                    self.tracker.log(self.warm_up_critic(), step)

    def step(self) -> dict:
        """One RL step: the whole algorithm, stage by stage."""
        cfg, start = self.cfg, time.perf_counter()
        if cfg.rollout.replay_dir:  # a dumped run's samples: no generation
            batch, metrics = self.load_dump(Path(cfg.rollout.replay_dir) / f"step_{self.version + 1:06d}.pt")
        else:  # generate and score (DAPO dynamic sampling, over-sampling, ReMax baseline)
            batch, metrics = self.sampler.sample_batch()
            if cfg.rollout.dump_dir:
                self.dump(batch, metrics, Path(cfg.rollout.dump_dir) / f"step_{self.version + 1:06d}.pt")
            self.sampler.reward_failures.end_step(self.version + 1)  # failing past its limit: stop, do not train
        return self.train_step(batch, metrics, start)

    def train_step(self, batch: Batch, metrics: dict, start: float, train_policy: bool = True) -> dict:
        """The step's stages after sampling, up to the new policy in the rollout engine (the asynchronous modes
        run them on batches their rollout thread generated: megarl/async_trainer.py). train_policy=False: the
        critic alone learns (VAPO's value pretraining, warm_up_critic)."""
        metrics |= self.check_rollout_weights()  # before the weights' memory is released and before any update
        with self.timers("onload"):
            metrics |= self.colocation.to_training()  # the rollout engine releases its memory, Megatron's is back
        metrics |= self.shape_rewards(batch)
        metrics |= self.logprobs_and_values(batch)
        batch = compute_advantages(batch, dataclasses.replace(self.cfg.algorithm, kl_coef=self.kl_ctl.value))
        metrics |= self.update(batch, train_policy)
        if train_policy:
            metrics |= self.update_kl_coef(batch, metrics)
            self.version += 1
        metrics |= self.publish_policy()  # unchanged weights too: a colocated engine released its copy
        return metrics | self.batch_metrics(batch, time.perf_counter() - start) | self.timers.pop()

    def shape_rewards(self, batch: Batch) -> dict:
        """The rewards the advantages see: the reward model's score mixed with the rule reward (which is logged),
        DAPO's overlong penalty added."""
        metrics, a = {}, self.cfg.algorithm
        if self.reward_model is not None:
            with self.timers("reward_model"):
                scores = self.reward_model.compute_rewards(batch)["rewards"]
                ended = ends_with(batch, self.tokenizer.eos_token_id)  # unfinished responses: missing_eos_penalty
                batch["rewards"], mixed = self.score_mixer(scores, batch["rewards"], batch["group"], ended)
                metrics |= mixed
        if a.overlong_buffer.len:
            penalty = overlong_reward_shaping(batch["loss_mask"].sum(1), self.cfg.rollout.max_new_tokens,
                                              a.overlong_buffer.len, a.overlong_buffer.penalty_factor)
            batch["rewards"] = batch["rewards"] + penalty
            metrics["train/overlong_penalty"] = penalty.mean().item()
        return metrics

    def logprobs_and_values(self, batch: Batch) -> dict:
        """The forward passes the advantages and the loss need, into `batch`: the old policy's log-probs (with the
        rollout correction's weights), the reference's, the critic's values."""
        cfg, metrics = self.cfg, {}
        a = cfg.algorithm
        correction = a.rollout_correction  # megarl/algorithms/rollout_correction.py
        if correction.bypass_mode:  # the rollout engine's log-probs are the old ones
            batch["old_logprobs"] = batch["rollout_logprobs"]
        if cfg.recompute_old_logprobs():  # else the update's own forward gives them (algorithm.recompute_old_logprobs)
            with self.timers("old_logprobs"):
                otb = a.advantage == "optimal_token_baseline"  # its baseline weighs by sum_v p(v)^2 per token
                old = self.actor.compute_logprobs(batch, with_sum_pi_squared=otb)
                batch["old_logprobs"] = old["logprobs"]
                if otb:
                    batch["sum_pi_squared"] = old["sum_pi_squared"]
                # how far the rollout engine's log-probs are from Megatron's on the same tokens
                real = batch["loss_mask"] > 0
                metrics["rollout/logprob_abs_diff"] = (batch["old_logprobs"] - batch["rollout_logprobs"])[real].abs().mean().item()
                # the mismatch metrics; importance weights and rejection when configured (before the advantages)
                metrics |= rollout_correction.apply_rollout_correction(batch, correction)
        if a.kl_coef > 0:
            with self.timers("ref_logprobs"):
                batch.update(self.actor.compute_logprobs(batch, reference=True))  # ref_logprobs
        if self.critic is not None:
            with self.timers("values"):
                batch.update(self.critic.compute_values(batch))  # values, GAE's baseline
        return metrics

    def update(self, batch: Batch, train_policy: bool) -> dict:
        """The critic's update on the returns GAE left in the batch, then the policy's (train_policy), on the batch
        PF-PPO's filter keeps (algorithm.pf_ppo)."""
        batch, metrics = self.policy_filter(batch) if self.policy_filter is not None else (batch, {})
        with self.timers("train"):
            if self.critic is not None:
                metrics |= {f"critic/{k}": v for k, v in self.critic.train(batch, loss="value").items()}
            if train_policy:
                trained = self.actor.train(batch)
                # rank 0's update in its engine, and the call's way there (timing/train minus both: the way back)
                metrics["perf/engine_update_s"] = trained.pop("engine_seconds")
                metrics["perf/update_dispatch_s"] = trained.pop("dispatch_seconds")
                if "rollout_logprob_abs_diff" in trained:  # measured by the update's forward
                    metrics["rollout/logprob_abs_diff"] = trained.pop("rollout_logprob_abs_diff")
                metrics |= {k: trained.pop(k) for k in list(trained) if k.startswith(rollout_correction.PREFIX)}
                metrics |= {f"train/{k}": v for k, v in trained.items()}
        return metrics

    # ---- checkpoints (megarl.engine.checkpoint_dir) --------------------------------------------------

    def trained_groups(self) -> dict[str, TrainGroup]:
        """The engines a checkpoint holds (the reward model is frozen: it reloads from its own path)."""
        return {"actor": self.actor} | ({"critic": self.critic} if self.critic is not None else {})

    def save_checkpoint(self, step: int) -> Path:
        """Every engine, then the driver's state, committed atomically as checkpoint `step` (on a full disk: a
        DiskSpaceError naming it, the previous checkpoint intact)."""
        with self.checkpoints.writing(step) as staging:
            with phases(f"writing checkpoint step {step}", kind="checkpoint write"):
                for role, group in self.trained_groups().items():
                    group.call("save_checkpoint", str(staging / role))
            state = {"step": step, "version": self.version, "data": self.data.state_dict(),
                     "sft_data": self.sft_data.state_dict(), "kl_ctl": self.kl_ctl.state_dict(),
                     "history": self.history, "syncs": self.syncs, "score_mixer": self.score_mixer.state_dict(),
                     "run_id": self.start.run_id}
            if self.sampler.partial_groups:  # pickled beside: prompt records may hold any field a dataset file had
                torch.save(self.sampler.partial_groups, staging / PARTIAL_GROUPS_FILE)
            if self.policy_filter is not None:  # PF-PPO's random state and replayed samples
                torch.save(self.policy_filter.state_dict(), staging / PF_PPO_FILE)
            self.save_beside(staging)
            return self.checkpoints.commit(staging, step, state, self.start.config)

    def save_beside(self, staging: Path) -> None:
        """Driver state of a subclass's own into a checkpoint's staging directory (the asynchronous modes' rollout
        buffer: megarl/async_trainer.py); the synchronous loop has none."""

    def resume(self) -> int:
        """Load the checkpoint this run starts from (megarl/resume.py: trainer.resume, checked) into the
        engines and the driver, and the rollout engine's weights; returns the last step it completed.
        A checkpoint without driver state (megarl.convert hf-to-megatron) gives initial weights: 0."""
        path = self.start.checkpoint
        if path is None:
            return 0
        meta = read_checkpoint_file(path)
        groups = self.trained_groups()
        missing = sorted(set(groups) - set(meta["roles"]))
        if missing and meta["driver"] is not None:
            raise FileNotFoundError(f"checkpoint {path} holds {meta['roles']}, this run also trains {missing}")
        with phases(f"loading checkpoint {path}"):
            for role in set(groups) & set(meta["roles"]):
                groups[role].call("load_checkpoint", str(path / role))
        state = meta["driver"]
        if state is None:
            return 0
        self.version = state["version"]
        self.data.load_state_dict(state["data"])
        self.sft_data.load_state_dict(state["sft_data"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        if "score_mixer" in state:  # (absent from checkpoints written before reward-model normalisation)
            self.score_mixer.load_state_dict(state["score_mixer"])
        if self.cfg.algorithm.kl_coef > 0 and not self.cfg.algorithm.kl_in_reward:
            self.actor.call("set_kl_coef", self.kl_ctl.value)
        self.history = {name: {int(step): v for step, v in by_step.items()}  # JSON keys are strings
                        for name, by_step in state["history"].items()}
        partial = path / PARTIAL_GROUPS_FILE
        self.sampler.partial_groups = torch.load(partial, weights_only=False) if partial.exists() else []
        if self.policy_filter is not None and (path / PF_PPO_FILE).exists():
            self.policy_filter.load_state_dict(torch.load(path / PF_PPO_FILE, weights_only=False))
        self.publish_policy()  # verified: the first sync of this process
        # then the count the run stopped at, so that the next verified syncs are the uninterrupted run's
        self.syncs = state.get("syncs", self.syncs)  # (absent from checkpoints written before it was kept)
        self.timers.pop()  # the resumed policy's sync is no step's
        self.tracker.rewind(state["step"])  # the steps redone from here replace their rows, not repeat them
        print(f"resumed from {path} after step {state['step']}", flush=True)
        return state["step"]

    # ---- one helper per stage -----------------------------------------------------------------------

    def warm_start(self) -> None:
        """Supervised warm start on the task's reference answers, through the same engine."""
        total = self.cfg.sft.steps
        with self.tracker.steps("SFT warm start", total, label="sft") as bar:
            for step in range(1, total + 1):
                examples = self.sft_data.next_batch()
                m = self.actor.train(sft_batch(self.tokenizer, examples, self.renderer), loss="sft", lr=self.cfg.sft.lr)
                bar.set(step)
                if step % max(1, total // 5) == 0 or step == total:
                    self.tracker.log({f"sft/{k}": m[k] for k in ("loss", "skipped_updates") if k in m}, step)

    def warm_up_critic(self) -> dict:
        """One step of VAPO's value pretraining (algorithm.gae.critic_warmup_steps, before RL): samples from the
        policy as it is, the critic trained on their returns (algorithm.gae.critic_lam), the policy left alone.
        Metrics critic_warmup/*: the critic's, and the samples' mean reward."""
        batch, metrics = self.sampler.sample_batch()
        self.sampler.reward_failures.end_step(0)
        metrics = self.train_step(batch, metrics, time.perf_counter(), train_policy=False)
        kept = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("critic/")}
        return {f"critic_warmup/{k}": v for k, v in kept.items()} | {"critic_warmup/reward": metrics["train/reward"]}

    def dump(self, batch: Batch, metrics: dict, path: Path) -> None:
        """A step's scored samples (every tensor, and the trajectories' turns, tool calls and results), for
        rollout.replay_dir and for reading."""
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"tensors": batch.tensors, "non_tensors": batch.non_tensors, "meta": batch.meta,
                    "metrics": metrics, "policy_version": self.version}, path)

    def load_dump(self, path: Path) -> tuple[Batch, dict]:
        if not path.exists():
            raise FileNotFoundError(f"rollout.replay_dir: no dump {path} for step {self.version + 1}")
        saved = torch.load(path, weights_only=False)
        return Batch(saved["tensors"], saved["non_tensors"], saved["meta"]), saved["metrics"]

    def update_kl_coef(self, batch: Batch, metrics: dict) -> dict:
        """Feed this step's KL to the controller; an adaptive one moves the coefficient towards kl_target."""
        a = self.cfg.algorithm
        if a.kl_coef <= 0:
            return {}
        used = self.kl_ctl.value
        kl = batch.meta.get("reward_kl") if a.kl_in_reward else metrics.get("train/kl")
        if kl is not None:
            self.kl_ctl.update(kl, len(batch))
        if self.kl_ctl.value != used and not a.kl_in_reward:  # the loss's KL term takes it from the next step
            self.actor.call("set_kl_coef", self.kl_ctl.value)
        return {"algorithm/kl_coef": used} | ({"algorithm/kl": kl} if kl is not None else {})

    def rollout_call(self, method: str, *args):
        """A call on the rollout actor, with the deadline every wait on a worker has (trainer.worker_timeout_s)."""
        return call_rollout(self.rollout, method, *args, timeout=self.cfg.trainer.worker_timeout_s)

    def publish_policy(self) -> dict:
        """Training done: the policy into the rollout engine, verified; then, colocated, the training engines
        step aside for the rollout phase (workers/colocation.py)."""
        metrics = self.colocation.memory("trained")
        with self.timers("sync"):  # a released rollout engine takes its weights memory back first
            metrics |= self.sync_weights() | self.colocation.memory("synced")
        self.sampler.version = self.version  # what the engine generates next is this policy's
        with self.timers("offload"):
            return metrics | self.colocation.to_rollout()

    def sync_weights(self) -> dict:
        """Stream the trained policy through the resharder into the rollout engine (whole HF tensors, or each
        generation TP rank's rows: rollout.weight_delivery); on the first sync and every
        trainer.verify_weight_sync_every-th after it, verify it arrived bit for bit."""
        every = self.cfg.trainer.verify_weight_sync_every
        verify, self.syncs = every > 0 and self.syncs % every == 0, self.syncs + 1
        verify = verify and not (self.cfg.actor.lora.rank and self.cfg.rollout.lora_sync == "adapter")  # no checksums
        deep = self.cfg.trainer.verify_weight_sync_deep
        try:
            ranks = self.actor.call("push_weights", self.rollout, self.cfg.trainer.sync_bucket_mb << 20, verify, deep)
        except WorkerError as error:  # the ranks wait on the rollout actor: a hang of it is named as such
            hang = rollout_hang_behind(error, self.rollout, "push_weights", "receiving their weights")
            if hang is None:
                raise
            raise hang from None
        reports = [r.report for r in ranks if r.report is not None]  # the senders'
        start = time.perf_counter()
        if verify and deep:
            self.verify_rollout_weights(reports)
        elif verify:  # compared before the first update on samples these weights generate (check_rollout_weights)
            self.unchecked = merge_checksums([r.expected for r in reports])
        # bytes: the weights as sent (bf16 on GPU); seconds: the slowest sender, begin to end, without verification
        nbytes = sum(r.bytes for r in reports)
        slowest = max(reports, key=lambda r: r.seconds - r.digest_s)
        seconds = slowest.seconds - slowest.digest_s
        split = {f"sync/{k}": v for k, v in slowest.phases().items()}
        return split | {"sync/bytes": nbytes, "sync/seconds": seconds, "sync/gb_per_s": nbytes / max(seconds, 1e-9) / 1e9,
                        "sync/direct": float(slowest.direct), "sync/verified": float(verify),
                        "sync/verify_s": slowest.digest_s + time.perf_counter() - start} | \
            weight_sync.traffic_metrics([r.traffic for r in ranks])

    def check_rollout_weights(self) -> dict:
        """The default verification's second half: the rollout engine's checksums of every parameter it holds, taken
        where it holds them (SGLang: by its TP workers, now, off the sync's path), against
        what the senders computed from what they sent; any difference raises, naming the parameter. Called after a
        verified sync's rollouts and before anything trains on them (and before the engine releases its weights'
        memory): a corrupt sync can cost one generation, never an update. {} when nothing awaits comparison, else
        the collection's seconds (sync/verify_deferred_s)."""
        if self.unchecked is None:
            return {}
        start, expected, self.unchecked = time.perf_counter(), self.unchecked, None
        self.rollout_buffers = weight_sync.verify_checksums(expected, self.rollout_call("weight_checksums"),
                                                            self.rollout_buffers, self.kept_weights)
        return {"sync/verify_deferred_s": time.perf_counter() - start}

    def verify_rollout_weights(self, reports: list[weight_sync.SyncReport]) -> None:
        """The deep check, at once: digests of the weights SGLang reloaded from a file against the senders'."""
        sent = {key: d for r in reports for key, d in r.sent.items()}
        dtypes = {key: dtype for key, (dtype, _) in sent.items()}
        weight_sync.verify(sent, self.rollout_call("weight_digests", dtypes))

    def validate(self) -> dict:
        """The held-out prompts, rollout.eval_n_samples = k each at rollout.eval_temperature: mean reward,
        exact-answer rate, mean@k and pass@k (megarl/data/evaluation.py)."""
        k = self.cfg.rollout.eval_n_samples
        with phases(f"evaluating {len(self.val)} held-out prompts x {k} samples", kind="evaluation"):
            batch = self.sampler.evaluate(self.val)
        if self.cfg.rollout.dump_dir:
            self.dump(batch, {}, Path(self.cfg.rollout.dump_dir) / f"val_{self.version:06d}.pt")
        failures = self.sampler.val_reward_failures.end_step(self.version)  # past reward.max_failure_rate: stop
        return (eval_metrics(batch["rewards"], batch["group"]) | agent_metrics(batch, "val")
                | {"val/reward_failures": failures})

    def batch_metrics(self, batch: Batch, seconds: float) -> dict:
        mask = batch["loss_mask"]
        lengths = mask.sum(1)
        tokens = batch["attention_mask"].sum().item()
        # NeMo-RL's count: every token of the step over every GPU the run holds (colocated servers: the policy's)
        gpus = self.cfg.actor.parallel.world_size + self.cfg.rollout.sglang_gpus
        return {"train/reward": batch["rewards"].mean().item(),
                "train/response_length": lengths.mean().item(),
                "train/reward_failures": batch.meta["reward_failures"],
                "timing/step": seconds,
                "perf/tokens_per_s": tokens / seconds,
                "perf/tokens_per_s_per_gpu": tokens / seconds / gpus} | agent_metrics(batch, "agent")

    def shutdown(self) -> None:
        self.actor.shutdown()
        for group in (self.critic, self.reward_model):
            if group is not None:
                group.shutdown()
        stop_rollout(self.rollout)
