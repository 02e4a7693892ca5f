"""The typed sections of a run's config: every option a dataclass field with a default and a one-line help.

`Config` holds the sections side by side; its checks across them are in megarl/config/validation.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megarl.config.validation import ConfigChecks


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
    etp: int = opt(0, "expert-tensor-parallel size (megatron's expert_tensor_parallel_size): each expert's weights "
                      "split over this many ranks, independently of tp (e.g. 1: whole experts beside TP-split "
                      "attention); ep * etp must divide the ranks of a pipeline stage (tp * cp * dp); 0 = tp")
    pp_first_stage_layers: int = opt(0, "decoder layers on the first pipeline stage (megatron's "
                                        "num_layers_in_first_pipeline_stage), for layer counts pp does not divide "
                                        "(61 over pp=8: 5, with pp_last_stage_layers=8); the stages between "
                                        "first and last split the rest evenly; 0 = an even share")
    pp_last_stage_layers: int = opt(0, "decoder layers on the last pipeline stage (megatron's "
                                       "num_layers_in_last_pipeline_stage); 0 = an even share")
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

    def describe(self) -> str:
        """The layout as the start-up line prints it, e.g. 'world_size=4 = tp 1 x pp 2 x cp 1 x dp 2 (ep 2, last
        stage 1 layers)': expert parallelism and uneven stages in brackets, when set."""
        extras = [f"ep {self.ep}"] * (self.ep > 1) + [f"vpp {self.vpp}"] * (self.vpp > 1)
        extras += [f"{which} stage {n} layers" for which, n in (("first", self.pp_first_stage_layers),
                                                                 ("last", self.pp_last_stage_layers)) if n]
        layout = f"world_size={self.world_size} = tp {self.tp} x pp {self.pp} x cp {self.cp} x dp {self.dp}"
        return layout + (f" ({', '.join(extras)})" if extras else "")


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
    optimizer_cpu_offload: bool = opt(False, "megatron's optimizer CPU offload (HybridDeviceOptimizer): Adam's "
                                             "moments (of optimizer_offload_fraction of the parameters) live in host "
                                             "memory and the update runs there (torch AdamW); the fp32 main weights "
                                             "stay on the GPU (megatron moves them too only through its "
                                             "TransformerEngine path). Needs use_distributed_optimizer; no "
                                             "checkpoints (trainer.save_every=0); on the CPU it changes nothing")
    optimizer_offload_fraction: float = opt(1.0, "with optimizer_cpu_offload: the fraction of the parameters "
                                                 "(by size) whose optimizer state is on the CPU, in (0, 1]")
    max_tokens_per_micro_batch: int = opt(0, "pack whole sequences (no padding) into micro-batches of at most this "
                                             "many tokens, balanced over DP ranks by tokens; 0 = as many as "
                                             "micro_batch_size rows of the longest sequence (packing=one_row with "
                                             "attention varlen), else micro_batch_size padded rows")
    packing: str = opt("one_row", "micro-batch layout: one_row (one row of max_tokens_per_micro_batch tokens, at 0 "
                                  "micro_batch_size x the longest sequence of the batch where attention is varlen, the "
                                  "GPU's auto, padded rows under a dense mask; holding any number of whole "
                                  "sequences; without pipeline stages cut to its used length rounded up to 64; a "
                                  "longer sequence is an error) or rows (rows as wide as the longest sequence, "
                                  "max_tokens_per_micro_batch // that many per micro-batch, at 0 micro_batch_size "
                                  "padded rows: to reproduce runs made before one_row became the default, or compare "
                                  "layouts)")
    recompute: str = opt("none", "activation recompute: none, full (each layer's activations) or selective "
                                 "(the modules in recompute_modules)")
    recompute_modules: list = opt([], "recompute=selective: megatron's modules to recompute in the backward pass: "
                                      "core_attn, moe (the whole MoE layer), shared_experts, mlp (dense MLPs), "
                                      "and with TransformerEngine installed mla_up_proj (MLA models) and layernorm; "
                                      "empty = [core_attn]")
    attention: str = opt("auto", "core attention: auto (varlen on GPU, local on CPU), varlen (PyTorch SDPA; packed "
                                 "rows by flash attention over cu_seqlens, aten's kernels), sdpa "
                                 "(PyTorch SDPA; packed rows by a block-diagonal mask, no flash kernel) or local "
                                 "(megatron's unfused DotProductAttention)")
    fused_kernels: bool = opt(True, "on GPU: SwiGLU and RoPE each one kernel (megarl's Triton kernels through "
                                    "megatron's bias_activation_fusion and apply_rope_fusion, the latter where "
                                    "TransformerEngine is absent), and the weight gradients' GEMMs adding into "
                                    "the float32 main_grad (gradient_accumulation_fusion); false: megatron's unfused "
                                    "torch ops. The CPU always runs them unfused")
    moe_router_bias_update_rate: float = opt(0.0, "DeepSeek-V3's aux-loss-free load balancing (megatron's "
                                                  "moe_router_enable_expert_bias): after each optimizer update every "
                                                  "MoE layer's e_score_correction_bias moves by this rate towards even "
                                                  "expert load and is synced to the rollout engine like a weight; "
                                                  "0 = off, the default for RL (routing keeps the checkpoint's bias; "
                                                  "DeepSeek-V3's pre-training used 1e-3)")
    freeze_vision_tower: bool = opt(False, "vision-language policies (Qwen2.5-VL): the vision tower is not trained "
                                           "(no gradients, no optimizer state); the language model is")


