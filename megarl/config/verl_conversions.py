"""The conversions of verl's keys into megarl's (the rows of megarl/config/verl_keys.py call them).

A conversion is `fn(value, verl) -> {megarl key: value}`: `verl.get(key)` reads any other verl key, the user's value
or verl's default, so unit conversions see the whole command (a mini-batch of prompts becomes sequences at the
command's samples per prompt). One that cannot honour a value raises Refusal, saying why and what to use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from megarl.data.files import SUFFIXES as PROMPT_FILES

MISSING = object()  # no verl default: the row applies only when the key is given


class Refusal(ValueError):
    """A verl key or value megarl cannot honour; the message says why and what to use. `key`: the verl key at fault
    where it is another than the one whose conversion raised it (a conversion that reads several)."""

    def __init__(self, why: str, key: str | None = None):
        super().__init__(why)
        self.key = key


@dataclass(frozen=True)
class VerlKey:
    key: str  # verl's dotted key
    default: Any  # verl's default (applied when the command uses verl's vocabulary), or MISSING
    sets: str  # the megarl keys it sets, for the table ("" when none)
    convert: Callable[[Any, Any], dict]  # (value, verl values) -> {megarl key: value}; may raise Refusal
    note: str  # how, in one line


# ---- conversion builders ------------------------------------------------------------------------------------

def same(target: str, cast: Callable = lambda v: v) -> Callable:
    """The key is megarl's `target` in the same units (a command beside a megarl recipe reads it back from there)."""
    def convert(value, verl):
        return {target: cast(value)}
    convert.target = target
    return convert


def no_effect(value, verl) -> dict:
    return {}


def refuse(why: str) -> Callable:
    def convert(value, verl):
        raise Refusal(why)
    return convert


def only(allowed: tuple, why: str) -> Callable:
    """Accepted (no effect) when the value is one megarl already behaves as; refused otherwise."""
    def convert(value, verl):
        if value in allowed:
            return {}
        raise Refusal(why)
    convert.accepts_as_is = True
    return convert


def read_with(owner: str) -> Callable:
    """A key another row's conversion reads (the row's note says which)."""
    return lambda value, verl: {}


def said_when(convert: Callable, applies: Callable, note: str) -> Callable:
    """A conversion that does, for the values `applies` accepts, something other than verl does with them: the
    note says what, at start-up."""
    convert.differs = lambda value: note if applies(value) else None
    return convert


def has_no_effect(row) -> bool:
    """A row whose key, when given, is accepted and changes nothing in megarl (said at start-up)."""
    return row.convert is no_effect or getattr(row.convert, "accepts_as_is", False)


