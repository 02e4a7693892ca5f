"""PPO with GAE on CPU, end to end through Ray: actor (with its frozen KL reference), critic and a reward
model, each a megatron engine on its own ranks, packed micro-batches, the transformers rollout engine; with
VAPO's pieces (value pretraining, decoupled and length-adaptive GAE, the positive-example LM loss) and PF-PPO
with replay on, sharing the engines' start-up."""

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megarl.config.tiny import tiny_config
from megarl.models.tiny import build_tiny_model
from megarl.trainer import RLTrainer

from tests.conftest import QUICKSTART as RECIPE


def tiny_reward_model(path: Path) -> str:
    """The tiny architecture with a random value head (score.weight): a reward model in HF layout."""
    build_tiny_model(path, seed=7)
    weights = load_file(path / "model.safetensors")
    hidden = weights["model.embed_tokens.weight"].shape[1]
    weights["score.weight"] = torch.randn(1, hidden, generator=torch.Generator().manual_seed(0))
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def test_ppo_with_critic_reference_and_reward_model(tmp_path, ray_local):
    cfg = tiny_config([
        f"trainer.output_dir={tmp_path}", "trainer.loggers=jsonl", "trainer.steps=2", "sft.steps=0",
        "actor.parallel.world_size=1", "actor.parallel.tp=1", "actor.max_tokens_per_micro_batch=64",
        "data.prompts_per_step=4", "rollout.n_samples=2", "data.val_size=4",
        "algorithm.advantage=gae", "algorithm.kl_coef=0.05", "algorithm.lam=0.9",
        "critic.parallel.world_size=1", "critic.max_tokens_per_micro_batch=64", "critic.optim.lr=1e-3",
        f"reward_model.path={tiny_reward_model(tmp_path / 'reward_model')}",
        "algorithm.gae.critic_lam=1.0", "algorithm.gae.lam_length_alpha=2.0", "algorithm.positive_lm.coef=0.1",
        "algorithm.positive_lm.threshold=-1e9", "algorithm.pf_ppo.method=pow", "algorithm.pf_ppo.replay=4",
        "algorithm.recompute_old_logprobs=always"], path=RECIPE)
    trainer = RLTrainer(cfg)
    try:
        trainer.prepare()
        # VAPO's value pretraining (algorithm.gae.critic_warmup_steps): the critic learns, the policy stays as it was
        probe = trainer.sampler.generate_and_score(trainer.val)
        before = trainer.actor.compute_logprobs(probe)["logprobs"]
        values_before = trainer.critic.compute_values(probe)["values"]
        assert trainer.warm_up_critic()["critic_warmup/grad_norm"] > 0 and trainer.version == 0
        assert torch.equal(trainer.actor.compute_logprobs(probe)["logprobs"], before)
        assert not torch.equal(trainer.critic.compute_values(probe)["values"], values_before)
        for _ in range(2):
            metrics = trainer.step()
            # the reward model scored the samples: its mean is not the rule reward's (exact match, 0 or 1)
            assert metrics["train/reward"] != metrics["train/rule_reward"]
            # the critic gave GAE its values and trained on GAE's returns; the actor trained with the KL loss
            for key in ("critic/vf_loss", "critic/vpred", "critic/grad_norm", "train/pg_loss", "train/kl",
                        "train/grad_norm"):
                assert key in metrics and metrics[key] == metrics[key], key  # present, not NaN
            assert metrics["critic/grad_norm"] > 0 and metrics["train/grad_norm"] > 0
            assert {"timing/values", "timing/reward_model", "timing/ref_logprobs"} <= set(metrics)
            # the critic's update is in timing/train too, beside the policy's and the call's way in
            assert 0 < metrics["perf/engine_update_s"] + metrics["perf/update_dispatch_s"] < metrics["timing/train"]
            assert metrics["perf/update_dispatch_s"] > 0
            # every sample counts as positive (threshold -1e9): the NLL of their tokens is in the loss
            assert metrics["train/positive_lm_nll"] > 0 and 0 < metrics["pf_ppo/distinct_rows"] <= 1
        # after the first step the policy moved away from its frozen reference, and the critic's zero-initialised
        # value head away from zero
        assert metrics["train/kl"] > 0 and metrics["critic/vpred"] != 0
        # PF-PPO kept the 4 best samples for replay, and the second step drew from them
        assert len(trainer.policy_filter.replay) == 4 and metrics["pf_ppo/replayed_rows"] > 0
    finally:
        trainer.shutdown()