@dataclass
class CriticConfig(ActorConfig):
    parallel: ParallelConfig = section(ParallelConfig, "training layout of the critic")
    optim: OptimConfig = section(OptimConfig, "optimizer of the critic")
    path: str = opt("", "the critic's HF directory; empty = the policy's (model.path) with a zero-initialised "
                        "value head")
    value_clip: float = opt(0.5, "PPO value clipping: new values stay within this of the values before the step; "
                                 "0 = no clipping")


@dataclass
class RewardModelConfig(ActorConfig):
    parallel: ParallelConfig = section(ParallelConfig, "layout of the reward model's ranks (training in "
                                                       "python -m megarl.train_rm, scoring in RL)")
    optim: OptimConfig = section(OptimConfig, "optimizer of the reward model (python -m megarl.train_rm)")
    path: str = opt("", "reward model HF directory (a value head, score.weight, read at the last token); empty = "
                        "the rule reward (reward.name). python -m megarl.train_rm writes the model it trains here "
                        "(empty: <trainer.output_dir>/reward_model)")
    normalize: str = opt("none", "RL: the reward model's scores before mixing: none, running (minus the running mean, "
                                 "over the running std, of every score so far; kept in checkpoints) or group (minus "
                                 "the mean, over the std, of the prompt's group of samples)")
    weight: float = opt(1.0, "RL: a sample's reward = weight * its (normalised) reward-model score + rule_weight * "
                             "its rule reward")
    rule_weight: float = opt(0.0, "RL: weight of the rule reward (reward.name, or the task's own) mixed in; 0 = the "
                                  "reward model's score alone (the rule reward is still logged: train/rule_reward)")
    missing_eos_penalty: float = opt(0.0, "RL: subtracted from the reward model's score of a response that does not "
                                          "end with the tokenizer's EOS token (cut at rollout.max_new_tokens), before "
                                          "normalising: a reward model never trained on unfinished text can score "
                                          "it high, and a policy then learns not to stop (TRL's missing_eos_penalty)")


