"""Typed configuration: every option is a dataclass field with a default and a one-line help.

A run's config is built from the defaults below, then a YAML recipe, then dotted `key=value`
overrides from the command line. Unknown keys, ill-typed values and inconsistent layouts are errors
that name the key (and, for a typo, the closest valid key).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A bad option: the message names the key."""


def opt(default, help: str):
    """A config field with its help text (shown by `--help`)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def section(cls, help: str):
    return field(default_factory=cls, metadata={"help": help})


@dataclass
class ModelConfig:
    path: str = opt("tiny", "HF model directory (config.json, safetensors, tokenizer), or 'tiny' to build the "
                            "built-in tiny Qwen2 model offline under trainer.output_dir")
    tiny_hidden_size: int = opt(64, "hidden size of the built-in tiny model")
    tiny_num_layers: int = opt(2, "layers of the built-in tiny model")
    tiny_num_heads: int = opt(4, "attention heads of the built-in tiny model")
    tiny_num_kv_heads: int = opt(2, "key/value heads of the built-in tiny model (GQA)")
    tiny_tie_embeddings: bool = opt(True, "tie input and output embeddings of the built-in tiny model")
    tiny_intermediate_size: int = opt(0, "MLP (FFN) width of the built-in tiny model; 0 = the builder's default")
    tiny_vocab_multiple: int = opt(1, "pad the built-in tiny model's vocabulary (embedding rows past the tokenizer's) "
                                      "to a multiple of this, as real checkpoints do; rollout.weight_delivery=sharded "
                                      "into SGLang needs a multiple of 64 x rollout.sglang_tp")


@dataclass
class ParallelConfig:
    world_size: int = opt(1, "training ranks (one process each; one GPU each on GPU)")
    tp: int = opt(1, "tensor-parallel size")
    pp: int = opt(1, "pipeline-parallel size")
    ep: int = opt(1, "expert-parallel size (mixture-of-experts models): experts split over this many DP ranks")
    vpp: int = opt(1, "virtual pipeline stages per pipeline rank (interleaved 1F1B, needs pp > 1); 1 = off")
    cp: int = opt(1, "context-parallel size: every row split over this many ranks by sequence (2 * cp chunks, "
                     "row width padded to a multiple of 2 * cp), keys and values all-gathered for attention "
                     "(attention=sdpa; no TransformerEngine needed); not with ep > 1")
    sequence_parallel: bool = opt(False, "sequence parallelism over the TP group: norms, dropout and the MoE router "
                                         "run on 1/TP of the tokens (needs TP > 1; row width padded to a multiple "
                                         "of TP); required for mixture-of-experts training at TP > 1")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)


@dataclass
class OptimConfig:
    lr: float = opt(1e-5, "peak learning rate")
    min_lr: float = opt(0.0, "learning rate at the end of the decay")
    warmup_steps: int = opt(0, "linear warmup steps")
    decay_style: str = opt("constant", "learning-rate decay after warmup: constant, linear or cosine")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    adam_beta1: float = opt(0.9, "Adam beta1")
    adam_beta2: float = opt(0.999, "Adam beta2")
    adam_eps: float = opt(1e-8, "Adam epsilon")
    clip_grad: float = opt(1.0, "gradient clipping by global norm (0 disables)")


@dataclass
class ActorConfig:
    parallel: ParallelConfig = section(ParallelConfig, "training layout of the policy")
    optim: OptimConfig = section(OptimConfig, "optimizer of the policy")
    micro_batch_size: int = opt(8, "sequences per micro-batch in forward/backward")
    mini_batch_size: int = opt(0, "sequences per optimizer step; 0 = the whole step's batch in one update")
    ppo_epochs: int = opt(1, "passes over each step's batch")
    precision: str = opt("auto", "auto (bf16 on GPU, fp32 on CPU), bf16 or fp32")
    use_distributed_optimizer: bool = opt(False, "megatron's distributed optimizer: optimizer state and fp32 main "
                                                 "weights sharded over data-parallel ranks")
    max_tokens_per_micro_batch: int = opt(0, "pack whole sequences (no padding) into micro-batches of at most this "
                                             "many tokens, balanced over DP ranks; 0 = micro_batch_size padded rows")
    recompute: str = opt("none", "activation recompute: none, full (each layer's activations) or selective "
                                 "(core attention only)")
    attention: str = opt("auto", "core attention: auto (varlen on GPU, local on CPU), varlen (PyTorch SDPA; packed "
                                 "rows by flash attention over cu_seqlens, torch.nn.attention.varlen), sdpa "
                                 "(PyTorch SDPA; packed rows by a block-diagonal mask, no flash kernel) or local "
                                 "(megatron's unfused DotProductAttention)")


@dataclass
class CriticConfig(ActorConfig):
    path: str = opt("", "the critic's HF directory; empty = the policy's (model.path) with a zero-initialised "
                        "value head")
    value_clip: float = opt(0.5, "PPO value clipping: new values stay within this of the values before the step; "
                                 "0 = no clipping")


@dataclass
class RewardModelConfig(ActorConfig):
    path: str = opt("", "reward model HF directory (a value head, score.weight, read at the last token); empty = "
                        "the rule reward (reward.name)")


@dataclass
class AlgorithmConfig:
    advantage: str = opt("grpo", "advantage estimator (registry name in megarl.algorithms.advantages)")
    policy_loss: str = opt("ppo_clip", "policy loss (registry name in megarl.algorithms.losses)")
    loss_agg: str = opt("token-mean", "how per-token losses are reduced over the batch")
    norm_adv_by_std: bool = opt(True, "GRPO: divide group-centred rewards by the group std")
    clip_eps: float = opt(0.2, "PPO clip range (lower side, and upper unless clip_eps_high is set)")
    clip_eps_high: float = opt(0.0, "PPO clip range, upper side; 0 = clip_eps")
    clip_ratio_c: float = opt(3.0, "dual_clip loss: bound on a negative-advantage token's ratio term (> 1)")
    gspo_clip_eps: float = opt(3e-4, "GSPO clip range of the sequence ratio, lower side")
    gspo_clip_eps_high: float = opt(4e-4, "GSPO clip range of the sequence ratio, upper side")
    loss_agg_norm_len: int = opt(0, "seq-mean-token-sum-norm: the constant each sequence's token sum is "
                                    "divided by (Dr. GRPO: the max response length)")
    tis: bool = opt(False, "truncated importance sampling: weight the policy loss by min(exp(old - rollout "
                           "logprob), tis_cap) to correct the rollout/training log-prob mismatch")
    tis_cap: float = opt(2.0, "truncated importance sampling: upper bound of the weight")
    recompute_old_logprobs: str = opt("auto", "the old policy's log-probs by a forward pass of their own before "
                                              "training: always; never (the training forward's, detached: exact "
                                              "when the step makes one optimizer update); auto = never exactly "
                                              "when one update per step and no KL in the reward")
    kl_coef: float = opt(0.0, "coefficient of the KL to the reference policy; 0 = no reference model")
    kl_in_reward: bool = opt(False, "apply the KL as a per-token reward penalty (gae, reinforce_plus_plus, "
                                    "remax) instead of a loss term")
    kl_estimator: str = opt("k3", "KL estimator: k1, k2 or k3")
    kl_target: float = opt(0.0, "adaptive KL coefficient: the per-token KL to steer towards; 0 = fixed kl_coef")
    kl_horizon: int = opt(10000, "adaptive KL coefficient: horizon of the update, in samples")
    entropy_coef: float = opt(0.0, "entropy bonus coefficient")
    gamma: float = opt(1.0, "discount of token-level returns (gae, reinforce_plus_plus)")
    lam: float = opt(0.95, "GAE lambda")
    dynamic_sampling: bool = opt(False, "DAPO: drop groups whose rewards are all equal and generate more prompts "
                                        "to refill the step's batch")
    max_sampling_rounds: int = opt(3, "DAPO dynamic sampling: most generation rounds per step; a batch still short "
                                      "then is filled up with dropped groups (zero advantage under grpo)")
    overlong_buffer_len: int = opt(0, "DAPO overlong shaping: penalty ramp over the last N tokens of "
                                      "rollout.max_new_tokens; 0 = off")
    overlong_penalty_factor: float = opt(1.0, "DAPO overlong shaping: penalty at the full length")


@dataclass
class RolloutConfig:
    engine: str = opt("hf", "rollout engine: hf (transformers, CPU/debug) or sglang (GPU)")
    n_samples: int = opt(8, "responses per prompt (the GRPO group size)")
    max_new_tokens: int = opt(16, "response length limit")
    temperature: float = opt(1.0, "sampling temperature for training rollouts")
    top_p: float = opt(1.0, "nucleus sampling for training rollouts")
    ignore_eos: bool = opt(False, "generate max_new_tokens for every response, past the tokenizer's EOS (benchmarks "
                                  "with fixed lengths); stop_token_ids still stop")
    eval_temperature: float = opt(0.0, "sampling temperature for validation (0 = greedy)")
    eval_n_samples: int = opt(1, "responses per held-out prompt; val/reward is their mean (mean@k)")
    num_cpus: float = opt(1.0, "CPUs reserved for the rollout actor")
    sglang_mem_fraction: float = opt(0.4, "SGLang: GPU memory fraction for its weights and KV cache")
    sglang_tp: int = opt(1, "SGLang: tensor-parallel size of each server (one server per group of GPUs); also the "
                            "generation TP that rollout.weight_delivery=sharded cuts the policy into")
    sglang_gpus: int = opt(0, "SGLang: GPUs reserved for the servers apart from the training ranks' (disaggregated: "
                              "one server per rollout.sglang_tp of them, weights broadcast over NCCL, no offload "
                              "cycle; rollout.sglang_mem_fraction may then take most of each GPU); 0 = the servers "
                              "share the training ranks' GPUs (colocated, weights by CUDA IPC)")
    weight_delivery: str = opt("full", "weight sync through megarl.parallel.reshard: full (whole HF tensors per bucket "
                                       "from one rank; the engine slices its own TP shard, as SGLang's "
                                       "update_weights_from_tensor does) or sharded (each generation TP rank sends only "
                                       "its rows into engines that load pre-sharded tensors: the hf engine, or "
                                       "SGLang colocated with rollout.sglang_tp = actor TP and PP=1, each TP rank's "
                                       "shard by CUDA IPC from the training rank on its GPU)")
    sglang_weight_format: str = opt("persistent", "SGLang: CUDA IPC weight payload per bucket: persistent (two "
                                    "reused flat buffers SGLang keeps mapped: the fastest, and the one that works "
                                    "into a TP>1 server), flattened_bucket (SGLang's one flat buffer per bucket; "
                                    "crashed a TP=2 server in sglang 0.5.17) or tensors (one handle per tensor)")
    sglang_args: list = opt([], "SGLang: extra sglang.launch_server arguments, e.g. [--attention-backend, fa3]; they "
                                "come after megarl's own and override its defaults (triton attention, pytorch "
                                "sampling, decode CUDA graphs up to each server's share of the step's batch when "
                                "that passes SGLang's 256 rows); the ones megarl manages are refused")
    deterministic: bool = opt(False, "SGLang: deterministic inference (--enable-deterministic-inference: batch-invariant "
                                     "kernels, attention backend triton (megarl's), fa3 or flashinfer) and a sampling "
                                     "seed per response from (trainer.seed, policy version, prompt, sample), so a "
                                     "resumed run regenerates the uninterrupted run's responses; costs throughput. Off, "
                                     "a resumed SGLang run is not reproducible (it samples other responses). The hf "
                                     "engine is always reproducible")
    dump_dir: str = opt("", "write every training step's scored samples (tokens, masks, log-probs, rewards, tool "
                            "calls) to <dump_dir>/step_<N>.pt; empty = off")
    replay_dir: str = opt("", "train from the samples a run wrote with dump_dir (step N reads step_<N>.pt) "
                              "instead of generating them; empty = off")


@dataclass
class AgentConfig:
    """Multi-turn, tool-using rollouts (megarl/rollout/agent.py), for training and evaluation."""
    enabled: bool = opt(False, "roll out with the multi-turn agent loop (tool calls between model turns) instead of "
                               "one generation per sample")
    tools: list = opt([], "tools the model may call: registry names (calculator, python, retrieval) or "
                          "package.module:Class, or {name: ..., <constructor options>} dicts")
    parser: str = opt("hermes", "tool-call parser: registry name or package.module:function")
    max_turns: int = opt(4, "model turns per conversation")
    max_response_tokens: int = opt(1024, "token budget of everything after the prompt: model turns and tool results")
    max_new_tokens_per_turn: int = opt(256, "tokens one model turn may generate")
    max_tool_calls_per_turn: int = opt(4, "tool calls run per turn; further ones are ignored")
    tool_timeout_s: float = opt(10.0, "a tool call running longer becomes an error observation")
    max_observation_chars: int = opt(1024, "each tool result is cut to this many characters before rendering")
    max_concurrent: int = opt(64, "conversations in flight at once")
    observation_template: str = opt("", "how tool results are rendered, as text with a {result} field (one per "
                                        "call); empty = the tokenizer's chat template (tool messages), or "
                                        "'\\n<tool_response>\\n{result}\\n</tool_response>\\n' without one")
    oversample_groups: int = opt(0, "over-sampling: start this many groups more than data.prompts_per_step and "
                                    "abort the rest once enough are complete (with algorithm.dynamic_sampling, "
                                    "only groups whose rewards differ count); 0 = off")
    partial: str = opt("resume", "over-sampling: what happens to the aborted groups' unfinished conversations: "
                                 "resume (continued in the next step, keeping their policy_version) or drop")


@dataclass
class DataConfig:
    task: str = opt("reverse", "built-in synthetic task (reverse, add) or a .jsonl/.parquet prompt file")
    val_task: str = opt("", "held-out prompt file; empty = a held-out split of the built-in task")
    prompts_per_step: int = opt(8, "prompts per RL step")
    val_size: int = opt(64, "held-out prompts scored at each evaluation")
    min_len: int = opt(3, "built-in tasks: shortest operand")
    max_len: int = opt(5, "built-in tasks: longest operand")
    chat_template: bool = opt(False, "render prompts with the tokenizer's chat template (a string prompt becomes "
                                     "one user message; a prompt given as a list of messages always is rendered)")
    system_prompt: str = opt("", "with chat_template: a system message put before each prompt; empty = none")
    skip_malformed: bool = opt(False, "prompt files: skip (and count) malformed rows instead of stopping with an "
                                      "error that names the file and row")


@dataclass
class RewardConfig:
    name: str = opt("", "reward function: registry name (gsm8k, gsm8k_flexible, math, countdown, code, remote, "
                        "...) or package.module:function; empty = the built-in task's own")
    timeout_s: float = opt(30.0, "a reward call running longer scores 0 and is counted as failed; 0 = no limit")
    batch_timeout_s: float = opt(1800.0, "a batch's reward calls all together: calls not finished when it runs out "
                                         "score 0 and are counted as failed; 0 = no limit")
    num_workers: int = opt(1, "reward calls run at once (reward processes, or threads with isolation=none and for "
                              "remote and code rewards); 1 = one by one")
    isolation: str = opt("process", "where a reward function runs: process (the default, because only a process can "
                                    "be killed: a reward stuck inside a C call, which no signal or thread timeout "
                                    "interrupts, would hang the run; the call's process is killed and replaced at "
                                    "timeout_s) or none (the driver's process: for rewards that cannot be pickled, "
                                    "e.g. closures or objects holding locks); remote, code and reward-model rewards "
                                    "bound their own calls and always run in the driver")
    max_failure_rate: float = opt(0.5, "stop the run (with the reward's own first error and its sample) when more "
                                       "than this fraction of reward calls failed over the last failure_window steps, "
                                       "or in one evaluation: past half, the rewards say more about the reward than "
                                       "the policy; 1 = never stop")
    failure_window: int = opt(5, "steps over which reward.max_failure_rate is judged (fewer at the start of a run); "
                                 "a longer window lets a short outage pass")
    remote_url: str = opt("", "remote reward: the URL that receives a JSON POST per sample")
    remote_timeout_s: float = opt(10.0, "remote reward: timeout of one HTTP request")
    remote_retries: int = opt(3, "remote reward: retries after a connection error, a timeout or a 5xx/429 answer")
    remote_max_timeouts: int = opt(3, "remote reward: after this many requests in a row time out, the rest of the "
                                      "batch fails at once (counted, the server named); the next batch tries again")
    code_timeout_s: float = opt(5.0, "code reward: wall-clock limit of one test run in the sandbox")
    code_memory_mb: int = opt(1024, "code reward: memory of one test run in the sandbox, all its processes together "
                                    "(a memory cgroup where the host allows one; else one process)")
    code_sandbox: str = opt("auto", "code reward: sandbox mode: auto (bwrap, else namespaces; an error if neither "
                                    "works), bwrap, namespaces, or rlimits (no network or caller isolation: only "
                                    "when named here)")


@dataclass
class SFTConfig:
    steps: int = opt(0, "supervised warm-start steps before RL (0 = none)")
    batch_size: int = opt(32, "sequences per SFT step")
    lr: float = opt(1e-3, "SFT learning rate")
    data: str = opt("", "SFT examples: empty = the task's reference answers; or a .jsonl of multi-turn traces "
                        "{prompt, messages: [{role: assistant|tool, content}]} (scripts/make_tool_traces.py), "
                        "trained on the assistant turns only")


@dataclass
class TrainerConfig:
    steps: int = opt(10, "RL steps")
    eval_every: int = opt(5, "evaluate on the held-out set every N steps (and before RL)")
    output_dir: str = opt("runs/default", "where TensorBoard events, metrics.jsonl and the tiny model go")
    seed: int = opt(1, "random seed")
    device: str = opt("auto", "auto, cpu or cuda")
    threads_per_rank: int = opt(1, "torch threads per training rank (CPU)")
    cpus_per_rank: float = opt(0.5, "Ray CPUs reserved per training rank")
    loggers: list = opt(["console", "tensorboard", "jsonl"], "where metrics go")
    sync_bucket_mb: int = opt(1024, "weight-sync bucket size in MiB: the most extra memory a sync takes on a sending "
                                    "rank (plus SGLang's two persistent buffers of ~half a bucket each); fewer, "
                                    "larger buckets sync faster (7B into SGLang on an H200: 2048 MiB 0.18 s, "
                                    "8192 MiB 0.13 s; docs/benchmarks.md)")
    verify_weight_sync_every: int = opt(1, "check the rollout engine's weights equal Megatron's bit for bit after the "
                                           "first weight sync and every N-th one after it (checksums of every "
                                           "parameter, computed inside SGLang's TP workers on their GPUs, against "
                                           "the sender's: ~1% of a 0.5B GSM8K step, docs/benchmarks.md); 1: every "
                                           "sync, 0: never")
    verify_weight_sync_deep: bool = opt(False, "verification also has SGLang reload the sync from a safetensors file "
                                               "with its own loader and compare (writes the whole model each time: "
                                               "for debugging a weight layout, not for long runs)")
    offload_between_phases: str = opt("auto", "colocated memory cycle: during rollouts the training engines park "
                                              "weights, grads and optimizer state in host memory and the rollout "
                                              "engine releases its memory during training; auto (on for sglang on "
                                              "GPU), always (CPU too) or never")
    ray_address: str = opt("", "Ray cluster to join; empty = start a local one")
    placement: str = opt("pack", "how training ranks spread over Ray nodes: pack, spread or strict_spread "
                                 "(Ray placement-group strategies)")
    save_every: int = opt(0, "write a checkpoint every N RL steps and after the last one; 0 = never")
    checkpoint_dir: str = opt("", "where checkpoints go; empty = <output_dir>/checkpoints")
    resume: str = opt("auto", "auto (the newest complete checkpoint in checkpoint_dir, if any), none, or the path "
                              "of a checkpoint (or of a directory of checkpoints)")
    keep_last: int = opt(2, "complete checkpoints kept (older ones are deleted); 0 = keep all")
    skip_nonfinite_updates: bool = opt(False, "an optimizer update whose loss (any micro-batch, any rank) or gradient "
                                              "norm is NaN or infinite is skipped (weights and optimizer state "
                                              "untouched, the LR schedule still advances; counted in "
                                              "train/skipped_updates) instead of stopping the run with an error that "
                                              "names the step, rank and micro-batch")
    worker_timeout_s: float = opt(1800.0, "deadline in seconds for every driver call to a training rank or the "
                                          "rollout actor (a whole generate, train or checkpoint call); past it the run "
                                          "names the silent rank and the call, kills every rank and server and exits "
                                          "non-zero. 30 min: far longer than any healthy call (a 671B step's train "
                                          "or checkpoint call takes minutes), as long as the ranks' own collective "
                                          "timeout (megarl/parallel/state.py). 0 = wait forever")


@dataclass
class Config:
    model: ModelConfig = section(ModelConfig, "policy model")
    actor: ActorConfig = section(ActorConfig, "policy training")
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "advantages and losses")
    rollout: RolloutConfig = section(RolloutConfig, "generation")
    data: DataConfig = section(DataConfig, "prompts")
    reward: RewardConfig = section(RewardConfig, "reward")
    critic: CriticConfig = section(CriticConfig, "the critic (algorithm.advantage=gae): its own layout and optimizer")
    reward_model: RewardModelConfig = section(RewardModelConfig, "a reward model (used when reward_model.path is set)")
    agent: AgentConfig = section(AgentConfig, "multi-turn, tool-using rollouts")
    sft: SFTConfig = section(SFTConfig, "supervised warm start")
    trainer: TrainerConfig = section(TrainerConfig, "the loop")

    def validate(self) -> "Config":
        self._validate_engine_options()
        p = self.actor.parallel
        for key, value in (("actor.parallel.world_size", p.world_size), ("actor.parallel.tp", p.tp),
                           ("actor.parallel.pp", p.pp)):
            if value < 1:
                raise ConfigError(f"{key}={value}: must be >= 1")
        if p.ep < 1 or p.dp % p.ep:
            raise ConfigError(f"actor.parallel.ep={p.ep} must be >= 1 and divide the data-parallel size {p.dp}")
        batch = self.data.prompts_per_step * self.rollout.n_samples
        mini = self.actor.mini_batch_size or batch
        if batch % mini:
            raise ConfigError(f"actor.mini_batch_size={mini} does not divide the step's batch "
                              f"(data.prompts_per_step * rollout.n_samples = {batch})")
        if mini % p.dp:
            raise ConfigError(f"actor.mini_batch_size={mini} is not divisible by the data-parallel size {p.dp}")
        choices = {"actor.precision": (self.actor.precision, ("auto", "bf16", "fp32")),
                   "trainer.device": (self.trainer.device, ("auto", "cpu", "cuda")),
                   "trainer.placement": (self.trainer.placement, ("pack", "spread", "strict_spread")),
                   "algorithm.kl_estimator": (self.algorithm.kl_estimator, ("k1", "k2", "k3")),
                   "actor.optim.decay_style": (self.actor.optim.decay_style, ("constant", "linear", "cosine")),
                   "rollout.engine": (self.rollout.engine, ("hf", "sglang")),
                   "rollout.sglang_weight_format": (self.rollout.sglang_weight_format,
                                                    ("tensors", "flattened_bucket", "persistent")),
                   "rollout.weight_delivery": (self.rollout.weight_delivery, ("full", "sharded")),
                   "trainer.offload_between_phases": (self.trainer.offload_between_phases,
                                                      ("auto", "always", "never")),
                   "algorithm.recompute_old_logprobs": (self.algorithm.recompute_old_logprobs,
                                                        ("auto", "always", "never"))}
        for key, (value, allowed) in choices.items():
            if value not in allowed:
                raise ConfigError(f"{key}={value!r}: must be one of {', '.join(allowed)}")
        self._validate_weight_delivery()
        self._validate_sglang_args()
        self._validate_disaggregated()
        a = self.algorithm
        if a.policy_loss == "dual_clip" and a.clip_ratio_c <= 1:
            raise ConfigError(f"algorithm.clip_ratio_c={a.clip_ratio_c}: must be > 1 for the dual_clip loss")
        if a.loss_agg == "seq-mean-token-sum-norm" and a.loss_agg_norm_len < 1:
            raise ConfigError("algorithm.loss_agg=seq-mean-token-sum-norm needs algorithm.loss_agg_norm_len >= 1 "
                              "(e.g. rollout.max_new_tokens)")
        if a.recompute_old_logprobs == "never" and not self.old_policy_is_the_trained_one():
            raise ConfigError("algorithm.recompute_old_logprobs=never needs one optimizer update per step "
                              f"(actor.ppo_epochs=1 and actor.mini_batch_size 0 or the step's batch; got "
                              f"{self.actor.ppo_epochs} epoch(s) of mini-batches of {mini} from {batch} samples) "
                              "and no algorithm.kl_in_reward (its KL reads the old log-probs before training)")
        if a.tis and a.tis_cap <= 0:
            raise ConfigError(f"algorithm.tis_cap={a.tis_cap}: must be > 0")
        for key, value in (("algorithm.gamma", a.gamma), ("algorithm.lam", a.lam)):
            if not 0 <= value <= 1:
                raise ConfigError(f"{key}={value}: must be in [0, 1]")
        if a.kl_target < 0 or a.kl_horizon < 1 or (a.kl_target > 0 and a.kl_coef <= 0):
            raise ConfigError(f"adaptive KL needs algorithm.kl_target >= 0, kl_horizon >= 1 and, when kl_target > 0, "
                              f"an initial kl_coef > 0; got {a.kl_target}, {a.kl_horizon}, {a.kl_coef}")
        t = self.trainer
        if t.save_every < 0 or t.keep_last < 0 or not t.resume:
            raise ConfigError(f"trainer.save_every={t.save_every} and trainer.keep_last={t.keep_last} must be >= 0 "
                              f"and trainer.resume={t.resume!r} one of auto, none or a path")
        if t.worker_timeout_s < 0:
            raise ConfigError(f"trainer.worker_timeout_s={t.worker_timeout_s}: must be >= 0 (0 = no deadline)")
        if t.verify_weight_sync_every < 0:
            raise ConfigError(f"trainer.verify_weight_sync_every={t.verify_weight_sync_every}: must be >= 0")
        if a.max_sampling_rounds < 1:
            raise ConfigError(f"algorithm.max_sampling_rounds={a.max_sampling_rounds}: must be >= 1")
        self._validate_data_and_reward()
        self._validate_agent()
        if not 0 <= a.overlong_buffer_len <= self.rollout.max_new_tokens:
            raise ConfigError(f"algorithm.overlong_buffer_len={a.overlong_buffer_len}: must be in "
                              f"[0, rollout.max_new_tokens={self.rollout.max_new_tokens}]")
        for key, value in (("rollout.n_samples", self.rollout.n_samples),
                           ("rollout.max_new_tokens", self.rollout.max_new_tokens),
                           ("data.prompts_per_step", self.data.prompts_per_step),
                           ("actor.micro_batch_size", self.actor.micro_batch_size),
                           ("model.tiny_vocab_multiple", self.model.tiny_vocab_multiple)):
            if value < 1:
                raise ConfigError(f"{key}={value}: must be >= 1")
        return self

    def old_policy_is_the_trained_one(self) -> bool:
        """One optimizer update per step and nothing reading the old log-probs before it: the policy the
        update starts from is the old policy, so its training forward gives the old log-probs (detached)."""
        batch = self.data.prompts_per_step * self.rollout.n_samples
        one_update = self.actor.ppo_epochs == 1 and self.actor.mini_batch_size in (0, batch)
        return one_update and not (self.algorithm.kl_coef > 0 and self.algorithm.kl_in_reward)

    def recompute_old_logprobs(self) -> bool:
        """Whether the step runs a forward pass of its own for the old log-probs (algorithm.recompute_old_logprobs)."""
        mode = self.algorithm.recompute_old_logprobs
        return mode == "always" or (mode == "auto" and not self.old_policy_is_the_trained_one())

    def _validate_disaggregated(self) -> None:
        r = self.rollout
        if r.sglang_gpus < 0:
            raise ConfigError(f"rollout.sglang_gpus={r.sglang_gpus}: must be >= 0 (0 = colocated)")
        if not r.sglang_gpus:
            return
        if r.engine != "sglang":
            raise ConfigError(f"rollout.sglang_gpus={r.sglang_gpus} reserves GPUs for SGLang servers: it needs "
                              f"rollout.engine=sglang (got {r.engine})")
        if r.sglang_tp < 1 or r.sglang_gpus % r.sglang_tp:
            raise ConfigError(f"rollout.sglang_gpus={r.sglang_gpus} must be a multiple of rollout.sglang_tp="
                              f"{r.sglang_tp} (one server per rollout.sglang_tp GPUs)")
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
        from megarl.rollout.sglang import DETERMINISTIC_ATTENTION_BACKENDS, attention_backend, managed_args
        managed = managed_args(r.sglang_args)
        if managed:
            raise ConfigError(f"rollout.sglang_args: {', '.join(managed)} is set by megarl (from rollout.sglang_tp, "
                              f"rollout.sglang_mem_fraction, rollout.deterministic, actor.precision, the GPUs and the weight loader)")
        backend = attention_backend(r.sglang_args)
        if r.deterministic and backend not in DETERMINISTIC_ATTENTION_BACKENDS:
            raise ConfigError(f"rollout.deterministic=true with rollout.sglang_args' --attention-backend {backend}: "
                              f"SGLang's deterministic inference runs on {', '.join(DETERMINISTIC_ATTENTION_BACKENDS)}")

    def _validate_weight_delivery(self) -> None:
        r, p = self.rollout, self.actor.parallel
        if r.weight_delivery != "sharded":
            return
        if r.engine == "sglang" and (r.sglang_gpus or r.sglang_tp != p.tp or p.pp > 1):
            raise ConfigError(
                f"rollout.weight_delivery=sharded with rollout.engine=sglang needs colocated servers "
                f"(rollout.sglang_gpus=0, got {r.sglang_gpus}: the shards go by CUDA IPC from the training ranks' GPUs), "
                f"rollout.sglang_tp = actor.parallel.tp (got {r.sglang_tp} and {p.tp}: each of the first TP group's "
                f"ranks then holds exactly its SGLang rank's shard) and actor.parallel.pp=1 (got {p.pp}); "
                f"otherwise use rollout.weight_delivery=full")
        g = r.sglang_tp
        if g < 1 or p.world_size % g or (p.tp % g and g % p.tp):
            raise ConfigError(f"rollout.weight_delivery=sharded: rollout.sglang_tp={g} (the generation TP) must divide "
                              f"actor.parallel.world_size={p.world_size} and divide or be a multiple of "
                              f"actor.parallel.tp={p.tp}")
        if p.vpp > 1 or p.ep > 1:
            raise ConfigError("rollout.weight_delivery=sharded: the resharder models TP x PP x DP layouts; "
                              "actor.parallel.vpp and actor.parallel.ep must be 1")

    def _validate_data_and_reward(self) -> None:
        r = self.reward
        if not r.name and self.data.task.endswith((".jsonl", ".parquet")):
            raise ConfigError(f"data.task={self.data.task!r} is a prompt file: set reward.name (e.g. gsm8k, math)")
        if r.name == "remote" and not r.remote_url:
            raise ConfigError("reward.name=remote needs reward.remote_url")
        if r.code_sandbox not in ("auto", "bwrap", "namespaces", "rlimits"):
            raise ConfigError(f"reward.code_sandbox={r.code_sandbox!r}: must be auto, bwrap, namespaces or rlimits")
        for key, value in (("reward.timeout_s", r.timeout_s), ("reward.remote_retries", r.remote_retries),
                           ("reward.batch_timeout_s", r.batch_timeout_s)):
            if value < 0:
                raise ConfigError(f"{key}={value}: must be >= 0")
        for key, value in (("reward.num_workers", r.num_workers), ("reward.remote_timeout_s", r.remote_timeout_s),
                           ("reward.code_timeout_s", r.code_timeout_s), ("reward.code_memory_mb", r.code_memory_mb),
                           ("reward.failure_window", r.failure_window),
                           ("reward.remote_max_timeouts", r.remote_max_timeouts)):
            if value <= 0:
                raise ConfigError(f"{key}={value}: must be > 0")
        if not 0 <= r.max_failure_rate <= 1:
            raise ConfigError(f"reward.max_failure_rate={r.max_failure_rate}: must be in [0, 1]")
        if r.isolation not in ("process", "none"):
            raise ConfigError(f"reward.isolation={r.isolation!r}: must be process or none")

    def _validate_agent(self) -> None:
        g = self.agent
        for key, value in (("agent.max_turns", g.max_turns), ("agent.max_response_tokens", g.max_response_tokens),
                           ("agent.max_new_tokens_per_turn", g.max_new_tokens_per_turn),
                           ("agent.max_tool_calls_per_turn", g.max_tool_calls_per_turn),
                           ("agent.max_concurrent", g.max_concurrent), ("agent.tool_timeout_s", g.tool_timeout_s),
                           ("agent.max_observation_chars", g.max_observation_chars)):
            if value <= 0:
                raise ConfigError(f"{key}={value}: must be > 0")
        for i, tool in enumerate(g.tools):
            if not (isinstance(tool, str) or (isinstance(tool, dict) and isinstance(tool.get("name"), str))):
                raise ConfigError(f"agent.tools[{i}]={tool!r}: must be a name or a dict with a 'name'")
        if g.observation_template and "{result}" not in g.observation_template:
            raise ConfigError(f"agent.observation_template={g.observation_template!r} has no {{result}} field")
        if g.partial not in ("resume", "drop"):
            raise ConfigError(f"agent.partial={g.partial!r}: must be resume or drop")
        if g.oversample_groups < 0 or (g.oversample_groups and not g.enabled):
            raise ConfigError(f"agent.oversample_groups={g.oversample_groups}: must be >= 0, and needs "
                              "agent.enabled=true")
        if g.oversample_groups and self.algorithm.advantage == "remax":
            raise ConfigError("agent.oversample_groups does not combine with algorithm.advantage=remax")
        if self.rollout.dump_dir and self.rollout.replay_dir:
            raise ConfigError("rollout.dump_dir and rollout.replay_dir are exclusive: a replay writes no dump")

    def _validate_engine_options(self) -> None:
        """Each training role's layout and engine options (the actor's batch sizes are checked below)."""
        roles = {"actor": self.actor, "critic": self.critic, "reward_model": self.reward_model}
        for role, section_ in roles.items():
            p = section_.parallel
            for key, value in (("vpp", p.vpp), ("cp", p.cp), ("world_size", p.world_size), ("tp", p.tp),
                               ("pp", p.pp)):
                if value < 1:
                    raise ConfigError(f"{role}.parallel.{key}={value}: must be >= 1")
            if section_.max_tokens_per_micro_batch < 0:
                raise ConfigError(f"{role}.max_tokens_per_micro_batch={section_.max_tokens_per_micro_batch}: "
                                  "must be >= 0")
            if p.vpp > 1 and p.pp < 2:
                raise ConfigError(f"{role}.parallel.vpp={p.vpp} needs {role}.parallel.pp > 1")
            if p.world_size % (p.tp * p.pp * p.cp):
                raise ConfigError(f"{role}.parallel.world_size={p.world_size} is not divisible by {role}.parallel.tp "
                                  f"* {role}.parallel.pp * {role}.parallel.cp = {p.tp}*{p.pp}*{p.cp}")
            if p.cp > 1 and p.ep > 1:
                raise ConfigError(f"{role}.parallel.cp={p.cp} with {role}.parallel.ep={p.ep}: context parallelism "
                                  "with expert parallelism is not supported")
            if p.cp > 1 and section_.attention not in ("auto", "sdpa"):
                raise ConfigError(f"{role}.attention={section_.attention!r} does not run context parallelism "
                                  f"({role}.parallel.cp={p.cp}): use sdpa or auto")
            for key, allowed in (("recompute", ("none", "full", "selective")),
                                 ("attention", ("auto", "varlen", "sdpa", "local"))):
                if getattr(section_, key) not in allowed:
                    raise ConfigError(f"{role}.{key}={getattr(section_, key)!r}: must be one of {', '.join(allowed)}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# Building a Config from YAML and overrides


def _fields(obj) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj)}


def _unknown(key: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(valid))}"
    return ConfigError(f"unknown config key '{key}'{hint}")


def all_keys(obj=None, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the config."""
    obj = obj if obj is not None else Config()
    keys = []
    for name, f in _fields(obj).items():
        value = getattr(obj, name)
        if dataclasses.is_dataclass(value):
            keys += all_keys(value, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def _coerce(key: str, value: Any, annotation) -> Any:
    """Check (and gently convert) a value against a field's annotation."""
    hint = typing.get_type_hints(annotation[0])[annotation[1]] if isinstance(annotation, tuple) else annotation
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
        if value is None:
            return None
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    elif hint is list or typing.get_origin(hint) is list:
        if isinstance(value, list):
            return value
        if isinstance(value, str):
            return [v for v in value.split(",") if v]
    else:
        return value
    raise ConfigError(f"config key '{key}' expects {getattr(hint, '__name__', hint)}, got {value!r}")


def _set(cfg, key: str, value: Any) -> None:
    parts = key.split(".")
    obj = cfg
    for i, part in enumerate(parts):
        names = _fields(obj)
        if part not in names:
            raise _unknown(key, all_keys())
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(getattr(obj, part)):
                if not isinstance(value, dict):
                    raise ConfigError(f"config key '{key}' is a section; set its keys, e.g. {key}.<name>=...")
                for sub, v in value.items():
                    _set(cfg, f"{key}.{sub}", v)
            else:
                setattr(obj, part, _coerce(key, value, (type(obj), part)))
        else:
            obj = getattr(obj, part)
            if not dataclasses.is_dataclass(obj):
                raise ConfigError(f"config key '{'.'.join(parts[:i + 1])}' is not a section")


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults <- YAML recipe <- `key=value` overrides, then validation."""
    cfg = Config()
    if path:
        path = Path(path)
        data = _read_yaml(path) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of config sections at the top level")
        for key, value in _flatten(data).items():
            _set(cfg, key, value)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override '{item}': the value is not valid YAML ({_yaml_problem(e)})") from None
        _set(cfg, key.strip(), value)
    return cfg.validate()


def _read_yaml(path: Path):
    """The parsed recipe; a missing, unreadable or malformed file is a ConfigError naming it (and where in it)."""
    try:
        return yaml.safe_load(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot be read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        line, column = e.object.count(b"\n", 0, e.start) + 1, e.start - e.object.rfind(b"\n", 0, e.start)
        raise ConfigError(f"config file {path}: not valid UTF-8 (byte {e.object[e.start]:#04x} at line {line}, "
                          f"column {column})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path}: not valid YAML: {_yaml_problem(e)}") from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    """YAML's own account of the error, with the 1-based line and column it reports."""
    def at(mark) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    if not isinstance(e, yaml.MarkedYAMLError) or e.problem_mark is None:
        return str(e).replace("\n", " ")
    context = f" ({e.context} at {at(e.context_mark)})" if e.context and e.context_mark else ""
    return f"{e.problem} at {at(e.problem_mark)}{context}"


def help_text() -> str:
    """Every option with its default and help, for `--help`."""
    lines = []

    def walk(obj, prefix):
        for name, f in _fields(obj).items():
            value = getattr(obj, name)
            if dataclasses.is_dataclass(value):
                lines.append(f"\n[{prefix}{name}]  {f.metadata.get('help', '')}")
                walk(value, f"{prefix}{name}.")
            else:
                lines.append(f"  {prefix}{name} = {value!r}\n      {f.metadata.get('help', '')}")

    walk(Config(), "")
    return "\n".join(lines)
