"""Rollout correction through the whole system on CPU (python -m megarl.train's main on the quickstart recipe, tiny):
the rollout log-probs are perturbed by a known amount, and the step's mismatch metrics and rejected fraction equal
a hand computation."""

import json
import math

import pytest
import torch

from megarl.algorithms import rollout_correction
from megarl.protocol import Batch
from megarl.train import main
from megarl.utils.tracking import run_dir

from tests.conftest import QUICKSTART


def perturb_rollout_logprobs(batch: Batch, delta: float) -> None:
    """Add `delta` to the rollout log-prob of the 1st, 3rd, 5th ... response token of rows 0, 2, 4 ... of the batch,
    so that the mismatch metrics and the rejection have values the test computes by hand."""
    valid = batch["loss_mask"] > 0
    nth = valid.long().cumsum(-1) - 1  # index of each response token within its response
    rows = torch.arange(len(batch))[:, None] % 2 == 0
    hit = valid & (nth % 2 == 0) & rows
    batch["rollout_logprobs"] = batch["rollout_logprobs"] + hit.to(batch["rollout_logprobs"].dtype) * delta


def test_perturbation_hits_every_other_response_token_of_every_other_row():
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0, 1.0]])
    batch = Batch({"loss_mask": mask, "rollout_logprobs": torch.zeros(3, 5)})
    perturb_rollout_logprobs(batch, -0.5)
    assert batch["rollout_logprobs"].tolist() == [[0, -0.5, 0, -0.5, 0], [0] * 5, [0, 0, -0.5, 0, -0.5]]


def test_perturbed_rollout_logprobs_give_the_hand_computed_mismatch_and_rejection(tmp_path, monkeypatch):
    # 2 prompts x 2 samples, 5 response tokens each (ignore_eos). The rollout log-prob is lowered by 1 on tokens
    # 1, 3, 5 of rows 0 and 2 as the driver's correction receives the batch: 6 of the 20 tokens get
    # r = pi_old / pi_rollout = e (the hf engine and Megatron agree to ~1e-7 elsewhere, r = 1). token_k1 rejects r
    # outside [1/2, 2]; the token weights are truncated at 2.
    correct = rollout_correction.apply_rollout_correction
    calls = []

    def perturbed_then_corrected(batch, rc):
        calls.append(len(batch))
        perturb_rollout_logprobs(batch, -1.0)
        return correct(batch, rc)

    monkeypatch.setattr(rollout_correction, "apply_rollout_correction", perturbed_then_corrected)
    assert main(["--config", str(QUICKSTART), f"trainer.output_dir={tmp_path}", "actor.parallel.world_size=1",
                 "actor.parallel.tp=1", "model.tiny_num_layers=1", "sft.steps=0", "trainer.steps=1",
                 "data.prompts_per_step=2", "rollout.n_samples=2", "data.val_size=2", "rollout.eval_n_samples=1",
                 "rollout.ignore_eos=true", "rollout.max_new_tokens=5", "trainer.loggers=jsonl",
                 "algorithm.rollout_correction.rollout_rs=token_k1",
                 "algorithm.rollout_correction.rollout_is=token"]) == 0
    step = [json.loads(line) for line in (run_dir(tmp_path) / "metrics.jsonl").read_text().splitlines()
            if '"train/loss"' in line][0]
    m = {k.removeprefix("rollout_corr/"): v for k, v in step.items() if k.startswith("rollout_corr/")}
    hit, e = 6 / 20, math.e
    expected = {
        "kl": -hit,  # mean of log pi_rollout - log pi_old
        "k3_kl": hit * (e - 1 - 1),  # mean of r - log r - 1
        "chi2_token": hit * (e**2 - 1),  # mean of r^2 - 1
        "log_ppl_diff": (2 * -3 / 5 + 2 * 0) / 4,  # per sequence: mean rollout - mean old log-prob
        "ppl_ratio": (2 * math.exp(-3 / 5) + 2 * 1) / 4,
        "chi2_seq": (2 * e**6 + 2 * 1) / 4 - 1,  # (prod r)^2: e^(2 * 3) on rows 0 and 2
        "rollout_rs_masked_fraction": hit,
        "rollout_rs_seq_masked_fraction": 2 / 4,
        "rollout_is_mean": (6 * 2.0 + 14 * 1.0) / 20,
        "rollout_is_ratio_fraction_high": hit,
        "rollout_is_ratio_fraction_low": 0.0,
    }
    assert calls == [4]  # the step's whole batch, once
    assert {k: m[k] for k in expected} == pytest.approx(expected, rel=1e-4, abs=1e-5)
    # the rejected tokens are out of the loss mask: 14 of 20 tokens trained, each with weight ~1
    assert step["train/response_length"] == pytest.approx(14 / 4)
    assert step["train/rollout_is_weight"] == pytest.approx(1.0, abs=1e-5)
