"""Where a run starts, decided before any worker starts: the checkpoint trainer.resume names, checked against its
manifest (a damaged one gives way to the previous complete one) and against this run's training settings.

  trainer.resume=auto    the newest intact checkpoint in the checkpoint directory, if its run had this run's
                         settings (megarl/config/fingerprint.py); other settings are refused, naming each key
  trainer.resume=force   the same checkpoint, resumed with the changed settings (named in a warning)
  trainer.resume=<path>  that checkpoint (or the newest intact one under that directory): chosen by hand, so
                         changed settings are named in a warning, not refused
  trainer.resume=none    from scratch

A fresh run gets a new run id, a resumed one keeps its checkpoint's (`run_id_of`): the id names the directory the
run logs into, <trainer.output_dir>/logs/<run id>/ (megarl/utils/tracking.py).

`python -m megarl.train` also holds the output directory's lock (megarl/utils/run_lock.py) for the whole run, and
ends at once, successfully, when the checkpoint already completed trainer.steps.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megarl.config import Config, ConfigError
from megarl.config.fingerprint import differences, fingerprint
from megarl.engine.checkpoint_dir import CheckpointError, Checkpoints, checkpoint_damage, read_checkpoint_file
from megarl.utils.run_lock import RunLock
from megarl.utils.tracking import new_run_id


@dataclasses.dataclass(frozen=True)
class Start:
    config: dict  # this run's training settings (fingerprint): each checkpoint it writes stores them
    checkpoint: Path | None  # the checkpoint it resumes, checked; None: from scratch
    step: int  # the RL step that checkpoint completed (0 also for initial weights, which have no driver state)
    run_id: str  # the run's id: its checkpoint's, or a new one (megarl/utils/tracking.py: where the run logs)

    def nothing_to_train(self, steps: int) -> str | None:
        """Why the run would train no step (its checkpoint is at or past trainer.steps), or None."""
        if self.checkpoint is None or self.step < steps:
            return None
        return (f"{self.checkpoint} completed step {self.step}, and trainer.steps={steps}: nothing to train. Raise "
                "trainer.steps to train further, or give a new run its own trainer.output_dir")


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.trainer.checkpoint_dir or Path(cfg.trainer.output_dir) / "checkpoints")


def claim_run(cfg: Config) -> tuple[RunLock, Start]:
    """The lock of the run's output directory (and of its checkpoint directory, where that is elsewhere), held, and
    where the run starts; a refused plan releases the lock again."""
    output, root = Path(cfg.trainer.output_dir).resolve(), checkpoint_root(cfg).resolve()
    lock = RunLock([output] + ([root] if not root.is_relative_to(output) else [])).acquire()
    try:
        return lock, plan_resume(cfg)
    except BaseException:
        lock.release()
        raise


def plan_resume(cfg: Config) -> Start:
    """The checkpoint this run resumes (see the module's docstring), with warnings for what is skipped or cannot be
    checked. Raises CheckpointError when every candidate is damaged, ConfigError when settings differ under auto."""
    config, resume = fingerprint(cfg), cfg.trainer.resume
    damaged, chosen = [], None
    for path in Checkpoints(checkpoint_root(cfg)).candidates(resume):
        problems = checkpoint_damage(path, cfg.trainer.verify_checkpoint)
        if problems:
            damaged.append(f"{path}: " + "; ".join(problems))
            continue
        if problems is None:
            print(f"warning: {path} was written without a manifest (by an older megarl): its files are not checked",
                  flush=True)
        chosen = path
        break
    if chosen is None and damaged:
        raise CheckpointError(f"no intact checkpoint to resume (trainer.resume={resume}):\n  " + "\n  ".join(damaged)
                              + "\nMove the damaged checkpoints out of the way to start from scratch, or give this "
                                "run a new trainer.output_dir")
    if damaged:
        print("warning: damaged checkpoint(s) skipped:\n  " + "\n  ".join(damaged)
              + f"\n  resuming from the previous complete one, {chosen}", flush=True)
    if chosen is None:
        return Start(config, None, 0, new_run_id())
    meta = read_checkpoint_file(chosen)
    if meta["driver"] is None:  # initial weights (megarl.convert hf-to-megatron): no run to compare with
        return Start(config, chosen, 0, new_run_id())
    check_settings(chosen, meta.get("config"), config, resume)
    return Start(config, chosen, meta["step"], run_id_of(meta))


def run_id_of(meta: dict | None) -> str:
    """The run id a checkpoint's metadata (read_checkpoint_file) keeps in its driver state; a new id for no
    checkpoint, initial weights, or a checkpoint written before checkpoints kept one (its run's earlier logs stay
    where they were)."""
    state = (meta or {}).get("driver") or {}
    return state.get("run_id") or new_run_id()


def check_settings(checkpoint: Path, saved: dict | None, config: dict, resume: str) -> None:
    """Refuse (ConfigError) a checkpoint whose run had other training settings under trainer.resume=auto; warn
    under force or a path; warn that a checkpoint without stored settings cannot be compared."""
    if saved is None:
        print(f"warning: {checkpoint} was written before checkpoints kept their run's settings: they cannot be "
              "compared with this run's", flush=True)
        return
    changed = differences(saved, config)
    if not changed:
        return
    listed = "\n  ".join(changed)
    if resume == "auto":
        raise ConfigError(f"{checkpoint} was written by a run with other settings:\n  {listed}\nResuming would "
                          "continue that run with these changes. Either give this run a new trainer.output_dir (and "
                          "trainer.checkpoint_dir), or resume with the changes: trainer.resume=force")
    print(f"warning: resuming {checkpoint} with changed settings (trainer.resume={resume}):\n  {listed}", flush=True)


def checkpoint_estimate(cfg: Config, model_config: dict, device: str) -> int:
    """The bytes a run's first checkpoint takes, about: each trained engine's weights (bf16 on a GPU unless
    actor.precision says otherwise, else fp32) and Adam's state (two fp32 moments, and an fp32 master copy of bf16
    weights), and the KL reference's weights; 0 for a model the inventory does not know (no check before the first
    save). Later saves are checked against the size of the checkpoint before them (Checkpoints.stage)."""
    from megarl.reshard.inventory import hf_inventory

    try:
        params = sum(spec.numel for spec in hf_inventory(model_config))
    except (KeyError, ValueError):
        return 0
    precision = cfg.actor.precision if cfg.actor.precision != "auto" else "bf16" if device == "cuda" else "fp32"
    weight = 2 if precision == "bf16" else 4
    engine = params * (weight + 8 + (4 if weight == 2 else 0))
    engines = 1 + (cfg.algorithm.advantage == "gae")  # the critic: about the policy's size
    return engines * engine + (params * weight if cfg.algorithm.kl_coef > 0 else 0)
