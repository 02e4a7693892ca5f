"""The sampling stage (megarl/sampler.py: DAPO dynamic sampling rounds, ReMax's greedy baseline) driven by a scripted
generator in place of the rollout engine so every reward is known in advance; the trainer's KL controller."""

import torch

from megarl.algorithms.kl import kl_controller
from megarl.config.tiny import tiny_config
from megarl.protocol import Batch
from megarl.rewards import get_reward_fn
from megarl.sampler import Sampler
from megarl.trainer import RLTrainer
from megarl.utils.timers import Timers


class Prompts:
    def __init__(self):
        self.served = 0

    def next_batch(self):
        self.served += 1
        return [{"prompt": f"p{self.served}-{i}", "answer": "ok"} for i in range(2)]


class ScriptedSampler(Sampler):
    """A Sampler whose generate() answers round r with responses_per_round[r] (2 prompts x 2 samples), and a greedy
    call with greedy_responses."""

    def __init__(self, responses_per_round, greedy_responses=None, *overrides):
        cfg = tiny_config(["data.prompts_per_step=2", "rollout.n_samples=2", *overrides])
        super().__init__(cfg, None, None, Prompts(), get_reward_fn("exact_match"), Timers())
        self.rounds, self.greedy_responses = iter(responses_per_round), greedy_responses
        self.first_groups = []  # each round's first group number (its sampling seed derives from it)

    def generate(self, prompts, evaluation=False, greedy=False, first_group=0):
        self.first_groups.append(first_group)
        responses = self.greedy_responses[:len(prompts)] if greedy else next(self.rounds)
        n = len(responses) // len(prompts)
        return Batch({"loss_mask": torch.ones(len(responses), 3)},
                     {"group": [i // n for i in range(len(responses))], "response": responses,
                      "prompt": [prompts[i // n]["prompt"] for i in range(len(responses))],
                      "answer": ["ok"] * len(responses)})


def test_dynamic_sampling_refills_from_later_rounds():
    # round 1: group 0 all right (dropped), group 1 mixed; round 2: group 2 all wrong, group 3 mixed
    sampler = ScriptedSampler([["ok", "ok", "ok", "no"], ["no", "no", "no", "ok"]], None,
                              "algorithm.dynamic_sampling=true")
    batch, metrics = sampler.sample_batch()
    assert metrics == {"dapo/rounds": 2, "dapo/groups_dropped": 2, "dapo/filler_groups": 0}
    assert batch["group"] == [1, 1, 3, 3] and batch["rewards"].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert sampler.data.served == 2 and sampler.first_groups == [0, 2]  # each round samples with its own seed


def test_dynamic_sampling_stops_at_max_rounds_and_fills():
    sampler = ScriptedSampler([["ok", "ok", "ok", "no"], ["no", "no", "ok", "ok"]], None,
                              "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=2")
    batch, metrics = sampler.sample_batch()
    assert metrics == {"dapo/rounds": 2, "dapo/groups_dropped": 3, "dapo/filler_groups": 1}
    assert batch["group"] == [0, 0, 1, 1]  # group 1 (mixed), then the first all-equal group to fill


def test_remax_baseline_is_the_greedy_response_reward_of_each_prompt():
    sampler = ScriptedSampler([["ok", "no", "no", "no"]], ["no", "ok"], "algorithm.advantage=remax")
    batch, metrics = sampler.sample_batch()
    assert metrics == {} and batch["baseline_rewards"].tolist() == [0.0, 0.0, 1.0, 1.0]


def test_adaptive_kl_coefficient_follows_the_measured_kl():
    trainer = RLTrainer.__new__(RLTrainer)
    trainer.cfg = tiny_config(["algorithm.advantage=reinforce_plus_plus", "algorithm.kl_in_reward=true",
                               "algorithm.kl_coef=0.1", "algorithm.kl_target=0.01", "algorithm.kl_horizon=100"])
    trainer.kl_ctl = kl_controller(trainer.cfg.algorithm)
    batch = Batch({"rewards": torch.zeros(10)}, meta={"reward_kl": 0.02})  # KL twice the target: error +0.2
    assert trainer.update_kl_coef(batch, {}) == {"algorithm/kl_coef": 0.1, "algorithm/kl": 0.02}
    assert trainer.kl_ctl.value == 0.1 * (1 + 0.2 * 10 / 100)
