"""The sections of the RL algorithm (advantages, losses, KL, rollout correction) and of generation: typed as every
section is (megarl/config/sections.py, which holds the root Config and imports these)."""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config.fields import CLUSTER, PASSES, SEQUENCES, TOKENS, opt, section
from megarl.config.knob_sections import (CISPOConfig, ClipCovConfig, DualClipConfig, GAEConfig, GMPOConfig, GPGConfig,
                                        GSPOConfig, KLCovConfig, OTBConfig, OverlongBufferConfig, PFPPOConfig,
                                        PositiveLMConfig, SAPOConfig)


@dataclass
class RolloutCorrectionConfig:
    """The rollout engine's log-probs against the trainer's (megarl/algorithms/rollout_correction.py, verl's
    algorithm.rollout_correction keys), and the decoupled PPO objective."""
    rollout_is: str = opt("none", "importance weights pi_old / pi_rollout on the policy loss: none, token (one per "
                                  "token) or sequence (the product over the response, on all its tokens)",
                          choices=("none", "token", "sequence"))
    rollout_is_threshold: float = opt(2.0, "rollout_is: upper bound of the weight", min=0, min_exclusive=True)
    rollout_is_mode: str = opt("truncate", "rollout_is: truncate (min(w, threshold): TIS) or mask (weights outside "
                                           "[rollout_is_threshold_lower, rollout_is_threshold] become 0: IcePop)",
                               choices=("truncate", "mask"))
    rollout_is_threshold_lower: float = opt(0.0, "rollout_is_mode=mask: lower bound of the weight; 0 = 1 / "
                                                 "rollout_is_threshold", min=0)
    rollout_is_batch_normalize: bool = opt(False, "rollout_is: divide the weights by their mean over the step's "
                                                  "batch (tokens, or sequences for sequence weights), so they "
                                                  "average 1")
    rollout_rs: str = opt("none", "rejection: drop from the loss the tokens or sequences whose ratio pi_old / "
                                  "pi_rollout leaves [rollout_rs_threshold_lower, rollout_rs_threshold]: none, "
                                  "token_k1 (each token's ratio), seq_sum_k1 (the sequence's product of ratios) "
                                  "or seq_mean_k1 (their geometric mean)",
                          choices=("none", "token_k1", "seq_sum_k1", "seq_mean_k1"))
    rollout_rs_threshold: float = opt(2.0, "rollout_rs: upper bound of the ratio", min=0, min_exclusive=True)
    rollout_rs_threshold_lower: float = opt(0.0, "rollout_rs: lower bound of the ratio; 0 = 1 / rollout_rs_threshold",
                                            min=0)
    bypass_mode: bool = opt(False, "the rollout engine's log-probs are the old log-probs (no forward pass for them): "
                                   "a ratio loss (ppo_clip ...) then clips pi / pi_rollout; with policy_loss=reinforce "
                                   "rollout_is weights pi / pi_rollout, and rollout_rs, are computed in the loss")
    decoupled: bool = opt(False, "the decoupled PPO objective (Hilton et al. 2022, AReaL): the ratio loss clips "
                                 "pi / pi_prox (pi_prox: the old log-probs, the trainer's weights before the update) "
                                 "and each token's loss is weighted by pi_prox / pi_rollout, capped by decoupled_cap "
                                 "(async.decoupled_ppo turns it on in the asynchronous modes)")
    decoupled_cap: float = opt(5.0, "decoupled objective: bound of the weight pi_prox / pi_rollout (AReaL's "
                                    "behav_imp_weight_cap)", min=1)
    decoupled_cap_mode: str = opt("truncate", "decoupled objective: truncate (min(w, decoupled_cap)) or mask (a "
                                              "token whose weight exceeds the cap gets weight 0, as AReaL)",
                                  choices=("truncate", "mask"))


