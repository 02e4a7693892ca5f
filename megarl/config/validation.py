"""`ConfigError`, and the checks a whole config must pass: options against each other, across sections.

`ConfigChecks` is mixed into `Config` (megarl/config/sections.py), so `self` below is the whole config;
`load_config` runs `validate()` once the recipe and the overrides are set.
"""

from __future__ import annotations

import importlib.util
import re
from typing import TYPE_CHECKING

from megarl.config.agent_command import check_command
from megarl.config.sglang_args import (DETERMINISTIC_ATTENTION_BACKENDS, attention_backend, managed_args,
                                      sglang_ep_size)

if TYPE_CHECKING:
    from megarl.config.sections import Config


# megatron's selective-recompute modules (moe_act, which needs grouped-GEMM experts, is not among them: megarl's
# models do not use those); the ones megatron recomputes through CheckpointWithoutOutput need TransformerEngine
RECOMPUTE_MODULES = ("core_attn", "moe", "shared_experts", "mlp", "mla_up_proj", "layernorm")
RECOMPUTE_NEEDS_TE = ("mla_up_proj", "layernorm")
# micro-batch layouts of the engines (megarl/engine/packing.py)
PACKING_LAYOUTS = ("rows", "one_row")
# actor.lora.target_modules: the checkpoints' projection names (peft's and verl's), each one block of megatron's
# fused layers (megarl/engine/lora.py); all-linear names them all
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_targets(section) -> set[str]:
    """The projections actor.lora (`section`) adapts, all-linear spelled out."""
    return set(LORA_TARGETS) if "all-linear" in section.target_modules else set(section.target_modules)


class ConfigError(ValueError):
    """A bad option: the message names the key."""


def check_env(key: str, env: dict) -> None:
    """Environment variables a config sets in processes megarl starts: names as the shell takes them, scalar
    values (env_strings gives them as strings), and not CUDA_VISIBLE_DEVICES (Ray's and megarl's to set)."""
    if not isinstance(env, dict):
        raise ConfigError(f"{key}={env!r}: expected a mapping of variable names to values, e.g. {{NAME: value}}")
    for name, value in env.items():
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ConfigError(f"{key}: {name!r} is not an environment variable name")
        if name == "CUDA_VISIBLE_DEVICES":
            raise ConfigError(f"{key}: CUDA_VISIBLE_DEVICES is set by megarl and Ray (trainer.placement, "
                              "rollout.sglang_gpus)")
        if not isinstance(value, (str, int, float, bool)):
            raise ConfigError(f"{key}.{name}={value!r}: an environment variable's value must be a string or a number")


def env_strings(env: dict) -> dict[str, str]:
    """A checked env section as the process gets it (booleans as 1 or 0)."""
    return {name: str(int(value)) if isinstance(value, bool) else str(value) for name, value in env.items()}


