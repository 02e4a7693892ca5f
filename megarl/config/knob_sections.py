"""The sections under `algorithm` that hold one policy loss's, one advantage estimator's or one feature's own knobs
(algorithm.gspo.clip_eps, algorithm.pf_ppo.method ...), as verl's PolicyLossConfig nests a loss's knobs under it. A
run reads those of the loss and estimator it selects (megarl/config/fingerprint.py compares only those on a resume);
PPO's own knobs (clip_eps, loss_agg, kl_*) stay in the algorithm section itself. Their former flat names are read
through megarl/config/moved_keys.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config.fields import SEQUENCES, TOKENS, opt


# ---- policy losses (algorithm.policy_loss) ------------------------------------------------------------------------

@dataclass
class DualClipConfig:
    clip_ratio_c: float = opt(3.0, "bound on a negative-advantage token's ratio term (> 1)", min=1, min_exclusive=True)


@dataclass
class GSPOConfig:
    clip_eps: float = opt(3e-4, "clip range of the sequence ratio, lower side", min=0, min_exclusive=True)
    clip_eps_high: float = opt(4e-4, "clip range of the sequence ratio, upper side", min=0, min_exclusive=True)


@dataclass
class GMPOConfig:
    clip_eps: float = opt(0.4, "each token's log-ratio is clipped to [-eps, eps] (the paper's 0.4)",
                          min=0, min_exclusive=True)


@dataclass
class CISPOConfig:
    clip_eps_low: float = opt(1.0, "the IS weight's lower bound is 1 - eps (1 = none, MiniMax-M1)", min=0, max=1)
    clip_eps_high: float = opt(0.2, "the IS weight's upper bound is 1 + eps", min=0)


@dataclass
class SAPOConfig:
    tau_pos: float = opt(1.0, "gate temperature of tokens with a positive advantage", min=0, min_exclusive=True)
    tau_neg: float = opt(1.05, "gate temperature of tokens with a negative or zero advantage",
                         min=0, min_exclusive=True)


@dataclass
class ClipCovConfig:
    ratio: float = opt(2e-4, "fraction of a micro-batch's tokens whose gradient is cut",
                       min=0, max=1, min_exclusive=True)
    lb: float = opt(1.0, "tokens are drawn among those with covariance above this", unbounded=True)
    ub: float = opt(5.0, "tokens are drawn among those with covariance below this", unbounded=True)


@dataclass
class KLCovConfig:
    ratio: float = opt(2e-4, "fraction of a micro-batch's tokens (highest covariance) that get the |log-ratio| "
                             "penalty", min=0, max=1, min_exclusive=True)
    coef: float = opt(0.1, "coefficient of the |log-ratio| penalty (verl's ppo_kl_coef)", min=0)


# ---- advantage estimators (algorithm.advantage) -------------------------------------------------------------------

@dataclass
class GPGConfig:
    norm_by_std: bool = opt(False, "divide by the group's std (F_norm = std) instead of 1")


@dataclass
class OTBConfig:
    zero_tail: bool = opt(True, "the part of a group's longest response past its second longest gets no baseline "
                                "(verl's handle_zero_tail)")


@dataclass
class GAEConfig:
    """VAPO (Yue et al. 2025) on top of gae: decoupled and length-adaptive GAE, value pretraining. gamma and lam, which
    reinforce_plus_plus reads too, are the algorithm section's."""
    critic_lam: float = opt(-1.0, "GAE lambda of the critic's targets (VAPO's decoupled GAE: 1.0, Monte-Carlo "
                                  "returns); -1 = algorithm.lam, the policy's", min=0, max=1, also=(-1,))
    lam_length_alpha: float = opt(0.0, "VAPO's length-adaptive GAE: the policy's lambda per sequence is "
                                       "1 - 1 / (alpha * response length), clamped to [0, 1] (VAPO: alpha 0.05); "
                                       "0 = algorithm.lam for every sequence", min=0)
    critic_warmup_steps: int = opt(0, "VAPO's value pretraining: steps before RL that sample from the frozen policy "
                                      "and train only the critic on the returns (algorithm.gae.critic_lam); 0 = none",
                                   min=0)


# ---- features beside the loss -------------------------------------------------------------------------------------

@dataclass
class PositiveLMConfig:
    coef: float = opt(0.0, "coefficient of the NLL of the response tokens of samples whose reward >= threshold "
                           "(VAPO: 0.1); 0 = off", min=0)
    threshold: float = opt(1.0, "the reward at which a sample counts as correct", unbounded=True)


@dataclass
class OverlongBufferConfig:
    len: int = opt(0, "penalty ramp over the last N tokens of rollout.max_new_tokens; 0 = off", min=0, **TOKENS)
    penalty_factor: float = opt(1.0, "penalty at the full length", min=0)


@dataclass
class PFPPOConfig:
    method: str = opt("none", "weight samples by reward before the update: none, pow (|r|^weight_pow), max_min (the "
                              "highest and lowest rewards) or max_random (0.4 for the highest, 0.1 else)",
                      choices=("none", "pow", "max_min", "max_random"))
    weight_pow: float = opt(2.0, "pow: the exponent of |r|", min=0, min_exclusive=True)
    scope: str = opt("batch", "where max_min / max_random take the highest and lowest reward: batch (verl) or group "
                              "(the paper: among the responses to one prompt)", choices=("batch", "group"))
    resample: bool = opt(True, "draw the step's batch again, as many rows with replacement, in proportion to the "
                               "weights (verl); false: keep every row and scale its advantages by its weight over the "
                               "mean weight")
    replay: int = opt(0, "with resample: the highest-reward samples of earlier steps kept (with the advantages and "
                         "log-probs of their step) and drawn from beside the step's own; 0 = none", min=0, **SEQUENCES)