@dataclass
class AlgorithmConfig:
    advantage: str = opt("grpo", "advantage estimator (registry name in megarl.algorithms.advantages)")
    policy_loss: str = opt("ppo_clip", "policy loss (registry name in megarl.algorithms.losses)")
    loss_agg: str = opt("token-mean", "how per-token losses are reduced over the batch")
    norm_adv_by_std: bool = opt(True, "GRPO: divide group-centred rewards by the group std")
    clip_eps: float = opt(0.2, "PPO clip range (lower side, and upper unless clip_eps_high is set)",
                          min=0, min_exclusive=True)
    clip_eps_high: float = opt(0.0, "PPO clip range, upper side; 0 = clip_eps", min=0)
    loss_agg_norm_len: int = opt(0, "seq-mean-token-sum-norm: the constant each sequence's token sum is "
                                    "divided by (Dr. GRPO: the max response length)", min=0, **TOKENS)
    tis: bool = opt(False, "truncated importance sampling: weight the policy loss by min(exp(old - rollout "
                           "logprob), tis_cap) to correct the rollout/training log-prob mismatch")
    tis_cap: float = opt(2.0, "truncated importance sampling: upper bound of the weight", min=0, min_exclusive=True)
    recompute_old_logprobs: str = opt("auto", "the old policy's log-probs by a forward pass of their own before "
                                              "training: always; never (the training forward's, detached: exact "
                                              "when the step makes one optimizer update); auto = never exactly "
                                              "when one update per step and no KL in the reward",
                                      choices=("auto", "always", "never"))
    kl_coef: float = opt(0.0, "coefficient of the KL to the reference policy; 0 = no reference model", min=0)
    kl_in_reward: bool = opt(False, "apply the KL as a per-token reward penalty (gae, reinforce_plus_plus, "
                                    "remax) instead of a loss term")
    kl_estimator: str = opt("k3", "KL estimator: k1, k2, k3 or abs (verl's kl, mse, low_var_kl: k1, k2, k3); a "
                                  "trailing '+' (k3+ ...) takes the gradient of k2 (straight through, as verl)")
    kl_target: float = opt(0.0, "adaptive KL coefficient: the per-token KL to steer towards; 0 = fixed kl_coef", min=0)
    kl_horizon: int = opt(10000, "adaptive KL coefficient: horizon of the update, in samples", min=1)
    entropy_coef: float = opt(0.0, "entropy bonus coefficient", min=0)
    gamma: float = opt(1.0, "discount of token-level returns (gae, reinforce_plus_plus)", min=0, max=1)
    lam: float = opt(1.0, "GAE lambda (verl's default)", min=0, max=1)
    dynamic_sampling: bool = opt(False, "DAPO: drop groups whose rewards are all equal and generate more prompts "
                                        "to refill the step's batch")
    max_sampling_rounds: int = opt(3, "DAPO dynamic sampling: most generation rounds per step; a batch still short "
                                      "then is filled up with dropped groups (zero advantage under grpo)",
                                   min=1, **PASSES)
    # the KL estimate's bound, single-sample groups, and rollout correction (megarl/algorithms/kl.py,
    # rollout_correction.py)
    kl_clamp: float = opt(10.0, "upper bound of the k3 (low_var_kl) KL estimate per token, as verl; 0 = none", min=0)
    allow_single_sample_groups: bool = opt(False, "allow rollout.n_samples=1 with a group estimator (grpo, rloo, "
                                                  "...): every advantage is then 0 and nothing is learned")
    rollout_correction: RolloutCorrectionConfig = section(RolloutCorrectionConfig, "the rollout engine's log-probs "
                                                          "against the trainer's: importance weights, rejection, "
                                                          "bypass mode, the decoupled PPO objective")
    # each loss's and estimator's own knobs, read when it is selected (docs/configuration.md names each paper and
    # formula)
    dual_clip: DualClipConfig = section(DualClipConfig, "the dual_clip loss's own knobs (Ye et al. 2020)")
    gspo: GSPOConfig = section(GSPOConfig, "the gspo loss's own knobs (Zheng et al. 2025)")
    gmpo: GMPOConfig = section(GMPOConfig, "the gmpo loss's own knobs (Zhao et al. 2025)")
    cispo: CISPOConfig = section(CISPOConfig, "the cispo loss's own knobs (MiniMax-M1)")
    sapo: SAPOConfig = section(SAPOConfig, "the sapo loss's own knobs (Gao et al. 2025)")
    clip_cov: ClipCovConfig = section(ClipCovConfig, "the clip_cov loss's own knobs (Cui et al. 2025)")
    kl_cov: KLCovConfig = section(KLCovConfig, "the kl_cov loss's own knobs (Cui et al. 2025)")
    gpg: GPGConfig = section(GPGConfig, "the gpg advantage estimator's own knobs (Chu et al. 2025)")
    otb: OTBConfig = section(OTBConfig, "the optimal_token_baseline advantage estimator's own knobs")
    gae: GAEConfig = section(GAEConfig, "the gae advantage estimator's own knobs beyond gamma and lam: VAPO's "
                                        "decoupled and length-adaptive GAE and value pretraining (Yue et al. 2025)")
    # features beside the loss, each off by its first key's default
    positive_lm: PositiveLMConfig = section(PositiveLMConfig, "VAPO's positive-example LM loss, added to any policy "
                                                              "loss (Yue et al. 2025)")
    overlong_buffer: OverlongBufferConfig = section(OverlongBufferConfig, "DAPO's overlong reward shaping (verl's "
                                                                          "reward_model.overlong_buffer)")
    pf_ppo: PFPPOConfig = section(PFPPOConfig, "PF-PPO (Shen et al. 2024): policy filtration by reward before the "
                                               "update")


