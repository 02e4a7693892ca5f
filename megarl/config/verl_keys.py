"""verl's configuration vocabulary: the one table megarl reads verl's keys by (VERL_KEYS).

Each row is one key of verl's `ppo_trainer.yaml` that users set, with verl's default and what it becomes in
megarl: the megarl keys it sets (units converted), a setting megarl has no use for (accepted, said once), or a
refusal that says why and what to use. megarl/config/verl.py applies the table to a command;
docs/migrating-from-verl.md shows it (`python -m megarl.config.verl_keys` prints the table, and a test
checks the two agree).

A conversion is `fn(value, verl) -> {megarl key: value}`: `verl.get(key)` reads any other verl key, the
user's value or verl's default, so unit conversions see the whole command (a mini-batch of prompts becomes
sequences at the command's samples per prompt).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

MISSING = object()  # no verl default: the row applies only when the key is given


class Refusal(ValueError):
    """A verl key or value megarl cannot honour; the message says why and what to use."""


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


def has_no_effect(row) -> bool:
    """A row whose key, when given, is accepted and changes nothing in megarl (said at start-up)."""
    return row.convert is no_effect or getattr(row.convert, "accepts_as_is", False)


def _rows(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Refusal(f"expected a positive number of rows, got {value!r}")
    return value


def prompts_to_sequences(target: str) -> Callable:
    """verl's mini-batches count prompts; megarl's count sequences (responses): times rollout.n."""
    def convert(value, verl):
        if value is None:  # verl: the critic's mini-batch is the actor's
            return {}
        return {target: _rows(value) * _rows(verl.get("actor_rollout_ref.rollout.n"))}
    return convert


def token_budget(target: str, switch: str) -> Callable:
    """verl's per-GPU token budget of a micro-batch, used only with its dynamic batch size switch."""
    def convert(value, verl):
        return {target: _rows(value)} if verl.get(switch) else {}
    return convert


def world_size(value, verl) -> dict:
    """trainer.nnodes x n_gpus_per_node: the GPUs every role shares in verl (colocated), each role's ranks here."""
    ranks = _rows(verl.get("trainer.nnodes")) * _rows(verl.get("trainer.n_gpus_per_node"))
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
        return {"trainer.steps": _rows(verl.get("trainer.total_training_steps"))}
    epochs, batch = _rows(value), _rows(verl.get("data.train_batch_size"))
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
                    "algorithm.kl_horizon": _rows(verl.get("algorithm.kl_ctrl.horizon"))}
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
        out["rollout.sglang_tp"] = _rows(verl.get("actor_rollout_ref.rollout.tensor_model_parallel_size"))
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
        return {target: verl.path(paths[0])}
    return convert


def val_size(value, verl) -> dict:
    """verl evaluates every held-out prompt."""
    rows = verl.val_rows()
    return {"data.val_size": rows} if rows else {}


def run_dirs(value, verl) -> dict:
    """verl's naming: checkpoints/<project>/<experiment>; megarl's events beside, runs/<project>/<experiment>."""
    project, experiment = verl.get("trainer.project_name"), verl.get("trainer.experiment_name")
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
        return {"algorithm.overlong_buffer_len": _rows(verl.get("reward_model.overlong_buffer.len")),
                "algorithm.overlong_penalty_factor": float(verl.get("reward_model.overlong_buffer.penalty_factor"))}
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
    if not value:
        return {}
    return {"algorithm.pf_ppo": verl.get("algorithm.pf_ppo.reweight_method"),
            "algorithm.pf_ppo_weight_pow": float(verl.get("algorithm.pf_ppo.weight_pow"))}


def multi_turn(value, verl) -> dict:
    return {"agent.enabled": bool(value)}


FSDP = ("megarl trains with Megatron: set the layout with actor.parallel.* (tp, pp, cp, ep) and shard the optimizer "
        "with actor.use_distributed_optimizer")
OFFLOAD = ("between phases megarl parks weights, gradients and optimizer state in host memory "
           "(trainer.offload_between_phases=auto); actor.optimizer_cpu_offload runs Adam on the CPU")
NOT_HERE = "no effect in megarl"

A, R, C = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "critic"
ACTOR_OPTIM, CRITIC_OPTIM = optim("actor"), optim("critic")


def K(key, default, sets, convert, note) -> VerlKey:
    return VerlKey(key, default, sets, convert, note)