@dataclass
class RolloutCorrectionConfig:
    """The rollout engine's log-probs against the trainer's (megarl/algorithms/rollout_correction.py, verl's
    algorithm.rollout_correction keys), and the decoupled PPO objective."""
    rollout_is: str = opt("none", "importance weights pi_old / pi_rollout on the policy loss: none, token (one per "
                                  "token) or sequence (the product over the response, on all its tokens)")
    rollout_is_threshold: float = opt(2.0, "rollout_is: upper bound of the weight")
    rollout_is_mode: str = opt("truncate", "rollout_is: truncate (min(w, threshold): TIS) or mask (weights outside "
                                           "[rollout_is_threshold_lower, rollout_is_threshold] become 0: IcePop)")
    rollout_is_threshold_lower: float = opt(0.0, "rollout_is_mode=mask: lower bound of the weight; 0 = 1 / "
                                                 "rollout_is_threshold")
    rollout_is_batch_normalize: bool = opt(False, "rollout_is: divide the weights by their mean over the step's "
                                                  "batch (tokens, or sequences for sequence weights), so they "
                                                  "average 1")
    rollout_rs: str = opt("none", "rejection: drop from the loss the tokens or sequences whose ratio pi_old / "
                                  "pi_rollout leaves [rollout_rs_threshold_lower, rollout_rs_threshold]: none, "
                                  "token_k1 (each token's ratio), seq_sum_k1 (the sequence's product of ratios) "
                                  "or seq_mean_k1 (their geometric mean)")
    rollout_rs_threshold: float = opt(2.0, "rollout_rs: upper bound of the ratio")
    rollout_rs_threshold_lower: float = opt(0.0, "rollout_rs: lower bound of the ratio; 0 = 1 / rollout_rs_threshold")
    bypass_mode: bool = opt(False, "the rollout engine's log-probs are the old log-probs (no forward pass for them): "
                                   "a ratio loss (ppo_clip ...) then clips pi / pi_rollout; with policy_loss=reinforce "
                                   "rollout_is weights pi / pi_rollout, and rollout_rs, are computed in the loss")
    decoupled: bool = opt(False, "the decoupled PPO objective (Hilton et al. 2022, AReaL): the ratio loss clips "
                                 "pi / pi_prox (pi_prox: the old log-probs, the trainer's weights before the update) "
                                 "and each token's loss is weighted by pi_prox / pi_rollout, capped by decoupled_cap "
                                 "(async.decoupled_ppo turns it on in the asynchronous modes)")
    decoupled_cap: float = opt(5.0, "decoupled objective: bound of the weight pi_prox / pi_rollout (AReaL's "
                                    "behav_imp_weight_cap)")
    decoupled_cap_mode: str = opt("truncate", "decoupled objective: truncate (min(w, decoupled_cap)) or mask (a "
                                              "token whose weight exceeds the cap gets weight 0, as AReaL)")
    perturb_rollout_logprobs: float = opt(0.0, "testing: added to the rollout log-prob of every other response "
                                               "token (the 1st, 3rd, ... of each) of every other sample (rows 0, 2, "
                                               "... of the step's batch), so the mismatch metrics and the rejection "
                                               "have known values; 0 = off")


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
    kl_estimator: str = opt("k3", "KL estimator: k1, k2, k3 or abs (verl's kl, mse, low_var_kl: k1, k2, k3); a "
                                  "trailing '+' (k3+ ...) takes the gradient of k2 (straight through, as verl)")
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
    # VAPO (Yue et al. 2025) on top of gae: decoupled and length-adaptive GAE, value pretraining, positive LM loss
    critic_lam: float = opt(-1.0, "GAE lambda of the critic's targets (VAPO's decoupled GAE: 1.0, Monte-Carlo "
                                  "returns); -1 = algorithm.lam, the policy's")
    lam_length_alpha: float = opt(0.0, "VAPO's length-adaptive GAE: the policy's lambda per sequence is "
                                       "1 - 1 / (alpha * response length), clamped to [0, 1] (VAPO: alpha 0.05); "
                                       "0 = algorithm.lam for every sequence")
    critic_warmup_steps: int = opt(0, "VAPO's value pretraining: steps before RL that sample from the frozen policy "
                                      "and train only the critic on the returns (algorithm.critic_lam); 0 = none")
    positive_lm_coef: float = opt(0.0, "VAPO's positive-example LM loss: coefficient of the NLL of the response "
                                       "tokens of samples whose reward >= positive_lm_threshold (VAPO: 0.1); 0 = off")
    positive_lm_threshold: float = opt(1.0, "positive-example LM loss: the reward at which a sample counts as correct")
    # estimators and losses beyond PPO/GRPO (docs/configuration.md names each paper and formula)
    gpg_norm_by_std: bool = opt(False, "gpg advantage: divide by the group's std (F_norm = std) instead of 1")
    otb_zero_tail: bool = opt(True, "optimal_token_baseline: the part of a group's longest response past its "
                                    "second longest gets no baseline (verl's handle_zero_tail)")
    gmpo_clip_eps: float = opt(0.4, "gmpo loss: each token's log-ratio is clipped to [-eps, eps] (the paper's 0.4)")
    cispo_clip_eps_low: float = opt(1.0, "cispo loss: the IS weight's lower bound is 1 - eps (1 = none, MiniMax-M1)")
    cispo_clip_eps_high: float = opt(0.2, "cispo loss: the IS weight's upper bound is 1 + eps")
    sapo_tau_pos: float = opt(1.0, "sapo loss: gate temperature of tokens with a positive advantage")
    sapo_tau_neg: float = opt(1.05, "sapo loss: gate temperature of tokens with a negative or zero advantage")
    clip_cov_ratio: float = opt(2e-4, "clip_cov loss: fraction of a micro-batch's tokens whose gradient is cut")
    clip_cov_lb: float = opt(1.0, "clip_cov loss: tokens are drawn among those with covariance above this")
    clip_cov_ub: float = opt(5.0, "clip_cov loss: tokens are drawn among those with covariance below this")
    kl_cov_ratio: float = opt(2e-4, "kl_cov loss: fraction of a micro-batch's tokens (highest covariance) that get "
                                    "the |log-ratio| penalty")
    kl_cov_coef: float = opt(0.1, "kl_cov loss: coefficient of the |log-ratio| penalty (verl's ppo_kl_coef)")
    # PF-PPO (Shen et al. 2024): policy filtration by reward before the update
    pf_ppo: str = opt("none", "PF-PPO: weight samples by reward before the update: none, pow (|r|^weight_pow), "
                              "max_min (the highest and lowest rewards) or max_random (0.4 for the highest, 0.1 else)")
    pf_ppo_weight_pow: float = opt(2.0, "PF-PPO pow: the exponent of |r|")
    pf_ppo_scope: str = opt("batch", "PF-PPO: where max_min / max_random take the highest and lowest reward: batch "
                                     "(verl) or group (the paper: among the responses to one prompt)")
    pf_ppo_resample: bool = opt(True, "PF-PPO: draw the step's batch again, as many rows with replacement, in "
                                      "proportion to the weights (verl); false: keep every row and scale its "
                                      "advantages by its weight over the mean weight")
    pf_ppo_replay: int = opt(0, "PF-PPO with resample: the highest-reward samples of earlier steps kept (with the "
                                "advantages and log-probs of their step) and drawn from beside the step's own; "
                                "0 = none")
    # issue 20's traps and rollout correction (megarl/algorithms/kl.py, rollout_correction.py)
    kl_clamp: float = opt(10.0, "upper bound of the k3 (low_var_kl) KL estimate per token, as verl; 0 = none")
    allow_single_sample_groups: bool = opt(False, "allow rollout.n_samples=1 with a group estimator (grpo, rloo, "
                                                  "...): every advantage is then 0 and nothing is learned")
    rollout_correction: RolloutCorrectionConfig = section(RolloutCorrectionConfig, "the rollout engine's log-probs "
                                                          "against the trainer's: importance weights, rejection, "
                                                          "bypass mode, the decoupled PPO objective")