@dataclass
class RolloutConfig:
    engine: str = opt("auto", "rollout engine: sglang (GPU), hf (transformers, CPU/debug) or auto (sglang where "
                              "trainer.device resolves to cuda, else hf; resolved when the config is read)",
                      choices=("auto", "hf", "sglang"))
    n_samples: int = opt(8, "responses per prompt (the GRPO group size)", min=1, **SEQUENCES)
    max_new_tokens: int = opt(1024, "response length limit", min=1, **TOKENS)
    temperature: float = opt(1.0, "sampling temperature for training rollouts (0 = greedy)", min=0)
    top_p: float = opt(1.0, "nucleus sampling for training rollouts", min=0, max=1, min_exclusive=True)
    top_k: int = opt(-1, "training rollouts sample among the k most likely tokens; -1 = all (no top-k cut)",
                     min=1, also=(-1,))
    ignore_eos: bool = opt(False, "generate max_new_tokens for every response, past the tokenizer's EOS (benchmarks "
                                  "with fixed lengths); stop_token_ids still stop")
    eval_temperature: float = opt(0.0, "sampling temperature for validation (0 = greedy)", min=0)
    eval_n_samples: int = opt(1, "responses per held-out prompt; val/reward is their mean (mean@k)", min=1, **SEQUENCES)
    num_cpus: float = opt(1.0, "CPUs reserved for the rollout actor", min=0, **CLUSTER)
    sglang_mem_fraction: float = opt(0.4, "SGLang: GPU memory fraction for its weights and KV cache",
                                     min=0, max=1, min_exclusive=True, max_exclusive=True)
    sglang_tp: int = opt(1, "SGLang: tensor-parallel size of each server (one server per group of GPUs); also the "
                            "generation TP that rollout.weight_delivery=sharded cuts the policy into", min=1, **CLUSTER)
    sglang_gpus: int = opt(0, "SGLang: GPUs reserved for the servers apart from the training ranks' (disaggregated: "
                              "one server per rollout.sglang_tp of them, weights broadcast over NCCL, no offload "
                              "cycle; rollout.sglang_mem_fraction may then take most of each GPU); 0 = the servers "
                              "share the training ranks' GPUs (colocated, weights by CUDA IPC)", min=0, **CLUSTER)
    sglang_gpus_per_host: int = opt(0, "SGLang, disaggregated: GPUs of each server host (a Ray actor on one node that "
                                       "starts its servers: megarl/rollout/server_host.py), so that sglang_gpus may "
                                       "span nodes; a multiple of sglang_tp dividing sglang_gpus. 0 = every server on "
                                       "the rollout actor's node", min=0, **CLUSTER)
    weight_delivery: str = opt("full", "weight sync through megarl.reshard: full (whole HF tensors per bucket "
                                       "from one rank; the engine slices its own TP shard, as SGLang's "
                                       "update_weights_from_tensor does) or sharded (each generation TP rank sends only "
                                       "its rows into engines that load pre-sharded tensors: the hf engine, or "
                                       "colocated SGLang, each TP rank's shard (with --ep-size, whole experts of its "
                                       "EP slice) by CUDA IPC from the training rank on its GPU, whatever the "
                                       "training TP, PP and EP: the resharder moves the rows a rank lacks)",
                               choices=("full", "sharded"))
    lora_sync: str = opt("merged", "with actor.lora: what each weight sync sends the rollout engine: merged (the "
                                   "whole model, W + scale B A, by the weight_delivery path, checksum-verified) or "
                                   "adapter (a PEFT adapter directory under trainer.output_dir that the engine loads: "
                                   "SGLang serves it beside its base weights under a new name per sync, which the "
                                   "rollouts ask for; the hf engine merges it; not verified; not yet run on a GPU)",
                         choices=("merged", "adapter"))
    sglang_weight_format: str = opt("persistent", "SGLang: CUDA IPC weight payload per bucket: persistent (two "
                                    "reused flat buffers SGLang keeps mapped: the fastest, and the one that works "
                                    "into a TP>1 server), flattened_bucket (SGLang's one flat buffer per bucket; "
                                    "crashed a TP=2 server in sglang 0.5.17) or tensors (one handle per tensor)",
                                    choices=("persistent", "flattened_bucket", "tensors"))
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
