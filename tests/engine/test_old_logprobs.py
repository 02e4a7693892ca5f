"""algorithm.recompute_old_logprobs: with one optimizer update per step, the update's own forward (detached)
gives the old log-probs. A GRPO step without the separate forward must equal the step with it bit for bit
(loss, grad norm, clip and TIS terms, updated weights) at TP=1 and TP=2, with one forward pass fewer; the
rollout log-prob gap is measured on the update's forward; several updates per step without old log-probs
are refused."""

import pytest
import torch

from megarl.config import ActorConfig, AlgorithmConfig, ConfigError, OptimConfig
from megarl.config.tiny import tiny_config
from tests.dist_utils import run_distributed
from tests.engine.hf_models import make_qwen2_dir, padded_batch

ALGO = AlgorithmConfig(tis=True, tis_cap=1.5, entropy_coef=0.01)


def grpo_batch():
    batch = padded_batch(rows=8)
    g = torch.Generator().manual_seed(5)
    batch["advantages"] = torch.randn(batch["tokens"].shape, generator=g) * batch["loss_mask"]
    # the rollout engine's log-probs: near the trainer's (set per rank below), so TIS weights vary around 1
    batch["rollout_noise"] = torch.randn(batch["tokens"].shape, generator=g) * 0.3 * batch["loss_mask"]
    return batch


def _step_rank(rank, model_dir):
    from megarl.engine import MegatronEngine

    def engine():
        e = MegatronEngine(model_dir, ActorConfig(micro_batch_size=3, optim=OptimConfig(lr=1e-2)), ALGO, "cpu", 1, 10)
        forwards = []
        run = e._run_schedule
        e._run_schedule = lambda mbs, fn, forward_only: forwards.append(forward_only) or run(mbs, fn, forward_only)
        return e, forwards

    results = {}
    for recompute in (True, False):
        e, forwards = engine()
        batch = grpo_batch()
        current = e.compute_logprobs(batch)["logprobs"]  # the rollout log-probs are built from it, the same in both runs
        batch["rollout_logprobs"] = current + batch.tensors.pop("rollout_noise")
        forwards.clear()
        if recompute:
            batch["old_logprobs"] = e.compute_logprobs(batch)["logprobs"]
        metrics = e.train(batch, loss="policy")
        weights = {n: t for bucket in e.export_hf_weights(1 << 30) for n, t in bucket}
        real = batch["loss_mask"] > 0
        gap = (current - batch["rollout_logprobs"])[real].abs().mean().item()
        results[recompute] = (metrics, weights, forwards, gap)
    return results


@pytest.mark.parametrize("tp", [1, 2])
def test_skipping_the_old_logprob_forward_gives_the_same_step(tmp_path, tp):
    model_dir = make_qwen2_dir(tmp_path / "qwen2", tied=True)
    results = run_distributed(_step_rank, tp, model_dir, tp=tp)
    (m_a, w_a, forwards_a, gap), (m_b, w_b, forwards_b, _) = results[True], results[False]
    assert forwards_a == [True, False] and forwards_b == [False]  # the skip: one forward-only pass fewer
    for name in ("loss", "pg_loss", "entropy", "clipfrac", "approx_kl", "ratio", "tis_weight", "grad_norm"):
        assert m_a[name] == m_b[name], (name, m_a[name], m_b[name])
    assert m_b["ratio"] == 1.0 and 0.5 < m_b["tis_weight"] < 1.5  # a real TIS correction, identical both ways
    assert w_a.keys() == w_b.keys() and all(torch.equal(w_a[n], w_b[n]) for n in w_a)
    assert "rollout_logprob_abs_diff" not in m_a
    assert m_b["rollout_logprob_abs_diff"] == pytest.approx(gap, rel=1e-6) and gap > 0.1


def _refuse_rank(rank, model_dir):
    from megarl.engine import MegatronEngine

    actor = ActorConfig(micro_batch_size=4, mini_batch_size=4)
    e = MegatronEngine(model_dir, actor, AlgorithmConfig(), "cpu", 1, 10)
    batch = grpo_batch()
    del batch.tensors["rollout_noise"]
    with pytest.raises(ValueError, match="no 'old_logprobs' and makes 2 optimizer updates"):
        e.train(batch, loss="policy")
    return True


def test_several_updates_need_the_old_logprobs(tmp_path):
    assert run_distributed(_refuse_rank, 1, make_qwen2_dir(tmp_path / "qwen2", tied=True))


def test_config_decides_when_to_recompute():
    base = ["data.prompts_per_step=4", "rollout.n_samples=4"]
    assert not tiny_config(base).recompute_old_logprobs()  # auto, one update: skipped
    assert tiny_config(base + ["actor.mini_batch_size=8"]).recompute_old_logprobs()
    assert tiny_config(base + ["actor.ppo_epochs=2"]).recompute_old_logprobs()
    assert tiny_config(base + ["algorithm.kl_coef=0.1", "algorithm.kl_in_reward=true",
                                     "algorithm.advantage=reinforce_plus_plus"]).recompute_old_logprobs()
    assert tiny_config(base + ["algorithm.recompute_old_logprobs=always"]).recompute_old_logprobs()
    assert not tiny_config(base + ["actor.mini_batch_size=16",
                                         "algorithm.recompute_old_logprobs=never"]).recompute_old_logprobs()
    with pytest.raises(ConfigError, match="recompute_old_logprobs=never needs one optimizer update"):
        tiny_config(base + ["actor.ppo_epochs=2", "algorithm.recompute_old_logprobs=never"])
    with pytest.raises(ConfigError, match="algorithm.recompute_old_logprobs='sometimes'"):
        tiny_config(base + ["algorithm.recompute_old_logprobs=sometimes"])