@dataclass
class RolloutConfig:
    engine: str = opt("hf", "rollout engine: hf (transformers, CPU/debug) or sglang (GPU)")
    n_samples: int = opt(8, "responses per prompt (the GRPO group size)")
    max_new_tokens: int = opt(16, "response length limit")
    temperature: float = opt(1.0, "sampling temperature for training rollouts")
    top_p: float = opt(1.0, "nucleus sampling for training rollouts")
    top_k: int = opt(-1, "training rollouts sample among the k most likely tokens; -1 = all (no top-k cut)")
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
    sglang_gpus_per_host: int = opt(0, "SGLang, disaggregated: GPUs of each server host (a Ray actor on one node that "
                                       "starts its servers: megarl/rollout/server_host.py), so that sglang_gpus may "
                                       "span nodes; a multiple of sglang_tp dividing sglang_gpus. 0 = every server on "
                                       "the rollout actor's node")
    weight_delivery: str = opt("full", "weight sync through megarl.reshard: full (whole HF tensors per bucket "
                                       "from one rank; the engine slices its own TP shard, as SGLang's "
                                       "update_weights_from_tensor does) or sharded (each generation TP rank sends only "
                                       "its rows into engines that load pre-sharded tensors: the hf engine, or "
                                       "colocated SGLang, each TP rank's shard (with --ep-size, whole experts of its "
                                       "EP slice) by CUDA IPC from the training rank on its GPU, whatever the "
                                       "training TP, PP and EP: the resharder moves the rows a rank lacks)")
    sglang_weight_format: str = opt("persistent", "SGLang: CUDA IPC weight payload per bucket: persistent (two "
                                    "reused flat buffers SGLang keeps mapped: the fastest, and the one that works "
                                    "into a TP>1 server), flattened_bucket (SGLang's one flat buffer per bucket; "
                                    "crashed a TP=2 server in sglang 0.5.17) or tensors (one handle per tensor)")
    sglang_args: list = opt([], "SGLang: extra sglang.launch_server arguments, e.g. [--attention-backend, fa3]; they "
                                "come after megarl's own and override its defaults (triton attention, pytorch "
                                "sampling, decode CUDA graphs up to each server's share of the step's batch when "
                                "that passes SGLang's 256 rows); the ones megarl manages are refused")
    sglang_env: dict = opt({}, "SGLang: environment variables of every server process, beside the ones megarl sets "
                               "(CUDA_VISIBLE_DEVICES is megarl's), e.g. {CUDA_MPS_CLIENT_PRIORITY: 0}")
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
    prompts_per_step: int = opt(8, "prompts per RL step (counts PROMPTS, not responses: a step trains on "
                                   "prompts_per_step x rollout.n_samples sequences)")
    max_prompt_length: int = opt(0, "most tokens of a rendered prompt (verl's data.max_prompt_length); a longer "
                                    "prompt is handled by data.truncation, or left out with "
                                    "data.filter_overlong_prompts; 0 = what the model's positions leave after "
                                    "the response budget")
    filter_overlong_prompts: bool = opt(False, "leave out (and count, naming the first) the prompts longer than "
                                               "data.max_prompt_length instead of applying data.truncation")
    truncation: str = opt("error", "a prompt longer than data.max_prompt_length: error (names the file and row), "
                                   "left (keeps its last tokens), right (its first) or middle (its first and last "
                                   "halves)")
    val_size: int = opt(64, "held-out prompts scored at each evaluation")
    min_len: int = opt(3, "built-in tasks: shortest operand")
    max_len: int = opt(5, "built-in tasks: longest operand")
    chat_template: bool = opt(False, "render prompts with the tokenizer's chat template (a string prompt becomes "
                                     "one user message; a prompt given as a list of messages always is rendered)")
    system_prompt: str = opt("", "with chat_template: a system message put before each prompt; empty = none")
    skip_malformed: bool = opt(False, "prompt files: skip (and count) malformed rows instead of stopping with an "
                                      "error that names the file and row")
    prompt_key: str = opt("prompt", "prompt files: the field that holds the prompt (a string or chat messages), e.g. "
                                    "problem for Geometry3K's HF layout")
    min_pixels: int = opt(0, "prompt rows with images: each image is resized to at least this many pixels (sides "
                             "multiples of patch_size x merge_size, as transformers' smart_resize); 0 = the model "
                             "directory's preprocessor_config.json")
    max_pixels: int = opt(0, "prompt rows with images: each image is resized to at most this many pixels (fewer "
                             "pixels, fewer image tokens); 0 = the model directory's preprocessor_config.json")


