"""Reward-model training: Bradley-Terry on preference pairs, in the Megatron engine (python -m megarl.train_rm).

The model is model.path (or the built-in tiny model) with a scalar value head (zero-initialised unless the
directory has one: megarl/engine/value_head.py), trained on the ranks and layout of the reward_model section
(TP/PP/CP/DP, optimizer, micro-batches) by the engine's bradley_terry loss: -log sigmoid(r_chosen - r_rejected),
r read at each side's last token. `RMTrainer.fit` reads top to bottom like RLTrainer.fit:

  held-out pair accuracy and margin before training, every trainer.eval_every steps and after the last;
  one optimizer step per preference.pairs_per_step pairs (the LR schedule counts these steps);
  checkpoints (engine and data position) every trainer.save_every steps and after the last; trainer.resume
  continues from one exactly, as an RL run does (megarl/engine/checkpoint_dir.py).

`export` then writes the last checkpoint as a HF directory at reward_model.path, through megarl.convert: the
weights with `score.weight`, config.json as transformers' *ForSequenceClassification with one label, the
tokenizer. RL takes that directory as reward_model.path; AutoModelForSequenceClassification loads it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from megarl import stops
from megarl.config import Config, ConfigError
from megarl.config.model_layout import check_model_layout
from megarl.data.dataset import PromptLimit
from megarl.data.files import InputError
from megarl.data.inputs import load_tokenizer, model_inputs, read_model_config
from megarl.data.preferences import PreferencePair, pair_batch, preference_sets
from megarl.engine.checkpoint_dir import CheckpointError, Checkpoints, read_checkpoint_file
from megarl.protocol import Batch
from megarl.resume import run_id_of
from megarl.trainer import evaluates_after, prepare_model, resolve_device
from megarl.utils.progress import PLAIN_EVERY_S, phases
from megarl.utils.tracking import Tracker, run_dir
from megarl.workers.group import TrainGroup

ROLE = "reward_model"  # the engine's directory in a checkpoint (megarl.convert ... --role reward_model)
EXPORT_STAMP = "megarl_reward_model.json"  # in an exported directory: what train_rm wrote it from


def export_dir(cfg: Config) -> Path:
    return Path(cfg.reward_model.path or Path(cfg.trainer.output_dir) / "reward_model")


def check_rm_config(cfg: Config) -> None:
    """The model and the steps, which have no default here, and the layout against the pairs: each data-parallel
    rank takes whole pairs, each mini-batch whole pairs."""
    if not cfg.model.path:
        raise ConfigError("model.path is not set: name the model the reward model starts from (a HF directory; "
                          "tiny, the built-in tiny model, in configs/rm_quickstart.yaml)")
    if not cfg.trainer.steps:
        raise ConfigError("trainer.steps=0: set the reward model's training steps (trainer.steps=0 counts a pass "
                          "over data.task's prompts, not over preference pairs)")
    p, pairs = cfg.reward_model.parallel, cfg.preference.pairs_per_step
    if pairs % p.dp:
        raise ConfigError(f"preference.pairs_per_step={pairs} must be divisible by the reward model's data-parallel "
                          f"size {p.dp} (reward_model.parallel: world_size {p.world_size} / (tp {p.tp} * pp {p.pp} "
                          f"* cp {p.cp})): each rank trains on whole pairs")
    mini = cfg.reward_model.mini_batch_size
    if mini and (mini % (2 * p.dp) or (2 * pairs) % mini):
        raise ConfigError(f"reward_model.mini_batch_size={mini} (rows: two per pair) must divide the step's "
                          f"{2 * pairs} rows (preference.pairs_per_step={pairs}) and be a multiple of 2 x DP = "
                          f"{2 * p.dp}")
    if cfg.reward_model.micro_batch_size % 2:
        raise ConfigError(f"reward_model.micro_batch_size={cfg.reward_model.micro_batch_size} must be even (a pair's "
                          "two rows share a micro-batch)")


def pair_limit(cfg: Config, model_config: dict, where: str) -> PromptLimit | None:
    """The most tokens one side of a pair may have: preference.max_length, or the model's positions."""
    if cfg.preference.max_length:
        return PromptLimit(cfg.preference.max_length, f"preference.max_length={cfg.preference.max_length}")
    positions = model_config.get("max_position_embeddings")
    return PromptLimit(positions, f"max_position_embeddings of {where}") if isinstance(positions, int) else None


def check_export_dir(path: Path) -> None:
    """An earlier export of train_rm is replaced; anything else at reward_model.path is refused before training."""
    if path.exists() and (not path.is_dir() or (any(path.iterdir()) and not (path / EXPORT_STAMP).exists())):
        raise InputError(f"reward_model.path={path} exists and is not a reward model train_rm wrote (no "
                         f"{EXPORT_STAMP}); choose a new path")


