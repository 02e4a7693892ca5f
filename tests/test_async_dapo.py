"""DAPO dynamic sampling in trainer.mode=async (quickstart, a tiny one-layer model, three steps at
async.max_staleness=1): the rollout thread scores each group as it ends and sets aside those whose rewards are all
equal, generating more rounds until a batch holds data.prompts_per_step groups that vary; every group the trainer
trains on varies, within the staleness bound, and the dapo/* counts are those of the groups scored."""

from megarl.async_trainer import build_trainer
from megarl.config.tiny import tiny_config
from megarl.rewards import REWARDS
from megarl.rollout_buffer import split_groups

from tests.conftest import QUICKSTART
from tests.test_async import metrics_by_step

WANT = 2  # data.prompts_per_step


@REWARDS.register("test_async_dapo_half_flat")
def half_flat(response: str, answer: str, sample: dict) -> float:
    """0 for every response to a prompt of odd character sum (its group is flat: dropped), else one that differs
    between responses."""
    return 0.0 if sum(map(ord, sample["prompt"])) % 2 else float(sum(map(ord, response)))


def test_dynamic_sampling_in_async_mode(tmp_path, ray_local):
    cfg = tiny_config([
        f"trainer.output_dir={tmp_path}", "actor.parallel.world_size=1", "actor.parallel.tp=1",
        "model.tiny_num_layers=1", f"data.prompts_per_step={WANT}", "rollout.n_samples=2", "rollout.max_new_tokens=4",
        "data.val_size=2", "rollout.eval_n_samples=1", "sft.steps=0", "trainer.steps=3", "trainer.eval_every=0",
        "reward.name=test_async_dapo_half_flat", "reward.isolation=none", "trainer.save_every=0",
        "trainer.loggers=[jsonl]", "trainer.mode=async", "async.max_staleness=1", "algorithm.dynamic_sampling=true",
        "algorithm.max_sampling_rounds=6"], path=QUICKSTART)
    trainer = build_trainer(cfg)
    sampler = trainer.rollout_sampler
    batches, trained = [], []  # per rollout batch: its scored groups' rewards and its metrics; the trained batches
    score, sample_batch, train_step = sampler.score, sampler.sample_batch, trainer.train_step

    def scored(batch, *args):  # the rollout thread scores one group per call
        out = score(batch, *args)
        batches[-1]["groups"].append(out["rewards"].tolist())
        return out

    def sampled():
        batches.append({"groups": []})
        batch, metrics = sample_batch()
        batches[-1]["metrics"] = metrics
        return batch, metrics

    def training(batch, *args):
        trained.append([group["rewards"].tolist() for group in split_groups(batch)])
        return train_step(batch, *args)

    sampler.score, sampler.sample_batch, trainer.train_step = scored, sampled, training
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    steps = metrics_by_step(tmp_path)

    assert len(batches) == len(trained) == 3
    for step, (made, groups) in enumerate(zip(batches, trained), start=1):
        flat = sum(len(set(rewards)) == 1 for rewards in made["groups"])
        # rounds of WANT prompts until WANT groups vary; the flat ones counted, none used as filler
        assert len(made["groups"]) == WANT * made["metrics"]["dapo/rounds"]
        assert sum(len(set(r)) > 1 for r in made["groups"][:-WANT]) < WANT <= len(made["groups"]) - flat
        dapo = {k: v for k, v in made["metrics"].items() if k.startswith("dapo/")}
        assert dapo == {"dapo/rounds": len(made["groups"]) // WANT, "dapo/groups_dropped": flat,
                        "dapo/filler_groups": 0}
        # the step trained on that batch's groups, every one of them varied, within the bound; its metrics count them
        assert len(groups) == WANT and all(len(set(rewards)) > 1 for rewards in groups)
        assert {k: steps[step][k] for k in dapo} == dapo
        assert steps[step]["async/staleness_max"] <= 1 and steps[step]["async/stale_dropped"] == 0
    assert sum(steps[s]["dapo/groups_dropped"] for s in (1, 2, 3)) > 0  # some groups were flat