@dataclass
class RewardConfig:
    name: str = opt("", "reward function: registry name (gsm8k, gsm8k_flexible, math, math_dapo, geo3k, qa_em, "
                        "countdown, code, remote, data_source, ...), package.module:function or "
                        "path/to/file.py:function (a function with verl's compute_score signature is called as verl "
                        "calls it); empty = the built-in task's own, or for a prompt file each row's data_source "
                        "(verl's default scorer)")
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
class PreferenceConfig:
    """Preference pairs for reward-model training (python -m megarl.train_rm; megarl/data/preferences.py)."""
    train: str = opt("reverse", "training pairs: a .jsonl/.parquet/.json file (chosen, rejected and optionally prompt: "
                                "strings or chat messages, docs/reward_model.md) or a built-in task (reverse, add, "
                                "mul; operands of data.min_len..data.max_len): chosen its answer, rejected a "
                                "corrupted one")
    val: str = opt("", "held-out pairs file; empty = a held-out split of preference.train (by a hash of the prompt)")
    val_size: int = opt(256, "held-out pairs scored at each evaluation (at most this many)")
    task_pairs: int = opt(5000, "a built-in task in preference.train: how many training pairs are built from it")
    pairs_per_step: int = opt(32, "preference pairs per optimizer step")
    max_length: int = opt(0, "most tokens of one side of a pair (prompt and response); a longer one is a malformed "
                             "row; 0 = the model's max_position_embeddings")
    chat_template: bool = opt(False, "render a string prompt and response as a user turn and an assistant turn with "
                                     "the tokenizer's chat template (fields of chat messages always are)")
    append_eos: bool = opt(True, "end each side with the tokenizer's EOS token unless it ends so (as RL responses "
                                 "end; the score is read at the last token)")
    skip_malformed: bool = opt(False, "skip malformed rows (counted: data/skipped_pairs) instead of stopping with an "
                                      "error that names the file, row and field")