def check_rm_inputs(cfg: Config) -> str:
    """The dry run: the layout against the model, the export path and every pair, tokenized (no weights loaded,
    nothing written). Returns a summary (a line, then the first skipped rows)."""
    tokenizer, model_config, where = model_inputs(cfg)
    check_model_layout(cfg.reward_model, "reward_model", model_config, where)
    check_export_dir(export_dir(cfg))
    sets = preference_sets(cfg, tokenizer, pair_limit(cfg, model_config, where))
    skipped = f", {len(sets.skipped)} skipped (preference.skip_malformed)" if sets.skipped else ""
    return "\n  skipped ".join([f"pairs ok: {len(sets.train)} training, {len(sets.val)} held-out{skipped}; "
                                f"the model goes to {export_dir(cfg)}", *sets.skipped[:5]])


def pair_metrics(scores: torch.Tensor, prefix: str) -> dict[str, float]:
    """Rows 2k (chosen) and 2k+1 (rejected) scored: pair accuracy (a tie counts half: a zero-initialised head
    scores 0.5, as a coin would), mean margin r_chosen - r_rejected, and the Bradley-Terry loss."""
    margin = scores[0::2] - scores[1::2]
    accuracy = ((margin > 0).float() + 0.5 * (margin == 0).float()).mean()
    return {f"{prefix}/pair_accuracy": accuracy.item(), f"{prefix}/margin": margin.mean().item(),
            f"{prefix}/loss": -torch.nn.functional.logsigmoid(margin).mean().item(),
            f"{prefix}/chosen_score": scores[0::2].mean().item(), f"{prefix}/rejected_score": scores[1::2].mean().item()}


class RMTrainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        check_rm_config(cfg)
        self.device = resolve_device(cfg)
        self.model_path = prepare_model(cfg)
        self.tokenizer = load_tokenizer(self.model_path)
        model_config, where = read_model_config(self.model_path), str(Path(self.model_path) / "config.json")
        check_model_layout(cfg.reward_model, "reward_model", model_config, where)  # before any worker starts
        self.export_dir = export_dir(cfg)
        check_export_dir(self.export_dir)
        self.data = preference_sets(cfg, self.tokenizer, pair_limit(cfg, model_config, where))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.checkpoints = Checkpoints(cfg.trainer.checkpoint_dir or Path(cfg.trainer.output_dir) / "checkpoints",
                                       cfg.trainer.keep_last)
        # the run's own log directory under the output root, its id kept by a resume (megarl/utils/tracking.py)
        resumed = self.checkpoints.resolve(cfg.trainer.resume)
        self.run_id = run_id_of(read_checkpoint_file(resumed) if resumed is not None else None)
        self.tracker = Tracker(run_dir(cfg.trainer.output_dir, self.run_id), cfg.trainer.loggers,
                               {"run_id": self.run_id} | cfg.to_dict())
        with phases(f"starting {cfg.reward_model.parallel.world_size} training rank(s) (the reward model)"):
            self.group = TrainGroup(cfg, self.model_path, self.device, cfg.trainer.steps, "reward_model_training")
        self.history = {"val/pair_accuracy": {}, "val/margin": {}}

    # ---- the loop -----------------------------------------------------------------------------------

    def fit(self) -> dict:
        """Held-out evaluation, then trainer.steps optimizer steps with evaluations and checkpoints (or the rest
        of them, resumed); returns the held-out pair accuracy and margin by step."""
        cfg = self.cfg
        done = self.resume()
        if done == 0:
            self.log({"data/train_pairs": len(self.data.train), "data/val_pairs": len(self.data.val),
                      "data/skipped_pairs": len(self.data.skipped)} | self.evaluate(), 0)
        # thousands of short steps: a console line per interval (and at each evaluation), the bar on a terminal
        with self.tracker.steps("reward model", cfg.trainer.steps, done, every_s=PLAIN_EVERY_S):
            for step in stops.steps(done + 1, cfg.trainer.steps):  # a SIGINT/SIGTERM: this step is the last
                metrics = self.step()
                if evaluates_after(step, cfg.trainer.eval_every, cfg.trainer.steps):
                    metrics |= self.evaluate()
                self.log(metrics, step)
                if step == cfg.trainer.steps or (cfg.trainer.save_every and (step % cfg.trainer.save_every == 0
                                                                             or stops.requested())):
                    self.save_checkpoint(step)  # the last one always: export reads it
        return self.history

    def step(self) -> dict:
        """One optimizer step on the next preference.pairs_per_step pairs."""
        batch = pair_batch(self.data.train.next_batch(), self.pad_id)
        start = time.perf_counter()
        trained = self.group.train(batch, loss="bradley_terry")
        seconds = time.perf_counter() - start
        tokens = batch["attention_mask"].sum().item()
        return ({f"rm/{k}": v for k, v in trained.items()}
                | {"timing/step": seconds, "perf/tokens_per_s": tokens / seconds})

    def evaluate(self) -> dict:
        with phases(f"evaluating {len(self.data.val)} held-out pairs", kind="evaluation"):
            return pair_metrics(self.score(pair_batch(self.data.val, self.pad_id)), "val")

    def score(self, batch: Batch) -> torch.Tensor:
        """The model's score of every row [B] (rows added to fill the data-parallel ranks evenly are cut)."""
        fill = -len(batch) % self.cfg.reward_model.parallel.dp
        rows = list(range(len(batch))) + [0] * fill
        return self.group.compute_rewards(batch.index(rows))["rewards"][:len(batch)]

    def score_pairs(self, pairs: list[PreferencePair]) -> torch.Tensor:
        """Scores of rows 2k (chosen) and 2k+1 (rejected) of pair k."""
        return self.score(pair_batch(pairs, self.pad_id))

    def log(self, metrics: dict, step: int) -> None:
        for name in self.history:
            if name in metrics:
                self.history[name][step] = metrics[name]
        self.tracker.log(metrics, step)

    # ---- checkpoints and export ---------------------------------------------------------------------

    def save_checkpoint(self, step: int) -> Path:
        with self.checkpoints.writing(step) as staging:  # on a full disk: a DiskSpaceError naming it
            with phases(f"writing checkpoint step {step}", kind="checkpoint write"):
                self.group.call("save_checkpoint", str(staging / ROLE))
            return self.checkpoints.commit(staging, step, {"step": step, "data": self.data.train.state_dict(),
                                                           "history": self.history, "run_id": self.run_id})

    def resume(self) -> int:
        """Load the checkpoint trainer.resume names (auto: the newest complete one, if any); returns the last step
        it completed. One without driver state (megarl.convert hf-to-megatron --role reward_model) gives initial
        weights: 0."""
        path = self.checkpoints.resolve(self.cfg.trainer.resume)
        if path is None:
            return 0
        meta = read_checkpoint_file(path)
        if ROLE not in meta["roles"]:
            raise CheckpointError(f"checkpoint {path} holds {meta['roles']}, no {ROLE} (trainer.resume)")
        self.group.call("load_checkpoint", str(path / ROLE))
        state = meta["driver"]
        if state is None:
            return 0
        self.data.train.load_state_dict(state["data"])
        self.history = {name: {int(step): v for step, v in by_step.items()}  # JSON keys are strings
                        for name, by_step in state["history"].items()}
        self.tracker.rewind(state["step"])  # the steps redone from here replace their rows, not repeat them
        print(f"resumed from {path} after step {state['step']}", flush=True)
        return state["step"]

    def export(self) -> Path:
        """The newest checkpoint as a HF directory at reward_model.path (replacing an earlier export of train_rm),
        by `python -m megarl.convert megatron-to-hf` in a process of its own (it runs a one-rank megatron job)."""
        checkpoint = self.checkpoints.latest()
        if checkpoint is None:
            raise CheckpointError(f"no checkpoint under {self.checkpoints.root} to export")
        staging = self.export_dir.with_name(f".{self.export_dir.name}.export")
        shutil.rmtree(staging, ignore_errors=True)
        self.export_dir.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "megarl.convert", "megatron-to-hf", str(checkpoint), str(staging),
                   "--role", ROLE, "--device", self.device]
        with phases(f"exporting {checkpoint} as a HF directory (megarl.convert megatron-to-hf)"):
            done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"exporting {checkpoint} failed ({' '.join(command)}):\n{done.stderr[-3000:]}")
        step = read_checkpoint_file(checkpoint)["step"]
        accuracy = self.history["val/pair_accuracy"]
        (staging / EXPORT_STAMP).write_text(json.dumps(
            {"checkpoint": str(checkpoint.resolve()), "step": step, "base_model": str(self.model_path),
             "preference_train": self.cfg.preference.train,
             "val_pair_accuracy": {str(k): v for k, v in accuracy.items()}}, indent=1) + "\n")
        check_export_dir(self.export_dir)  # still nothing but an earlier export there
        if self.export_dir.exists():
            shutil.rmtree(self.export_dir)
        staging.rename(self.export_dir)
        return self.export_dir

    def shutdown(self) -> None:
        self.tracker.close()
        self.group.shutdown()
