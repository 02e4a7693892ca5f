"""What a run will train, in the words a user checks it by: the lines `--check-config`, `--dry-run` and every run
print first. Batch sizes are said in prompts and in sequences (responses), and the optimizer steps they make."""

from __future__ import annotations

from megarl.config.sections import BUILT_IN_VAL_SIZE
from megarl.config.verl import count_rows
from megarl.data.files import SUFFIXES as PROMPT_FILES  # the prompt files megarl reads


def required_problem(cfg) -> str | None:
    """model.path and data.task have no default (a real run's model and prompts): the one error naming each unset."""
    unset = [key for key, value in (("model.path", cfg.model.path), ("data.task", cfg.data.task)) if not value]
    if not unset:
        return None
    what = {"model.path": "model.path=<HF model directory> (verl's actor_rollout_ref.model.path)",
            "data.task": "data.task=<prompts.parquet|jsonl> (verl's data.train_files)"}
    return (f"{' and '.join(unset)} {'is' if len(unset) == 1 else 'are'} not set: name {' and '.join(map(what.get, unset))}. "
            "The tiny CPU demo (a built-in model and task): bash scripts/quickstart.sh, or python -m megarl.train "
            "--config configs/quickstart.yaml")


def profile_line(cfg) -> str:
    if cfg.profile == "verl":
        return ("profile: verl (the command's keys are verl's: verl's defaults apply to the verl keys it does not set, "
                "megarl's to the rest)")
    return "profile: megarl (megarl's keys and defaults)"


def _kl(a) -> str:
    if a.kl_coef <= 0:
        return "no KL to the reference (no reference model)"
    where = "a per-token reward penalty" if a.kl_in_reward else "a loss term"
    target = f", adaptive towards {a.kl_target:g}" if a.kl_target > 0 else ""
    return f"KL {a.kl_estimator} x {a.kl_coef:g} as {where}{target}"


def _algorithm(cfg) -> str:
    a = cfg.algorithm
    critic = ""
    if a.advantage == "gae":
        critic = f" with a critic ({cfg.critic.path or 'the policy model + a new value head'}, gamma {a.gamma:g}, " \
                 f"lam {a.lam:g})"
    clip = f"clip {a.clip_eps:g}/{a.clip_eps_high or a.clip_eps:g}"
    if a.policy_loss == "dual_clip":
        clip += f", dual clip {a.dual_clip.clip_ratio_c:g}"
    return (f"algorithm: {a.advantage} advantages{critic}; policy loss {a.policy_loss} ({clip}, {a.loss_agg}); "
            f"{_kl(a)}; entropy bonus {a.entropy_coef:g}")


def _lora(lora) -> str:
    if not lora.rank:
        return ""
    return (f"; LoRA rank {lora.rank} (alpha {lora.alpha:g}) on {', '.join(lora.target_modules)}: the base is frozen, "
            "the adapters train")


def _micro_batch(actor) -> str:
    if actor.max_tokens_per_micro_batch:  # the token budget, not micro_batch_size, sets how many sequences go in one
        return f"micro-batches of whole sequences up to {actor.max_tokens_per_micro_batch} tokens"
    return f"micro-batch {actor.micro_batch_size} sequences"


def _file(path: str) -> str:
    rows = count_rows(path)
    return f"{path} ({'not found' if rows is None else f'{rows} rows'})"


def _data(cfg) -> str:
    d = cfg.data
    if not d.task.endswith(PROMPT_FILES):
        return (f"data: the built-in task {d.task!r} (a toy task for CPU runs); "
                f"{d.val_size or BUILT_IN_VAL_SIZE} held-out prompts")
    val = _file(d.val_task) if d.val_task else "a held-out split of the training file"
    return f"data: train {_file(d.task)}; held-out {val}, {f'at most {d.val_size}' if d.val_size else 'all'} scored"


def _checkpoints(t) -> str:
    if not t.save_every:
        return "no checkpoints (trainer.save_every=0)"
    return f"a checkpoint every {t.save_every} steps in {t.checkpoint_dir or t.output_dir + '/checkpoints'}"


def describe(cfg) -> list[str]:
    """The run in a few lines (after the profile line)."""
    r, d, actor = cfg.rollout, cfg.data, cfg.actor
    batch = d.prompts_per_step * r.n_samples
    mini = actor.mini_batch_size or batch
    updates = batch // mini * actor.ppo_epochs
    prompt_len = f"{d.max_prompt_length} tokens" if d.max_prompt_length else "what the model's positions leave"
    response = cfg.agent.max_response_tokens if cfg.agent.enabled else r.max_new_tokens
    steps = f"{cfg.trainer.steps} RL steps"
    if d.task.endswith(PROMPT_FILES) and (rows := count_rows(d.task)):
        steps += f" ({cfg.trainer.steps * d.prompts_per_step / rows:.3g} epochs of {rows} prompts)"
    elif not cfg.trainer.steps:
        steps = "one pass over data.task's prompts (trainer.steps=0; counted once the file is there)"
    return [
        f"model: {cfg.model.path}{_lora(actor.lora)}",
        _algorithm(cfg),
        f"samples: {r.n_samples} per prompt at temperature {r.temperature:g} (top_p {r.top_p:g}, top_k {r.top_k}); "
        f"prompts up to {prompt_len}, responses up to {response} tokens; held-out: {r.eval_n_samples} per prompt at "
        f"temperature {r.eval_temperature:g}",
        f"batch: {d.prompts_per_step} prompts = {batch} sequences per RL step; mini-batch {mini} sequences "
        f"({mini / r.n_samples:g} prompts); {updates} optimizer step(s) per RL step; {_micro_batch(actor)}",
        f"steps: {steps}; learning rate {actor.optim.lr:g} ({actor.optim.decay_style}, warmup "
        f"{actor.optim.warmup_steps})",
        _data(cfg),
        f"output: {cfg.trainer.output_dir}; {_checkpoints(cfg.trainer)}; loggers: {', '.join(cfg.trainer.loggers) or 'none'}",
    ]