@dataclass
class SFTConfig:
    steps: int = opt(0, "supervised warm-start steps before RL (0 = none)")
    batch_size: int = opt(32, "sequences per SFT step")
    lr: float = opt(1e-3, "SFT learning rate")
    data: str = opt("", "SFT examples: empty = the task's reference answers; or a .jsonl of multi-turn traces "
                        "{prompt, messages: [{role: assistant|tool, content}]} (scripts/make_tool_traces.py), "
                        "trained on the assistant turns only")


@dataclass
class AsyncConfig:
    """Asynchronous training (trainer.mode one_step_off or async; megarl/async_trainer.py, docs/async.md)."""
    max_staleness: int = opt(1, "most policy versions a trained sample may lag the trainer (trainer version minus the "
                                "version of the sample's oldest token); one_step_off needs >= 1; 0 = on-policy (the "
                                "async mode then reproduces trainer.mode=sync)")
    stale: str = opt("drop", "a sample group found over max_staleness when the trainer takes it: drop (skipped; the "
                             "next groups fill the batch) or regenerate (its prompt goes back to the rollout, first "
                             "in line); both are counted (async/stale_dropped, async/stale_regenerated)")
    partial: str = opt("finish", "generation in flight at a weight update: finish (the update waits for it), resume "
                                 "(stopped, the new weights loaded, continued from its tokens: each token keeps the "
                                 "version that made it) or restart (stopped and begun again under the new weights); "
                                 "one_step_off needs finish")
    buffer_batches: int = opt(0, "step-batches the rollout may have generated or be generating ahead of the trainer's "
                                 "next one; 0 = all that max_staleness allows (max_staleness + 1); one_step_off: 1")
    batches_at_once: int = opt(1, "step-batches the rollout thread may generate in one engine call (trainer.mode="
                                  "async): up to this many of those the buffer admits at the moment, their prompts "
                                  "decoded together (more rows at once: more tokens per GPU-second), each put in the "
                                  "buffer with its own bound; 0 = all it admits then (at most buffer_batches); 1 = "
                                  "one at a time (one_step_off: one anyway); DAPO dynamic sampling and over-sampling "
                                  "generate one at a time")
    decoupled_ppo: str = opt("auto", "the objective on samples from an older policy: decoupled PPO "
                                     "(algorithm.rollout_correction.decoupled: the PPO ratio against the trainer's "
                                     "weights before the update, the proximal policy, times the capped weight "
                                     "proximal / rollout policy, as AReaL): on, off, or auto (on from max_staleness 1 "
                                     "unless algorithm.tis, rollout_correction.rollout_is or bypass_mode already "
                                     "correct; off at 0, where async is the synchronous loop)")


