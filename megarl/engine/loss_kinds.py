"""What MegatronEngine.train(loss=...) trains, registered in LOSS_KINDS by name: policy, value, bradley_terry, sft.

A loss kind says which head the model needs, which config keys of the engine's section it reads, how many passes a
call makes over its batch and whether a call is one step of the LR schedule, which batch keys go into the
micro-batches, and its loss per micro-batch. The engine does the rest alike for every kind: the counts over DP,
megatron's schedule, the check for non-finite values, the optimizer step.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from megarl.algorithms import losses, rollout_correction
from megarl.config import AlgorithmConfig
from megarl.protocol import Batch
from megarl.utils.registry import Registry

LOSS_KINDS = Registry("loss kind")

# (micro-batch, model output) -> (its share of the mini-batch's loss, its metrics)
MicroBatchLoss = Callable[[dict, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class Totals(NamedTuple):
    """A mini-batch's counts over every DP rank, which each micro-batch's loss divides by."""
    tokens: float  # loss_mask's tokens
    seqs: float
    lm_tokens: float  # lm_mask's tokens: the response tokens of VAPO's positive-example LM loss


class LossKind:
    """A kind's declaration (the class attributes) and its batch keys and micro-batch loss (the methods)."""
    head = "lm"  # the engine's head it needs: 'lm' (log-probs) or 'value' (a scalar per position)
    section_keys: tuple[str, ...] = ()  # keys of the engine's section it reads beyond those of every role
    schedule_step = False  # a call is one step of the LR schedule (an RL step, a reward-model step)
    repeats = False  # a call makes section.ppo_epochs passes over its batch (and is named by its RL step)
    group_size = 1  # rows kept in one micro-batch, in order
    groups = ""  # what a group is, for the error when a mini-batch's rows do not divide into them

    def check(self, batch: Batch, updates: int) -> None:
        """Raise ValueError if a call's batch cannot be trained in `updates` optimizer updates."""

    def batch_keys(self, batch: Batch, algorithm: AlgorithmConfig) -> list[str]:
        """The batch keys (beyond the inputs) the loss reads from a micro-batch."""
        return ["loss_mask"]

    def micro_batch_loss(self, engine, batch: Batch, totals: Totals) -> MicroBatchLoss:
        """The loss of each micro-batch of the mini-batch `batch`, through `engine`'s readers of the model output."""
        raise NotImplementedError


@LOSS_KINDS.register("policy")
class PolicyLoss(LossKind):
    """The policy's RL loss (algorithm.policy_loss, KL, entropy, VAPO's LM term): losses.actor_loss. Without
    'old_logprobs' in the batch its single update starts from the old policy: its forward gives them (detached),
    and the rollout engine's log-prob gap is measured on it."""
    section_keys = ("ppo_epochs",)
    schedule_step = repeats = True

    def check(self, batch: Batch, updates: int) -> None:
        if "old_logprobs" not in batch and updates > 1:
            raise ValueError(f"the batch has no 'old_logprobs' and makes {updates} optimizer updates: after the "
                             "first, the policy is no longer the old one (algorithm.recompute_old_logprobs=always)")

    def batch_keys(self, batch: Batch, algorithm: AlgorithmConfig) -> list[str]:
        on_policy = "old_logprobs" not in batch
        keys = ["loss_mask", "advantages"] + ([] if on_policy else ["old_logprobs"])
        keys += ["ref_logprobs"] if algorithm.kl_coef > 0 else []
        keys += ["rollout_logprobs"] if on_policy and "rollout_logprobs" in batch else []
        return keys + [k for k in losses.policy_batch_keys(algorithm) if k not in keys]

    def micro_batch_loss(self, engine, batch: Batch, totals: Totals) -> MicroBatchLoss:
        algorithm, on_policy = engine.algorithm, "old_logprobs" not in batch

        def loss(mb, output):
            logprobs, entropy = engine.aligned_logprobs(mb, output, with_entropy=True)
            if on_policy:
                mb = dict(mb, old_logprobs=logprobs.detach())
            value, metrics = losses.actor_loss(algorithm, logprobs, entropy, mb, totals.tokens, totals.seqs,
                                               totals.lm_tokens)
            if on_policy and "rollout_logprobs" in mb:
                metrics["rollout_logprob_abs_diff"] = losses.token_mean(
                    (logprobs.detach() - mb["rollout_logprobs"]).abs(), mb["loss_mask"], totals.tokens, totals.seqs)
            # the policy trained against the rollout's: the old one (on_policy), or the moving one (bypass)
            if "rollout_logprobs" in mb and (on_policy or algorithm.rollout_correction.bypass_mode):
                metrics |= rollout_correction.mismatch_metrics(logprobs, mb["rollout_logprobs"], mb["loss_mask"],
                                                               totals.tokens, totals.seqs)
            return value, metrics
        return loss


@LOSS_KINDS.register("value")
class ValueLoss(LossKind):
    """The critic's clipped value loss against GAE's returns (critic.value_clip): losses.value_loss."""
    head = "value"
    section_keys = ("ppo_epochs", "value_clip")
    schedule_step = repeats = True

    def batch_keys(self, batch: Batch, algorithm: AlgorithmConfig) -> list[str]:
        return ["loss_mask", "values", "returns"]

    def micro_batch_loss(self, engine, batch: Batch, totals: Totals) -> MicroBatchLoss:
        def loss(mb, output):
            return losses.value_loss(engine.aligned_values(mb, output), mb, engine.algorithm,
                                     engine.section.value_clip, totals.tokens, totals.seqs)
        return loss


@LOSS_KINDS.register("bradley_terry")
class BradleyTerryLoss(LossKind):
    """A reward model's loss on preference pairs, rows 2k (chosen) and 2k+1 (rejected), read at each sequence's
    last token: losses.bradley_terry_loss."""
    head = "value"
    schedule_step = True
    group_size, groups = 2, "(chosen, rejected) row pairs"

    def micro_batch_loss(self, engine, batch: Batch, totals: Totals) -> MicroBatchLoss:
        def loss(mb, output):  # a pair's rows share a micro-batch, in any order
            rewards = engine.last_token_values(mb, output)[mb["seq_index"].argsort()]
            return losses.bradley_terry_loss(rewards[0::2], rewards[1::2], totals.seqs / 2)
        return loss


@LOSS_KINDS.register("sft")
class SFTLoss(LossKind):
    """Supervised fine-tuning: the mean negative log-likelihood of the loss_mask's tokens (losses.sft_loss); the
    caller sets the learning rate (train(lr=...)), the LR schedule does not move."""

    def micro_batch_loss(self, engine, batch: Batch, totals: Totals) -> MicroBatchLoss:
        def loss(mb, output):
            logprobs, _ = engine.aligned_logprobs(mb, output, with_entropy=False)
            return losses.sft_loss(logprobs, mb["loss_mask"], totals.tokens), {}
        return loss