VERL_KEYS: list[VerlKey] = [
    # data
    K("data.train_files", "~/data/rlhf/gsm8k/train.parquet", "data.task", files("data.task"),
      "one .parquet/.jsonl file in verl's layout (prompt messages, reward_model.ground_truth, data_source)"),
    K("data.val_files", "~/data/rlhf/gsm8k/test.parquet", "data.val_task", files("data.val_task"),
      "one file; every row is evaluated (data.val_size = its rows)"),
    K("data.val_batch_size", None, "data.val_size", val_size, "megarl scores the held-out set in one pass"),
    K("data.train_batch_size", 1024, "data.prompts_per_step", same("data.prompts_per_step", _rows),
      "PROMPTS per step in both"),
    K("data.max_prompt_length", 512, "data.max_prompt_length", same("data.max_prompt_length", _rows), "tokens"),
    K("data.max_response_length", 512, "rollout.max_new_tokens", same("rollout.max_new_tokens", _rows), "tokens"),
    K("data.filter_overlong_prompts", False, "data.filter_overlong_prompts", same("data.filter_overlong_prompts", bool),
      "overlong prompts left out and counted"),
    K("data.truncation", "error", "data.truncation", same("data.truncation"), "error, left, right or middle"),
    K("data.prompt_key", "prompt", "data.prompt_key", same("data.prompt_key"), "the field holding the prompt"),
    K("data.reward_fn_key", "data_source", "", only(("data_source",), "megarl routes rewards by data_source"),
      "rewards follow each row's data_source"),
    K("data.shuffle", True, "", only((True,), "megarl always shuffles the prompts (by trainer.seed)"),
      "prompts are shuffled every epoch (trainer.seed)"),
    K("data.seed", None, "", no_effect, "the prompt order follows trainer.seed"),
    K("data.return_raw_chat", False, "", no_effect, NOT_HERE),
    K("data.return_full_prompt", False, "", no_effect, NOT_HERE),
    K("data.dataloader_num_workers", 8, "", no_effect, "prompts are tokenized once, at start"),
    K("data.filter_overlong_prompts_workers", 1, "", no_effect, NOT_HERE),
    K("data.trust_remote_code", False, "", no_effect, "tokenizers load from the model directory, offline"),
    K("data.use_shm", False, "", no_effect, NOT_HERE),
    K("data.custom_cls.path", None, "", only((None,), "megarl reads prompt files in verl's layout or its own; a "
                                               "custom dataset class has no equivalent"), "refused when set"),
    # the model
    K("actor_rollout_ref.model.path", "~/models/deepseek-llm-7b-chat", "model.path",
      lambda v, verl: {"model.path": verl.path(v)}, "a local HF directory (no hub downloads)"),
    K("actor_rollout_ref.model.enable_gradient_checkpointing", True, "actor.recompute", recompute,
      "true: full recompute"),
    K("actor_rollout_ref.model.use_remove_padding", True, "", no_effect,
      "megarl always packs sequences without padding"),
    K("actor_rollout_ref.model.use_fused_kernels", False, "actor.fused_kernels", same("actor.fused_kernels", bool),
      "megarl's fused SwiGLU/RoPE kernels (GPU)"),
    K("actor_rollout_ref.model.trust_remote_code", False, "", no_effect, "model code is megarl's own (megatron-core)"),
    K("actor_rollout_ref.model.use_shm", False, "", no_effect, NOT_HERE),
    K("actor_rollout_ref.model.enable_activation_offload", False, "",
      only((False,), "activation offload has no equivalent; use actor.recompute"), "refused when on"),
    K("actor_rollout_ref.model.lora_rank", 0, "", only((0,), "LoRA is not in megarl yet: full fine-tuning only"),
      "refused when > 0"),
    K("actor_rollout_ref.model.external_lib", None, "",
      only((None,), "megarl builds its models from config.json (megatron-core)"), "refused when set"),
    K("actor_rollout_ref.model.override_config", {}, "",
      only(({},), "megarl reads the model's config.json as it is"), "refused when set"),
    K("actor_rollout_ref.hybrid_engine", True, "", only((True,), "megarl colocates training and generation unless "
                                                       "rollout.sglang_gpus gives SGLang GPUs of its own"),
      "colocated by default"),
    # the actor
    K(f"{A}.strategy", "fsdp", "", only(("fsdp", "fsdp2", "megatron"), FSDP), "always Megatron"),
    K(f"{A}.ppo_mini_batch_size", 256, "actor.mini_batch_size", prompts_to_sequences("actor.mini_batch_size"),
      "verl counts PROMPTS, megarl SEQUENCES: x rollout.n"),
    K(f"{A}.ppo_micro_batch_size_per_gpu", None, "actor.micro_batch_size",
      lambda v, verl: {} if v is None else {"actor.micro_batch_size": _rows(v)}, "sequences per micro-batch per GPU"),
    K(f"{A}.ppo_micro_batch_size", None, "actor.micro_batch_size",
      lambda v, verl: {} if v is None else {"actor.micro_batch_size": max(1, _rows(v) // verl.get_megarl(
          "actor.parallel.world_size"))}, "verl's deprecated global count, divided by the GPUs"),
    K(f"{A}.use_dynamic_bsz", False, "actor.max_tokens_per_micro_batch", read_with(f"{A}.ppo_max_token_len_per_gpu"),
      "turns the token budget below on"),
    K(f"{A}.ppo_max_token_len_per_gpu", 16384, "actor.max_tokens_per_micro_batch",
      token_budget("actor.max_tokens_per_micro_batch", f"{A}.use_dynamic_bsz"), "with use_dynamic_bsz: tokens"),
    K(f"{A}.ppo_epochs", 1, "actor.ppo_epochs", same("actor.ppo_epochs", _rows), "passes over the step's batch"),
    K(f"{A}.shuffle", False, "", no_effect, NOT_HERE),
    K(f"{A}.grad_clip", 1.0, "actor.optim.clip_grad", same("actor.optim.clip_grad", float), "global norm"),
    K(f"{A}.clip_ratio", 0.2, "algorithm.clip_eps", same("algorithm.clip_eps", float), "PPO's clip range"),
    K(f"{A}.clip_ratio_low", 0.2, "algorithm.clip_eps", same("algorithm.clip_eps", float), "lower side"),
    K(f"{A}.clip_ratio_high", 0.2, "algorithm.clip_eps_high", same("algorithm.clip_eps_high", float), "upper side"),
    K(f"{A}.clip_ratio_c", 3.0, "algorithm.clip_ratio_c", same("algorithm.clip_ratio_c", float), "dual clip"),
    K(f"{A}.policy_loss.loss_mode", "vanilla", "algorithm.policy_loss", loss_mode,
      "vanilla is dual_clip; gspo, gpg, clip_cov, kl_cov, geo_mean (gmpo), cispo, sapo"),
    K(f"{A}.loss_agg_mode", "token-mean", "algorithm.loss_agg", same("algorithm.loss_agg"), "same names"),
    K(f"{A}.entropy_coeff", 0.0, "algorithm.entropy_coef", same("algorithm.entropy_coef", float), "entropy bonus"),
    K(f"{A}.use_kl_loss", False, "algorithm.kl_coef, kl_in_reward, kl_estimator", kl,
      "KL as a loss term; reads kl_loss_coef, kl_loss_type and algorithm.use_kl_in_reward"),
    K(f"{A}.kl_loss_coef", 0.001, "algorithm.kl_coef", read_with(f"{A}.use_kl_loss"), "with use_kl_loss"),
    K(f"{A}.kl_loss_type", "low_var_kl", "algorithm.kl_estimator", read_with(f"{A}.use_kl_loss"),
      "kl, mse, low_var_kl, abs (k1, k2, k3, abs)"),
    K(f"{A}.ulysses_sequence_parallel_size", 1, "actor.parallel.cp", same("actor.parallel.cp", _rows),
      "megatron's context parallelism splits each sequence instead"),
    K(f"{A}.optim.lr", 1e-6, "actor.optim.lr", same("actor.optim.lr", float), "peak learning rate"),
    K(f"{A}.optim.weight_decay", 0.01, "actor.optim.weight_decay", same("actor.optim.weight_decay", float), "AdamW"),
    K(f"{A}.optim.betas", [0.9, 0.999], "actor.optim.adam_beta1, adam_beta2", ACTOR_OPTIM["betas"], "Adam"),
    K(f"{A}.optim.clip_grad", 1.0, "actor.optim.clip_grad", same("actor.optim.clip_grad", float), "global norm"),
    K(f"{A}.optim.lr_warmup_steps", -1, "actor.optim.warmup_steps", ACTOR_OPTIM["warmup"],
      "-1: lr_warmup_steps_ratio x steps"),
    K(f"{A}.optim.lr_warmup_steps_ratio", 0.0, "actor.optim.warmup_steps", read_with(f"{A}.optim.lr_warmup_steps"),
      "a fraction of trainer.steps"),
    K(f"{A}.optim.min_lr_ratio", 0.0, "actor.optim.min_lr", ACTOR_OPTIM["min_lr"], "x lr"),
    K(f"{A}.optim.warmup_style", MISSING, "actor.optim.decay_style", ACTOR_OPTIM["schedule"], "constant or cosine"),
    K(f"{A}.optim.lr_scheduler_type", "constant", "actor.optim.decay_style", ACTOR_OPTIM["schedule"],
      "constant or cosine"),
    K(f"{A}.optim.total_training_steps", -1, "", no_effect, "set from trainer.steps, as verl does"),
    K(f"{A}.fsdp_config.param_offload", False, "", no_effect, OFFLOAD),
    K(f"{A}.fsdp_config.optimizer_offload", False, "", no_effect, OFFLOAD),
    K(f"{A}.fsdp_config.offload_policy", False, "", no_effect, OFFLOAD),
    K(f"{A}.fsdp_config.fsdp_size", -1, "", only((-1,), FSDP), "refused when set"),
    K(f"{A}.fsdp_config.model_dtype", "fp32", "", only(("fp32",), "megarl keeps fp32 main weights; the compute "
                                                                  "precision is actor.precision"), "refused when set"),
    K(f"{A}.fsdp_config.wrap_policy.min_num_params", 0, "", only((0,), FSDP), "refused when set"),
    K(f"{A}.fsdp_config.forward_prefetch", False, "", only((False,), FSDP), "refused when set"),
    K(f"{A}.fsdp_config.reshard_after_forward", True, "", only((True,), FSDP), "refused when set"),
    K(f"{A}.megatron.tensor_model_parallel_size", 1, "actor.parallel.tp", same("actor.parallel.tp", _rows), ""),
    K(f"{A}.megatron.pipeline_model_parallel_size", 1, "actor.parallel.pp", same("actor.parallel.pp", _rows), ""),
    K(f"{A}.megatron.virtual_pipeline_model_parallel_size", None, "actor.parallel.vpp",
      lambda v, verl: {} if v is None else {"actor.parallel.vpp": _rows(v)}, ""),
    K(f"{A}.megatron.context_parallel_size", 1, "actor.parallel.cp", same("actor.parallel.cp", _rows), ""),
    K(f"{A}.megatron.expert_model_parallel_size", 1, "actor.parallel.ep", same("actor.parallel.ep", _rows), ""),
    K(f"{A}.megatron.expert_tensor_parallel_size", None, "actor.parallel.etp",
      lambda v, verl: {} if v is None else {"actor.parallel.etp": _rows(v)}, ""),
    K(f"{A}.megatron.sequence_parallel", True, "actor.parallel.sequence_parallel",
      lambda v, verl: {"actor.parallel.sequence_parallel": bool(v) and verl.get_megarl("actor.parallel.tp") > 1},
      "on where tp > 1, as megatron's"),
    K(f"{A}.megatron.use_distributed_optimizer", True, "actor.use_distributed_optimizer",
      same("actor.use_distributed_optimizer", bool), ""),
    K(f"{A}.megatron.param_offload", False, "", no_effect, OFFLOAD),
    K(f"{A}.megatron.optimizer_offload", False, "", no_effect, OFFLOAD),
    K(f"{A}.megatron.grad_offload", False, "", no_effect, OFFLOAD),
    K(f"{A}.checkpoint.save_contents", ["model", "optimizer", "extra"], "", no_effect,
      "megarl's checkpoints always hold model, optimizer and driver state (exact resume)"),
    K(f"{A}.checkpoint.load_contents", ["model", "optimizer", "extra"], "", no_effect, "as save_contents"),
    # the reference policy
    K("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", None, "", no_effect,
      "the reference's forward passes use the actor's micro-batches and layout"),
    K("actor_rollout_ref.ref.log_prob_micro_batch_size", None, "", no_effect, "as above"),
    K("actor_rollout_ref.ref.log_prob_use_dynamic_bsz", False, "", no_effect, "as above"),
    K("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", 16384, "", no_effect, "as above"),
    K("actor_rollout_ref.ref.fsdp_config.param_offload", False, "", no_effect, OFFLOAD),
    K("actor_rollout_ref.ref.strategy", "fsdp", "", no_effect, "the reference follows the policy's layout"),
    K("actor_rollout_ref.ref.ulysses_sequence_parallel_size", 1, "", no_effect, "as the policy's"),
    # generation
    K(f"{R}.name", "sglang", "rollout.engine, sglang_tp, sglang_mem_fraction", rollout_engine,
      "vllm and sglang: SGLang servers (megarl serves rollouts with SGLang); hf or trainer.device=cpu: transformers"),
    K(f"{R}.mode", "async", "", only(("sync", "async"), "sync or async"),
      "megarl's rollouts are always served; trainer.mode sets (a)synchronous training"),
    K(f"{R}.n", 1, "rollout.n_samples", same("rollout.n_samples", _rows), "responses per prompt"),
    K(f"{R}.temperature", 1.0, "rollout.temperature", greedy_unless_sampling("rollout.temperature", f"{R}.do_sample"),
      ""),
    K(f"{R}.do_sample", True, "rollout.temperature", read_with(f"{R}.temperature"), "false: greedy"),
    K(f"{R}.top_p", 1.0, "rollout.top_p", same("rollout.top_p", float), ""),
    K(f"{R}.top_k", -1, "rollout.top_k", lambda v, verl: {"rollout.top_k": int(v) if int(v) > 0 else -1},
      "-1 or 0 (vLLM's off): all tokens"),
    K(f"{R}.prompt_length", MISSING, "data.max_prompt_length", same("data.max_prompt_length", _rows),
      "verl sets it from data.max_prompt_length"),
    K(f"{R}.response_length", MISSING, "rollout.max_new_tokens", same("rollout.max_new_tokens", _rows),
      "verl sets it from data.max_response_length"),
    K(f"{R}.gpu_memory_utilization", 0.5, "rollout.sglang_mem_fraction", read_with(f"{R}.name"),
      "SGLang's --mem-fraction-static"),
    K(f"{R}.tensor_model_parallel_size", 2, "rollout.sglang_tp", read_with(f"{R}.name"), "SGLang's TP"),
    K(f"{R}.ignore_eos", False, "rollout.ignore_eos", same("rollout.ignore_eos", bool), ""),
    K(f"{R}.val_kwargs.temperature", 0.0, "rollout.eval_temperature",
      greedy_unless_sampling("rollout.eval_temperature", f"{R}.val_kwargs.do_sample"), ""),
    K(f"{R}.val_kwargs.do_sample", False, "rollout.eval_temperature", read_with(f"{R}.val_kwargs.temperature"),
      "false: greedy"),
    K(f"{R}.val_kwargs.n", 1, "rollout.eval_n_samples", same("rollout.eval_n_samples", _rows), "mean@n"),
    K(f"{R}.val_kwargs.top_p", 1.0, "", only((1.0, 1), "held-out sampling has no top_p in megarl"),
      "refused unless 1.0"),
    K(f"{R}.val_kwargs.top_k", -1, "", only((-1, 0), "held-out sampling has no top_k in megarl"),
      "refused unless -1"),
    K(f"{R}.dtype", "bfloat16", "", only(("bfloat16", "bf16"), "SGLang serves the policy in bfloat16"), "bfloat16"),
    K(f"{R}.enforce_eager", False, "", no_effect, "SGLang captures decode CUDA graphs"),
    K(f"{R}.free_cache_engine", True, "", no_effect, "the colocated memory cycle frees SGLang's memory"),
    K(f"{R}.load_format", "dummy", "", no_effect, "SGLang loads the policy's weights by weight sync"),
    K(f"{R}.max_num_batched_tokens", 8192, "", no_effect, "SGLang's own (rollout.sglang_args)"),
    K(f"{R}.max_num_seqs", 1024, "", no_effect, "SGLang's own (rollout.sglang_args: --max-running-requests)"),
    K(f"{R}.max_model_len", None, "", no_effect, "SGLang reads the model's context length"),
    K(f"{R}.enable_chunked_prefill", True, "", no_effect, "SGLang's own"),
    K(f"{R}.calculate_log_probs", False, "", no_effect, "megarl always keeps the rollout's log-probs"),
    K(f"{R}.log_prob_micro_batch_size_per_gpu", None, "", no_effect,
      "log-prob forward passes use the actor's micro-batches"),
    K(f"{R}.log_prob_micro_batch_size", None, "", no_effect, "as above"),
    K(f"{R}.log_prob_use_dynamic_bsz", False, "", no_effect, "as above"),
    K(f"{R}.log_prob_max_token_len_per_gpu", 16384, "", no_effect, "as above"),
    K(f"{R}.multi_turn.enable", False, "agent.enabled", multi_turn, "the agent loop (tools in agent.tools)"),
    K(f"{R}.multi_turn.max_assistant_turns", None, "agent.max_turns",
      lambda v, verl: {} if v is None else {"agent.max_turns": _rows(v)}, ""),
    K(f"{R}.multi_turn.tool_config_path", None, "", only((None,), "megarl's tools are named in agent.tools "
                                                              "(registry names or package.module:Class)"),
      "refused when set"),
    # the critic
    K("critic.model.path", MISSING, "critic.path", lambda v, verl: {"critic.path": verl.path(v)},
      "unset: the policy's model with a new value head"),
    K("critic.model.enable_gradient_checkpointing", True, "critic.recompute",
      lambda v, verl: {"critic.recompute": "full" if v else "none"}, ""),
    K("critic.model.use_remove_padding", False, "", no_effect, "megarl always packs sequences without padding"),
    K("critic.model.fsdp_config.param_offload", False, "", no_effect, OFFLOAD),
    K("critic.model.fsdp_config.optimizer_offload", False, "", no_effect, OFFLOAD),
    K("critic.strategy", "fsdp", "", only(("fsdp", "fsdp2", "megatron"), FSDP), "always Megatron"),
    K("critic.optim.lr", 1e-5, "critic.optim.lr", same("critic.optim.lr", float), ""),
    K("critic.optim.weight_decay", 0.01, "critic.optim.weight_decay", same("critic.optim.weight_decay", float), ""),
    K("critic.optim.betas", [0.9, 0.999], "critic.optim.adam_beta1, adam_beta2", CRITIC_OPTIM["betas"], ""),
    K("critic.optim.lr_warmup_steps", -1, "critic.optim.warmup_steps", CRITIC_OPTIM["warmup"], ""),
    K("critic.optim.lr_warmup_steps_ratio", 0.0, "critic.optim.warmup_steps", read_with("critic.optim.lr_warmup_steps"),
      ""),
    K("critic.optim.min_lr_ratio", 0.0, "critic.optim.min_lr", CRITIC_OPTIM["min_lr"], ""),
    K("critic.optim.warmup_style", MISSING, "critic.optim.decay_style", CRITIC_OPTIM["schedule"], ""),
    K("critic.optim.lr_scheduler_type", "constant", "critic.optim.decay_style", CRITIC_OPTIM["schedule"], ""),
    K("critic.optim.clip_grad", 1.0, "critic.optim.clip_grad", same("critic.optim.clip_grad", float), ""),
    K("critic.grad_clip", 1.0, "critic.optim.clip_grad", same("critic.optim.clip_grad", float), ""),
    K("critic.ppo_mini_batch_size", None, "critic.mini_batch_size", prompts_to_sequences("critic.mini_batch_size"),
      "PROMPTS in verl (unset: the actor's), sequences here"),
    K("critic.ppo_micro_batch_size_per_gpu", None, "critic.micro_batch_size",
      lambda v, verl: {} if v is None else {"critic.micro_batch_size": _rows(v)}, ""),
    K("critic.ppo_epochs", None, "critic.ppo_epochs",
      lambda v, verl: {"critic.ppo_epochs": _rows(verl.get(f"{A}.ppo_epochs") if v is None else v)},
      "unset: the actor's"),
    K("critic.cliprange_value", 0.5, "critic.value_clip", same("critic.value_clip", float), ""),
    K("critic.use_dynamic_bsz", False, "critic.max_tokens_per_micro_batch",
      read_with("critic.ppo_max_token_len_per_gpu"), "turns the token budget below on"),
    K("critic.ppo_max_token_len_per_gpu", 32768, "critic.max_tokens_per_micro_batch",
      token_budget("critic.max_tokens_per_micro_batch", "critic.use_dynamic_bsz"), "with use_dynamic_bsz"),
    K("critic.forward_micro_batch_size_per_gpu", None, "", no_effect, "the critic's micro-batches serve both"),
    K("critic.forward_max_token_len_per_gpu", 32768, "", no_effect, "as above"),
    K("critic.loss_agg_mode", "token-mean", "", only(("token-mean",), "the critic's loss is a token mean"), ""),
    # rewards
    K("reward_model.enable", False, "reward_model.path", reward_model, "reads reward_model.model.path"),
    K("reward_model.model.path", None, "reward_model.path", read_with("reward_model.enable"), "with enable"),
    K("reward_model.micro_batch_size_per_gpu", None, "reward_model.micro_batch_size",
      lambda v, verl: {} if v is None else {"reward_model.micro_batch_size": _rows(v)}, ""),
    K("reward_model.strategy", "fsdp", "", only(("fsdp", "fsdp2", "megatron"), FSDP), "always Megatron"),
    K("reward_model.reward_manager", "naive", "algorithm.overlong_buffer_len, overlong_penalty_factor",
      reward_manager, "naive; dapo with its overlong buffer"),
    K("reward_model.overlong_buffer.enable", False, "algorithm.overlong_buffer_len",
      read_with("reward_model.reward_manager"), "with reward_manager=dapo"),
    K("reward_model.overlong_buffer.len", 0, "algorithm.overlong_buffer_len", read_with("reward_model.reward_manager"),
      "tokens"),
    K("reward_model.overlong_buffer.penalty_factor", 1.0, "algorithm.overlong_penalty_factor",
      read_with("reward_model.reward_manager"), ""),
    K("reward_model.launch_reward_fn_async", False, "", no_effect, "reward processes score beside the driver"),
    K("custom_reward_function.path", None, "reward.name", reward_function,
      "path:name; verl's signature (data_source, solution_str, ground_truth, extra_info)"),
    K("custom_reward_function.name", "compute_score", "reward.name", read_with("custom_reward_function.path"), ""),
    K("custom_reward_function.reward_kwargs", {}, "", read_with("custom_reward_function.path"), "refused when set"),
    # the algorithm
    K("algorithm.adv_estimator", "gae", "algorithm.advantage", advantage, "same names"),
    K("algorithm.gamma", 1.0, "algorithm.gamma", same("algorithm.gamma", float), ""),
    K("algorithm.lam", 1.0, "algorithm.lam", same("algorithm.lam", float), "verl's default 1.0"),
    K("algorithm.norm_adv_by_std_in_grpo", True, "algorithm.norm_adv_by_std",
      same("algorithm.norm_adv_by_std", bool), ""),
    K("algorithm.use_kl_in_reward", False, "algorithm.kl_in_reward", read_with(f"{A}.use_kl_loss"),
      "KL as a per-token reward penalty"),
    K("algorithm.kl_penalty", "kl", "algorithm.kl_estimator", read_with(f"{A}.use_kl_loss"),
      "with use_kl_in_reward"),
    K("algorithm.kl_ctrl.type", "fixed", "algorithm.kl_target", read_with(f"{A}.use_kl_loss"), "fixed or adaptive"),
    K("algorithm.kl_ctrl.kl_coef", 0.001, "algorithm.kl_coef", read_with(f"{A}.use_kl_loss"),
      "used only with use_kl_in_reward, as in verl"),
    K("algorithm.kl_ctrl.horizon", 10000, "algorithm.kl_horizon", read_with(f"{A}.use_kl_loss"), ""),
    K("algorithm.kl_ctrl.target_kl", 0.1, "algorithm.kl_target", read_with(f"{A}.use_kl_loss"), "adaptive"),
    K("algorithm.filter_groups.enable", False, "algorithm.dynamic_sampling, max_sampling_rounds", filter_groups,
      "DAPO's dynamic sampling"),
    K("algorithm.filter_groups.metric", "reward", "algorithm.dynamic_sampling", read_with("algorithm.filter_groups.enable"),
      "megarl filters by reward (acc, score, seq_reward accepted)"),
    K("algorithm.filter_groups.max_num_gen_batches", 0, "algorithm.max_sampling_rounds",
      read_with("algorithm.filter_groups.enable"), "must be > 0"),
    K("algorithm.use_pf_ppo", False, "algorithm.pf_ppo, pf_ppo_weight_pow", pf_ppo, ""),
    K("algorithm.pf_ppo.reweight_method", "pow", "algorithm.pf_ppo", read_with("algorithm.use_pf_ppo"), ""),
    K("algorithm.pf_ppo.weight_pow", 2.0, "algorithm.pf_ppo_weight_pow", read_with("algorithm.use_pf_ppo"), ""),
    # the loop
    K("trainer.total_epochs", 30, "trainer.steps", total_steps,
      "epochs x (training prompts // data.train_batch_size), counted from data.train_files"),
    K("trainer.total_training_steps", None, "trainer.steps", read_with("trainer.total_epochs"), "wins over epochs"),
    K("trainer.nnodes", 1, "actor/critic/reward_model.parallel.world_size", world_size,
      "nnodes x n_gpus_per_node ranks for each role (colocated, as verl)"),
    K("trainer.n_gpus_per_node", 8, "actor/critic/reward_model.parallel.world_size", read_with("trainer.nnodes"),
      "with nnodes"),
    K("trainer.device", MISSING, "trainer.device", same("trainer.device"), "cuda or cpu (megarl's default: auto)"),
    K("trainer.project_name", "verl_examples", "trainer.project_name, experiment_name, output_dir, checkpoint_dir",
      run_dirs, "runs/<project>/<experiment>, checkpoints/<project>/<experiment>"),
    K("trainer.experiment_name", "gsm8k", "trainer.experiment_name, output_dir, checkpoint_dir",
      read_with("trainer.project_name"), "with project_name"),
    K("trainer.default_local_dir", None, "trainer.checkpoint_dir", read_with("trainer.project_name"),
      "verl's default checkpoints/<project>/<experiment>"),
    K("trainer.logger", MISSING, "trainer.loggers", logger,
      "console, tensorboard, wandb, mlflow, swanlab, file (jsonl); unset: console, tensorboard, jsonl"),
    K("trainer.save_freq", -1, "trainer.save_every", lambda v, verl: {"trainer.save_every": max(0, int(v))},
      "-1: never"),
    K("trainer.test_freq", -1, "trainer.eval_every", lambda v, verl: {"trainer.eval_every": max(0, int(v))},
      "-1: megarl still evaluates before RL and after the last step"),
    K("trainer.val_before_train", True, "", no_effect, "megarl always evaluates before RL (the run's baseline)"),
    K("trainer.val_only", False, "", only((False,), "megarl has no evaluation-only run"), "refused when on"),
    K("trainer.resume_mode", "auto", "trainer.resume", resume, "auto, disable (none), resume_path"),
    K("trainer.resume_from_path", None, "trainer.resume", read_with("trainer.resume_mode"), ""),
    K("trainer.max_actor_ckpt_to_keep", None, "trainer.keep_last",
      lambda v, verl: {"trainer.keep_last": 0 if v is None else _rows(v)}, "null: keep all"),
    K("trainer.max_critic_ckpt_to_keep", None, "", no_effect, "one checkpoint holds every role"),
    K("trainer.critic_warmup", 0, "algorithm.critic_warmup_steps",
      lambda v, verl: {"algorithm.critic_warmup_steps": int(v)}, "steps training only the critic"),
    K("trainer.balance_batch", True, "", no_effect, "megarl balances micro-batches over ranks by tokens"),
    K("trainer.log_val_generations", 0, "", no_effect, NOT_HERE),
    K("trainer.rollout_data_dir", None, "rollout.dump_dir",
      lambda v, verl: {} if not v else {"rollout.dump_dir": verl.path(v)}, "megarl's dump is one .pt per step"),
    K("trainer.validation_data_dir", None, "", no_effect, NOT_HERE),
    K("trainer.del_local_ckpt_after_load", False, "", only((False,), "megarl keeps checkpoints (trainer.keep_last)"),
      ""),
    K("trainer.default_hdfs_dir", None, "", only((None,), "megarl writes checkpoints to a local or mounted path "
                                                          "(trainer.checkpoint_dir)"), ""),
    K("trainer.ray_wait_register_center_timeout", 300, "", no_effect, "trainer.worker_timeout_s bounds each call"),
    K("trainer.use_legacy_worker_impl", "auto", "", no_effect, NOT_HERE),
    K("trainer.esi_redundant_time", 0, "", no_effect, NOT_HERE),
]

BY_KEY = {row.key: row for row in VERL_KEYS}
# top-level sections only verl has: a key under one is read in verl's vocabulary
VERL_SECTIONS = ("actor_rollout_ref", "custom_reward_function", "ray_init", "ray_kwargs", "global_profiler")
REFUSED_SECTIONS = {
    "ray_init": "megarl's Ray is joined or started by trainer.ray_address / RAY_ADDRESS (docs/launching.md)",
    "ray_kwargs": "megarl's Ray is joined or started by trainer.ray_address / RAY_ADDRESS (docs/launching.md)",
    "global_profiler": "megarl profiles an update with trainer.profile_update=N (torch.profiler)",
}


def markdown_table() -> str:
    """The table as docs/migrating-from-verl.md shows it."""
    def cell(text) -> str:
        return str(text).replace("|", "\\|")

    lines = ["| verl key | verl default | megarl | how |", "|---|---|---|---|"]
    for row in VERL_KEYS:
        default = "(none)" if row.default is MISSING else repr(row.default)
        sets = f"`{row.sets}`" if row.sets else ("refused when set" if "refused" in row.note else "no effect")
        lines.append(f"| `{row.key}` | {cell(default)} | {cell(sets)} | {cell(row.note)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