@dataclass
class TrainerConfig:
    mode: str = opt("sync", "sync (generate, then train, then sync weights, in turn), one_step_off (the rollout of "
                            "step t+1 runs while step t trains, from the policy one version older) or async (the "
                            "rollout keeps generating into a buffer; the trainer takes a batch whenever one is "
                            "ready; bounded by async.max_staleness); docs/async.md")
    steps: int = opt(10, "RL steps")
    eval_every: int = opt(5, "evaluate on the held-out set before RL, every N steps and after the last step; "
                             "0 = before RL and after the last step only")
    output_dir: str = opt("runs/default", "where TensorBoard events, metrics.jsonl and the tiny model go")
    seed: int = opt(1, "random seed")
    device: str = opt("auto", "auto, cpu or cuda")
    threads_per_rank: int = opt(1, "torch threads per training rank (CPU)")
    profile_update: int = opt(0, "the N-th policy update (the RL step N's in the synchronous loop) runs under "
                                 "torch.profiler on every training rank: ops by GPU and by host time and a chrome "
                                 "trace in output_dir/profile/update_N_rank_R/; 0 = off")
    worker_env: dict = opt({}, "environment variables of every training process, set when its Ray actor starts "
                               "(e.g. {NCCL_DEBUG: INFO}; under CUDA MPS {CUDA_MPS_CLIENT_PRIORITY: 1} puts training "
                               "below a colocated SGLang server's generation: docs/async.md); CUDA_VISIBLE_DEVICES "
                               "is Ray's")
    cpus_per_rank: float = opt(0.5, "Ray CPUs reserved per training rank")
    loggers: list = opt(["console", "tensorboard", "jsonl"], "where metrics go: console, tensorboard, jsonl, and "
                                                             "with their libraries installed (pip install "
                                                             "megarl[trackers]) wandb, mlflow, swanlab")
    project_name: str = opt("megarl", "the project trackers file the run under (W&B project, MLflow experiment, "
                                      "SwanLab project)")
    experiment_name: str = opt("", "the run's name in the trackers; empty = the last part of trainer.output_dir")
    sync_bucket_mb: int = opt(1024, "weight-sync bucket size in MiB: the most extra memory a sync takes on a sending "
                                    "rank (plus SGLang's two persistent buffers of ~half a bucket each); fewer, "
                                    "larger buckets sync faster (7B into SGLang on an H200: 2048 MiB 0.18 s, "
                                    "8192 MiB 0.13 s; docs/benchmarks.md)")
    verify_weight_sync_every: int = opt(1, "check the rollout engine's weights equal Megatron's bit for bit after the "
                                           "first weight sync and every N-th one after it (checksums of every "
                                           "parameter, computed inside SGLang's TP workers on their GPUs, against "
                                           "the sender's: 1.4% of a short 0.5B GRPO step on an H200, "
                                           "docs/benchmarks.md); 1: every sync, 0: never")
    verify_weight_sync_deep: bool = opt(False, "verification also has SGLang reload the sync from a safetensors file "
                                               "with its own loader and compare (writes the whole model each time: "
                                               "for debugging a weight layout, not for long runs)")
    offload_between_phases: str = opt("auto", "colocated memory cycle: during rollouts the training engines park "
                                              "weights, grads and optimizer state in host memory and the rollout "
                                              "engine releases its memory during training; auto (on for sglang on "
                                              "GPU), always (CPU too) or never")
    ray_address: str = opt("", "Ray cluster to join (IP:PORT); empty = RAY_ADDRESS, else the one `ray start` "
                               "left on this node, else a new local one; auto = join, never start; local = "
                               "always a new local one")
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
class Config(ConfigChecks):
    model: ModelConfig = section(ModelConfig, "policy model")
    actor: ActorConfig = section(ActorConfig, "policy training")
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "advantages and losses")
    rollout: RolloutConfig = section(RolloutConfig, "generation")
    data: DataConfig = section(DataConfig, "prompts")
    reward: RewardConfig = section(RewardConfig, "reward")
    critic: CriticConfig = section(CriticConfig, "the critic (algorithm.advantage=gae): its own layout and optimizer")
    reward_model: RewardModelConfig = section(RewardModelConfig, "a reward model: the one python -m megarl.train_rm "
                                                                 "trains, or RL's (when reward_model.path is set)")
    agent: AgentConfig = section(AgentConfig, "multi-turn, tool-using rollouts")
    sft: SFTConfig = section(SFTConfig, "supervised warm start")
    preference: PreferenceConfig = section(PreferenceConfig, "preference pairs for reward-model training "
                                                             "(python -m megarl.train_rm)")
    trainer: TrainerConfig = section(TrainerConfig, "the loop")
    # `async` is a Python keyword: the field is async_, its key in recipes and overrides `async` (loading.py)
    async_: AsyncConfig = section(AsyncConfig, "asynchronous training (trainer.mode one_step_off or async)")
    # how load_config read the command (class attributes, not options): the vocabulary ("megarl" or "verl"), the
    # megarl keys the command set (itself or through verl's keys; None for a Config built in code), and notes said
    # at start-up
    profile = "megarl"
    given = None
    notes = ()

    def old_policy_is_the_trained_one(self) -> bool:
        """One optimizer update per step and nothing reading the old log-probs before it: the policy the
        update starts from is the old policy, so its training forward gives the old log-probs (detached)."""
        batch = self.data.prompts_per_step * self.rollout.n_samples
        one_update = self.actor.ppo_epochs == 1 and self.actor.mini_batch_size in (0, batch)
        return one_update and not (self.algorithm.kl_coef > 0 and self.algorithm.kl_in_reward)

    def recompute_old_logprobs(self) -> bool:
        """Whether the step runs a forward pass of its own for the old log-probs (algorithm.recompute_old_logprobs).
        Never in the rollout correction's bypass mode (the rollout's are the old ones); always for its weights and
        rejection otherwise (computed on the whole batch before training)."""
        mode, rc = self.algorithm.recompute_old_logprobs, self.algorithm.rollout_correction
        if rc.bypass_mode:
            return False
        needed = not self.old_policy_is_the_trained_one() or rc.rollout_is != "none" or rc.rollout_rs != "none"
        return mode == "always" or (mode == "auto" and needed)

    def sglang_colocated(self) -> bool:
        """SGLang servers on the training GPUs (no rollout.sglang_gpus of their own)."""
        return self.rollout.engine == "sglang" and not self.rollout.sglang_gpus

    def offload_enabled(self, device: str) -> bool:
        """The colocated memory cycle (trainer.offload_between_phases; megarl/workers/colocation.py). auto: on where
        training and SGLang share GPUs (SGLang runs colocated: no rollout.sglang_gpus of its own); always/never as
        said; never in the asynchronous modes, which keep both engines resident (always is refused there)."""
        mode = self.trainer.offload_between_phases
        if self.trainer.mode != "sync":
            return False
        if mode == "auto":
            return self.sglang_colocated() and device == "cuda"
        return mode == "always"

    def to_dict(self) -> dict:
        return {name.rstrip("_"): value for name, value in dataclasses.asdict(self).items()}