def _rows(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Refusal(f"expected a positive integer, got {value!r}")
    return value


def prompts_to_sequences(target: str) -> Callable:
    """verl's mini-batches count prompts; megarl's count sequences (responses): times rollout.n."""
    def convert(value, verl):
        if value is None:  # verl: the critic's mini-batch is the actor's
            return {}
        return {target: _rows(value) * verl.rows("actor_rollout_ref.rollout.n")}
    return convert


def token_budget(target: str, switch: str) -> Callable:
    """verl's per-GPU token budget of a micro-batch, used only with its dynamic batch size switch."""
    def convert(value, verl):
        return {target: _rows(value)} if verl.get(switch) else {}
    return convert


def world_size(value, verl) -> dict:
    """trainer.nnodes x n_gpus_per_node: the GPUs every role shares in verl (colocated), each role's ranks here."""
    ranks = verl.rows("trainer.nnodes") * verl.rows("trainer.n_gpus_per_node")
    out = {"actor.parallel.world_size": ranks}
    if verl.get("algorithm.adv_estimator") == "gae":
        out["critic.parallel.world_size"] = ranks
    if verl.get("reward_model.enable"):
        out["reward_model.parallel.world_size"] = ranks
    return out


def total_steps(value, verl) -> dict:
    """trainer.total_training_steps, or total_epochs x (training prompts // data.train_batch_size), as verl's
    dataloader (drop_last) counts them."""
    if verl.get("trainer.total_training_steps") is not None:
        return {"trainer.steps": verl.rows("trainer.total_training_steps")}
    epochs, batch = _rows(value), verl.rows("data.train_batch_size")
    rows = verl.train_rows()
    if rows is None:  # the file is not there (yet): the run names it before anything starts
        return {}
    if rows < batch:
        raise Refusal(f"data.train_files has {rows} prompts, fewer than one data.train_batch_size={batch}: "
                      "verl's epoch would have no step")
    return {"trainer.steps": epochs * (rows // batch)}


KL_ESTIMATORS = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3", "abs": "abs"}


def kl_estimator(name) -> str:
    """verl's KL names (a trailing '+' takes k2's gradient, as verl's) as megarl's."""
    base, plus = (name[:-1], "+") if isinstance(name, str) and name.endswith("+") else (name, "")
    if base not in KL_ESTIMATORS:
        raise Refusal(f"KL estimator {name!r}: megarl has {', '.join(sorted(KL_ESTIMATORS))} (and each with a "
                      "trailing '+'); 'full' (the whole-vocabulary KL) is not implemented")
    return KL_ESTIMATORS[base] + plus


def kl(value, verl) -> dict:
    """KL to the reference: as a loss term (actor.use_kl_loss) or a per-token reward penalty
    (algorithm.use_kl_in_reward); megarl has one coefficient, so not both."""
    in_loss, in_reward = bool(value), bool(verl.get("algorithm.use_kl_in_reward"))
    if in_loss and in_reward:
        raise Refusal("actor_rollout_ref.actor.use_kl_loss and algorithm.use_kl_in_reward are both on: megarl "
                      "applies the KL once, as a loss term or as a reward penalty; keep one")
    if in_loss:
        return {"algorithm.kl_coef": float(verl.get("actor_rollout_ref.actor.kl_loss_coef")),
                "algorithm.kl_in_reward": False,
                "algorithm.kl_estimator": kl_estimator(verl.get("actor_rollout_ref.actor.kl_loss_type"))}
    if in_reward:
        out = {"algorithm.kl_coef": float(verl.get("algorithm.kl_ctrl.kl_coef")), "algorithm.kl_in_reward": True,
               "algorithm.kl_estimator": kl_estimator(verl.get("algorithm.kl_penalty"))}
        control = verl.get("algorithm.kl_ctrl.type")
        if control == "adaptive":
            out |= {"algorithm.kl_target": float(verl.get("algorithm.kl_ctrl.target_kl")),
                    "algorithm.kl_horizon": verl.rows("algorithm.kl_ctrl.horizon")}
        elif control != "fixed":
            raise Refusal(f"algorithm.kl_ctrl.type={control!r}: fixed or adaptive")
        return out
    return {"algorithm.kl_coef": 0.0}


ESTIMATORS = {"gae", "grpo", "rloo", "gpg", "opo", "grpo_passk", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
              "remax", "optimal_token_baseline"}
VECTORIZED = {"grpo_vectorized": "grpo", "rloo_vectorized": "rloo"}  # verl's faster implementations, same values


def advantage(value, verl) -> dict:
    name = VECTORIZED.get(value, value)
    if name not in ESTIMATORS:
        raise Refusal(f"megarl has {', '.join(sorted(ESTIMATORS))} "
                      "(or a function of your own: algorithm.advantage=package.module:function)")
    return {"algorithm.advantage": name}


# verl's loss modes; "vanilla" is PPO's clipped loss with the dual clip (clip_ratio_c) always on
LOSS_MODES = {"vanilla": "dual_clip", "gspo": "gspo", "gpg": "gpg", "clip_cov": "clip_cov", "kl_cov": "kl_cov",
              "geo_mean": "gmpo", "cispo": "cispo", "sapo": "sapo"}


def loss_mode(value, verl) -> dict:
    if value not in LOSS_MODES:
        raise Refusal(f"megarl has {', '.join(LOSS_MODES)} (verl's names)")
    return {"algorithm.policy_loss": LOSS_MODES[value]}


def rollout_engine(value, verl) -> dict:
    """SGLang serves every GPU run; the CPU runs the transformers engine (debugging only)."""
    if value not in ("vllm", "sglang", "hf"):
        raise Refusal("megarl generates with sglang (GPU) or hf (CPU, debugging)")
    cpu = verl.get("trainer.device") == "cpu"
    engine = "hf" if value == "hf" or cpu else "sglang"
    out = {"rollout.engine": engine}
    if engine == "sglang":
        out["rollout.sglang_tp"] = verl.rows("actor_rollout_ref.rollout.tensor_model_parallel_size")
        out["rollout.sglang_mem_fraction"] = float(verl.get("actor_rollout_ref.rollout.gpu_memory_utilization"))
    return out


def greedy_unless_sampling(target: str, sampling_switch: str) -> Callable:
    """A temperature that do_sample=False overrides: verl then decodes greedily whatever the temperature."""
    def convert(value, verl):
        return {target: float(value) if verl.get(sampling_switch) else 0.0}
    return convert


def recompute(value, verl) -> dict:
    return {"actor.recompute": "full" if value else "none"}


def optim(role: str) -> dict[str, Callable]:
    """Conversions of verl's optimizer keys for `role` (actor or critic)."""
    prefix = "actor_rollout_ref.actor.optim" if role == "actor" else "critic.optim"

    def betas(value, verl):
        if not (isinstance(value, (list, tuple)) and len(value) == 2):
            raise Refusal(f"{prefix}.betas={value!r}: expected [beta1, beta2]")
        return {f"{role}.optim.adam_beta1": float(value[0]), f"{role}.optim.adam_beta2": float(value[1])}

    def warmup(value, verl):
        if value is not None and value >= 0:
            return {f"{role}.optim.warmup_steps": int(value)}
        ratio = float(verl.get(f"{prefix}.lr_warmup_steps_ratio"))
        steps = verl.get_megarl("trainer.steps")
        return {f"{role}.optim.warmup_steps": int(ratio * steps)} if ratio else {}

    def min_lr(value, verl):
        return {f"{role}.optim.min_lr": float(value or 0.0) * float(verl.get(f"{prefix}.lr"))}

    def schedule(value, verl):
        if value not in ("constant", "cosine", "linear"):
            raise Refusal("megarl's schedules are constant, linear and cosine")
        return {f"{role}.optim.decay_style": value}

    return {"betas": betas, "warmup": warmup, "min_lr": min_lr, "schedule": schedule}


def logger(value, verl) -> dict:
    names = [value] if isinstance(value, str) else list(value or [])
    known = {"console": "console", "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow",
             "swanlab": "swanlab", "file": "jsonl"}
    unknown = [n for n in names if n not in known]
    if isinstance(value, str) and "," in value and not value.startswith("["):  # Hydra refuses it too
        raise Refusal(f"a list of loggers is written in brackets: trainer.logger=[{value}]")
    if unknown:
        raise Refusal(f"logger {', '.join(map(repr, unknown))}: megarl writes {', '.join(known)} (verl's 'file' is "
                      "megarl's metrics.jsonl)")
    return {"trainer.loggers": list(dict.fromkeys(known[n] for n in names))}


def resume(value, verl) -> dict:
    if value == "auto":
        return {"trainer.resume": "auto"}
    if value == "disable":
        return {"trainer.resume": "none"}
    if value == "resume_path":
        path = verl.get("trainer.resume_from_path")
        if not path:
            raise Refusal("resume_mode=resume_path needs trainer.resume_from_path")
        return {"trainer.resume": str(path)}
    raise Refusal("auto, disable or resume_path")


def files(target: str) -> Callable:
    """verl takes a file or a list of them; megarl reads one prompt file per split."""
    def convert(value, verl):
        paths = [value] if isinstance(value, str) else list(value or [])
        if len(paths) != 1:
            raise Refusal(f"{len(paths)} files: megarl reads one prompt file per split; concatenate them "
                          "(e.g. with pyarrow) or pass one")
        if not str(paths[0]).endswith(PROMPT_FILES):  # megarl's data.task would read another name as a built-in task
            raise Refusal(f"megarl reads prompt files named *{', *'.join(PROMPT_FILES)} (verl's parquet layout, as "
                          "scripts/preprocess/*.py write it); name one of those")
        return {target: verl.path(paths[0])}
    return convert


def val_size(value, verl) -> dict:
    """verl evaluates every held-out prompt."""
    rows = verl.val_rows()
    return {"data.val_size": rows} if rows else {}


def run_dirs(value, verl) -> dict:
    """verl's naming: checkpoints/<project>/<experiment>; megarl's events beside, runs/<project>/<experiment>."""
    project, experiment = verl.get("trainer.project_name"), verl.get("trainer.experiment_name")
    for key, name in (("trainer.project_name", project), ("trainer.experiment_name", experiment)):
        if name is None or not str(name).strip():  # the run would write to runs//<experiment>
            raise Refusal("the run's directories are runs/<project_name>/<experiment_name>: give it a name", key)
    out = {"trainer.project_name": str(project), "trainer.experiment_name": str(experiment),
           "trainer.output_dir": f"runs/{project}/{experiment}"}
    local = verl.get("trainer.default_local_dir")
    out["trainer.checkpoint_dir"] = verl.path(local) if local else f"checkpoints/{project}/{experiment}"
    return out


def reward_function(value, verl) -> dict:
    if not value:
        return {}
    if verl.get("custom_reward_function.reward_kwargs"):
        raise Refusal("custom_reward_function.reward_kwargs: megarl calls the function with verl's four arguments; "
                      "bind extra arguments in the function's file")
    # absolute: the rollout actor and reward processes import it too, from working directories of their own
    return {"reward.name": f"{os.path.abspath(verl.path(value))}:{verl.get('custom_reward_function.name')}"}


def reward_model(value, verl) -> dict:
    if not value:
        return {}
    path = verl.get("reward_model.model.path")
    if not path:
        raise Refusal("reward_model.enable=True needs reward_model.model.path")
    return {"reward_model.path": verl.path(path)}


def reward_manager(value, verl) -> dict:
    if value == "naive":
        return {}
    if value == "dapo":  # verl's DAPO manager adds the overlong penalty when its buffer is on
        if not verl.get("reward_model.overlong_buffer.enable"):
            return {}
        return {"algorithm.overlong_buffer.len": verl.rows("reward_model.overlong_buffer.len"),
                "algorithm.overlong_buffer.penalty_factor":
                    float(verl.get("reward_model.overlong_buffer.penalty_factor"))}
    raise Refusal("megarl scores each sample as verl's naive manager does (and dapo's "
                  "overlong penalty); batch and prime managers have no equivalent")


def filter_groups(value, verl) -> dict:
    if not value:
        return {"algorithm.dynamic_sampling": False}
    metric = verl.get("algorithm.filter_groups.metric")
    if metric not in ("reward", "acc", "score", "seq_reward", "seq_final_reward"):
        raise Refusal(f"filter_groups.metric={metric!r}: megarl filters groups by their rewards")
    rounds = verl.get("algorithm.filter_groups.max_num_gen_batches")
    if not rounds or rounds < 1:
        raise Refusal("filter_groups.max_num_gen_batches <= 0 (no limit): megarl bounds the rounds of a step; set "
                      "a number (algorithm.max_sampling_rounds)")
    return {"algorithm.dynamic_sampling": True, "algorithm.max_sampling_rounds": int(rounds)}


def pf_ppo(value, verl) -> dict:
    """use_pf_ppo turns on verl's reweight_method (its weight_pow is megarl's key of the same name)."""
    if not value:
        return {}
    return {"algorithm.pf_ppo.method": verl.get("algorithm.pf_ppo.reweight_method")}


def multi_turn(value, verl) -> dict:
    return {"agent.enabled": bool(value)}