class ConfigChecks:
    """`Config.validate` and its helpers, one per concern; each raises a ConfigError that names the key."""

    def validate(self) -> "Config":
        from megarl.config.fields import SEQUENCES, check_ranges  # imports ConfigError from here
        check_ranges(self)  # every option within its field's range: the checks below relate options
        from megarl.config.run_defaults import resolve_run_defaults
        resolve_run_defaults(self)  # rollout.engine=auto and trainer.steps=0, before the checks that read them
        self._validate_engine_options()
        self._validate_lora()
        p = self.actor.parallel
        batch = self.data.prompts_per_step * self.rollout.n_samples
        if batch > SEQUENCES["max"]:
            raise ConfigError(f"data.prompts_per_step * rollout.n_samples = {self.data.prompts_per_step} * "
                              f"{self.rollout.n_samples} = {batch} sequences a step: must be at most "
                              f"{SEQUENCES['max']} ({SEQUENCES['why']})")
        mini = self.actor.mini_batch_size or batch
        if batch % mini:
            raise ConfigError(f"actor.mini_batch_size={mini} does not divide the step's batch "
                              f"(data.prompts_per_step * rollout.n_samples = {batch})")
        if mini % p.dp:
            raise ConfigError(f"actor.mini_batch_size={mini} is not divisible by the data-parallel size {p.dp}")
        self._validate_weight_delivery()
        self._validate_sglang_args()
        check_env("trainer.worker_env", self.trainer.worker_env)
        check_env("rollout.sglang_env", self.rollout.sglang_env)
        self._validate_disaggregated()
        a = self.algorithm
        if a.loss_agg == "seq-mean-token-sum-norm" and a.loss_agg_norm_len < 1:
            raise ConfigError("algorithm.loss_agg=seq-mean-token-sum-norm needs algorithm.loss_agg_norm_len >= 1 "
                              "(e.g. rollout.max_new_tokens)")
        if a.recompute_old_logprobs == "never" and not self.old_policy_is_the_trained_one():
            raise ConfigError("algorithm.recompute_old_logprobs=never needs one optimizer update per step "
                              f"(actor.ppo_epochs=1 and actor.mini_batch_size 0 or the step's batch; got "
                              f"{self.actor.ppo_epochs} epoch(s) of mini-batches of {mini} from {batch} samples) "
                              "and no algorithm.kl_in_reward (its KL reads the old log-probs before training)")
        if a.kl_target > 0 and a.kl_coef == 0:
            raise ConfigError(f"algorithm.kl_target={a.kl_target} (adaptive KL) needs an initial kl_coef > 0; got "
                              "algorithm.kl_coef=0")
        if not self.trainer.resume:
            raise ConfigError("trainer.resume='': must be auto, force, none or the path of a checkpoint")
        self._validate_data_and_reward()
        self._validate_agent()
        from megarl.config.algorithm_checks import check_algorithm_extras  # imports ConfigError from here
        check_algorithm_extras(self)
        from megarl.config.correction_checks import check_kl_and_groups, check_rollout_correction
        check_kl_and_groups(self)
        check_rollout_correction(self)
        self._validate_async()
        if a.overlong_buffer.len > self.rollout.max_new_tokens:
            raise ConfigError(f"algorithm.overlong_buffer.len={a.overlong_buffer.len}: must be in "
                              f"[0, rollout.max_new_tokens={self.rollout.max_new_tokens}]")
        return self

    def _validate_disaggregated(self) -> None:
        r = self.rollout
        if r.sglang_gpus_per_host and not r.sglang_gpus:
            raise ConfigError(f"rollout.sglang_gpus_per_host={r.sglang_gpus_per_host} places disaggregated servers: "
                              "it needs rollout.sglang_gpus (colocated servers run on the training ranks' GPUs)")
        if not r.sglang_gpus:
            return
        if r.engine != "sglang":
            raise ConfigError(f"rollout.sglang_gpus={r.sglang_gpus} reserves GPUs for SGLang servers: it needs "
                              f"rollout.engine=sglang (got {r.engine})")
        if r.sglang_gpus % r.sglang_tp:
            raise ConfigError(f"rollout.sglang_gpus={r.sglang_gpus} must be a multiple of rollout.sglang_tp="
                              f"{r.sglang_tp} (one server per rollout.sglang_tp GPUs)")
        per_host = r.sglang_gpus_per_host
        if per_host and (per_host % r.sglang_tp or r.sglang_gpus % per_host):
            raise ConfigError(f"rollout.sglang_gpus_per_host={per_host}: must be a multiple of rollout.sglang_tp="
                              f"{r.sglang_tp} that divides rollout.sglang_gpus={r.sglang_gpus} (whole servers on "
                              "each host, every host alike)")
        if self.trainer.offload_between_phases == "always":
            raise ConfigError(f"trainer.offload_between_phases=always with rollout.sglang_gpus={r.sglang_gpus}: the "
                              "servers have GPUs of their own, nothing shares memory to offload (use auto or never)")

    def _validate_sglang_args(self) -> None:
        r = self.rollout
        if not r.sglang_args:
            return
        if r.engine != "sglang":
            raise ConfigError(f"rollout.sglang_args={r.sglang_args}: extra SGLang arguments need rollout.engine=sglang "
                              f"(got {r.engine})")
        managed = managed_args(r.sglang_args)
        if managed:
            raise ConfigError(f"rollout.sglang_args: {', '.join(managed)} is set by megarl (from rollout.sglang_tp, "
                              f"rollout.sglang_mem_fraction, rollout.deterministic, actor.precision, actor.fp32_lm_head, "
                              f"the GPUs and the weight loader)")
        backend = attention_backend(r.sglang_args)
        if r.deterministic and backend not in DETERMINISTIC_ATTENTION_BACKENDS:
            raise ConfigError(f"rollout.deterministic=true with rollout.sglang_args' --attention-backend {backend}: "
                              f"SGLang's deterministic inference runs on {', '.join(DETERMINISTIC_ATTENTION_BACKENDS)}")

    def _validate_weight_delivery(self) -> None:
        r, p, t = self.rollout, self.actor.parallel, self.trainer
        if r.engine == "sglang" and (r.weight_delivery == "sharded" or (t.verify_weight_sync_every > 0
                                                                       and not t.verify_weight_sync_deep)):
            try:  # both need SGLang's placement of the weights: a setting megarl does not model is refused by name
                sglang_ep_size(r.sglang_args)
            except ValueError as e:
                raise ConfigError(f"{e} (rollout.weight_delivery={r.weight_delivery}, trainer.verify_weight_sync_every="
                                  f"{t.verify_weight_sync_every})") from None
        if r.weight_delivery != "sharded":
            return
        if r.engine == "sglang" and r.sglang_gpus:
            raise ConfigError(
                f"rollout.weight_delivery=sharded with rollout.engine=sglang needs colocated servers "
                f"(rollout.sglang_gpus=0, got {r.sglang_gpus}: each rank of the first generation TP group posts its "
                f"SGLang rank's shard by CUDA IPC from its own GPU); otherwise use rollout.weight_delivery=full")
        g = r.sglang_tp
        if p.world_size % g or (p.tp % g and g % p.tp):
            raise ConfigError(f"rollout.weight_delivery=sharded: rollout.sglang_tp={g} (the generation TP) must divide "
                              f"actor.parallel.world_size={p.world_size} and divide or be a multiple of "
                              f"actor.parallel.tp={p.tp}")
        if p.vpp > 1:
            raise ConfigError("rollout.weight_delivery=sharded: the resharder models contiguous pipeline stages; "
                              "actor.parallel.vpp must be 1")

    def _validate_data_and_reward(self) -> None:
        r = self.reward
        d = self.data
        if 0 < d.max_pixels < d.min_pixels:
            raise ConfigError(f"data.min_pixels={d.min_pixels}, data.max_pixels={d.max_pixels}: min_pixels must not "
                              "exceed max_pixels (0 = the model directory's)")
        if not d.prompt_key:
            raise ConfigError("data.prompt_key is empty: name the prompt files' prompt field (default: prompt)")
        if r.name == "remote" and not r.remote_url:
            raise ConfigError("reward.name=remote needs reward.remote_url")

    def _validate_agent(self) -> None:
        g = self.agent
        for i, tool in enumerate(g.tools):
            if not (isinstance(tool, str) or (isinstance(tool, dict) and isinstance(tool.get("name"), str))):
                raise ConfigError(f"agent.tools[{i}]={tool!r}: must be a name or a dict with a 'name'")
        if g.observation_template and "{result}" not in g.observation_template:
            raise ConfigError(f"agent.observation_template={g.observation_template!r} has no {{result}} field")
        if g.oversample_groups and not g.enabled:
            raise ConfigError(f"agent.oversample_groups={g.oversample_groups}: needs agent.enabled=true")
        if g.oversample_groups and self.algorithm.advantage == "remax":
            raise ConfigError("agent.oversample_groups does not combine with algorithm.advantage=remax")
        if g.gateway.command != "":  # "" (the default): no command
            if (why := check_command(g.gateway.command)) is not None:
                raise ConfigError(why)
            if g.gateway.function:
                raise ConfigError("agent.gateway.function and agent.gateway.command are both set: the agent is one "
                                  "or the other")
        if g.gateway.in_use:
            key = "agent.gateway.function" if g.gateway.function else "agent.gateway.command"
            if not g.enabled:
                raise ConfigError(f"{key} is set: needs agent.enabled=true")
            if g.tools:
                raise ConfigError(f"{key} and agent.tools: a gateway agent runs its tools itself; leave agent.tools "
                                  "empty")
            if g.oversample_groups:
                raise ConfigError(f"{key} does not combine with agent.oversample_groups (an agent cannot be aborted "
                                  "midway)")
        if self.rollout.dump_dir and self.rollout.replay_dir:
            raise ConfigError("rollout.dump_dir and rollout.replay_dir are exclusive: a replay writes no dump")

    def _validate_async(self) -> None:
        """trainer.mode and the `async` section (megarl/async_trainer.py)."""
        mode, a = self.trainer.mode, self.async_
        if mode == "one_step_off" and (a.max_staleness < 1 or a.partial != "finish" or a.buffer_batches > 1
                                       or a.batches_at_once > 1):
            raise ConfigError(f"trainer.mode=one_step_off generates step t+1's batch whole from the policy one version "
                              f"older while step t trains: it needs async.max_staleness >= 1 (got {a.max_staleness}), "
                              f"async.partial=finish (got {a.partial}), async.buffer_batches 0 or 1 (got "
                              f"{a.buffer_batches}) and async.batches_at_once 0 or 1 (got {a.batches_at_once}); "
                              "trainer.mode=async has the others")
        correction = self.algorithm.rollout_correction
        corrects = self.algorithm.tis or correction.rollout_is != "none" or correction.bypass_mode
        if a.decoupled_ppo == "on" and corrects:
            raise ConfigError("async.decoupled_ppo=on weights each token by proximal / rollout policy, which "
                              "algorithm.tis, algorithm.rollout_correction.rollout_is or bypass_mode already do: "
                              "use async.decoupled_ppo=auto (leaves them) or turn those off")
        if mode == "sync":
            return
        if self.trainer.offload_between_phases == "always":
            raise ConfigError(f"trainer.mode={mode} keeps the training and rollout engines resident side by side: "
                              "trainer.offload_between_phases=always cannot be (use auto or never)")
        r = self.rollout
        for key, value in (("rollout.replay_dir", r.replay_dir), ("rollout.dump_dir", r.dump_dir)):
            if value:
                raise ConfigError(f"{key}={value!r} names files by step, which trainer.mode={mode} does not generate "
                                  "in step order: use trainer.mode=sync")

    def _validate_engine_options(self) -> None:
        """Each training role's layout and engine options (the actor's batch sizes are checked below)."""
        roles = {"actor": self.actor, "critic": self.critic, "reward_model": self.reward_model}
        for role, section_ in roles.items():
            p = section_.parallel
            if p.vpp > 1 and p.pp < 2:
                raise ConfigError(f"{role}.parallel.vpp={p.vpp} needs {role}.parallel.pp > 1")
            if p.world_size % (p.tp * p.pp * p.cp):
                raise ConfigError(f"{role}.parallel.world_size={p.world_size} is not divisible by {role}.parallel.tp "
                                  f"* {role}.parallel.pp * {role}.parallel.cp = {p.tp}*{p.pp}*{p.cp}")
            if p.cp > 1 and p.ep > 1:
                raise ConfigError(f"{role}.parallel.cp={p.cp} with {role}.parallel.ep={p.ep}: context parallelism "
                                  "with expert parallelism is not supported")
            if p.sequence_parallel and p.tp < 2:  # megatron splits nothing: the setting would be silently ignored
                raise ConfigError(f"{role}.parallel.sequence_parallel=true splits activations over the TP group, and "
                                  f"{role}.parallel.tp={p.tp}: set {role}.parallel.tp > 1 or sequence_parallel=false")
            self._validate_experts_and_stages(role, p)
            self._validate_optimizer_and_recompute(role, section_)
            if p.cp > 1 and section_.attention not in ("auto", "sdpa"):
                raise ConfigError(f"{role}.attention={section_.attention!r} does not run context parallelism "
                                  f"({role}.parallel.cp={p.cp}): use sdpa or auto")

    def _validate_lora(self) -> None:
        lora = self.actor.lora
        targets = lora.target_modules
        unknown = [t for t in targets if t not in LORA_TARGETS + ("all-linear",)]
        if unknown:
            raise ConfigError(f"actor.lora.target_modules: {', '.join(map(repr, unknown))} is not one of "
                              f"{', '.join(LORA_TARGETS)} or all-linear")
        if not lora.rank:
            for key, value in (("rollout.lora_sync", self.rollout.lora_sync != "merged"),
                               ("actor.lora.peft_dir", bool(lora.peft_dir))):
                if value:
                    raise ConfigError(f"{key} is set and actor.lora.rank=0: there are no adapters (set actor.lora.rank "
                                      "> 0)")
            return
        if not targets:
            raise ConfigError(f"actor.lora.rank={lora.rank} with actor.lora.target_modules empty: name the "
                              f"projections to adapt (or all-linear)")
        if self.rollout.weight_delivery == "sharded":
            raise ConfigError(f"actor.lora.rank={lora.rank} with rollout.weight_delivery=sharded: the resharder sends "
                              "the base weights' shards as they are, not merged with the adapters; use full")
        if self.sft.steps and self.algorithm.kl_coef > 0:
            raise ConfigError(f"actor.lora.rank={lora.rank} with sft.steps={self.sft.steps} and algorithm.kl_coef="
                              f"{self.algorithm.kl_coef}: the LoRA policy's KL reference is the base model (adapters "
                              "off), not the warm-started policy")

    @staticmethod
    def _validate_experts_and_stages(role: str, p) -> None:
        """Expert parallelism (ep x etp within a pipeline stage) and uneven pipeline stages, as far as they can
        be judged without the model (megarl/config/model_layout.py checks them against its config.json)."""
        etp = p.etp or p.tp
        stage_ranks = p.tp * p.cp * p.dp
        if stage_ranks % (p.ep * etp):
            raise ConfigError(f"{role}.parallel.ep * {role}.parallel.etp = {p.ep} * {etp} must divide the {stage_ranks} "
                              f"ranks of a pipeline stage ({role}.parallel.tp * cp * dp = {p.tp} * {p.cp} * {p.dp}): "
                              f"experts are split over ep x etp ranks and replicated over the rest")
        first, last = p.pp_first_stage_layers, p.pp_last_stage_layers
        for key, value in (("pp_first_stage_layers", first), ("pp_last_stage_layers", last)):
            if value and p.pp < 2:
                raise ConfigError(f"{role}.parallel.{key}={value}: uneven pipeline stages need {role}.parallel.pp > 1 "
                                  f"(got {p.pp})")
            if value % p.vpp:
                raise ConfigError(f"{role}.parallel.{key}={value} is not divisible by {role}.parallel.vpp={p.vpp} "
                                  "(each virtual stage of it holds an equal share)")

    def _validate_optimizer_and_recompute(self, role: str, section_) -> None:
        if section_.optimizer_cpu_offload and not section_.use_distributed_optimizer:
            raise ConfigError(f"{role}.optimizer_cpu_offload=true needs {role}.use_distributed_optimizer=true "
                              "(megatron offloads the distributed optimizer's state)")
        if section_.optimizer_cpu_offload and self.trainer.save_every:
            raise ConfigError(f"{role}.optimizer_cpu_offload=true with trainer.save_every={self.trainer.save_every}: "
                              "megatron-core 0.16.1's offloading optimizer cannot write or load checkpoints "
                              "(megarl/engine/checkpoint.py says why)")
        modules = section_.recompute_modules
        if modules and section_.recompute != "selective":
            raise ConfigError(f"{role}.recompute_modules={modules} needs {role}.recompute=selective (got "
                              f"{section_.recompute!r})")
        for module in modules:
            if module == "moe_act":
                raise ConfigError(f"{role}.recompute_modules: moe_act needs megatron's grouped-GEMM experts, which "
                                  "megarl's models do not use; recompute moe (the whole MoE layer) instead")
            if module not in RECOMPUTE_MODULES:
                raise ConfigError(f"{role}.recompute_modules: {module!r} is not one of {', '.join(RECOMPUTE_MODULES)}")
            if module in RECOMPUTE_NEEDS_TE and importlib.util.find_spec("transformer_engine") is None:
                raise ConfigError(f"{role}.recompute_modules: megatron recomputes {module} with TransformerEngine, "
                                  "which is not installed here")
