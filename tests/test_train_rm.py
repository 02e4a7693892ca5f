"""python -m megarl.train_rm end to end on one CPU rank (Ray, the Megatron engine): a reward model learns an easy
preference from a pair file, a resumed run equals the uninterrupted one, and the exported HF directory scores as
the trained engine does in transformers (AutoModelForSequenceClassification) and is what RL's reward_model.path
takes."""

import json
import random

import pytest
import torch

from megarl.config.tiny import TINY_ARGS, tiny_config
from megarl.data.files import write_records
from megarl.data.preferences import pair_batch
from megarl.rm_trainer import RMTrainer
from megarl.train_rm import main
from megarl.train import main as train_main
from megarl.utils.tracking import run_dir

from tests.conftest import QUICKSTART

STEPS = 6


def easy_pairs(path, n: int, seed: int) -> str:
    """Prompts of random letters; the chosen response ends in 'y', the rejected one in 'n'."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 5))) + ">"
        rows.append({"prompt": prompt, "chosen": prompt[:2] + "y", "rejected": prompt[:2] + "n"})
    write_records(path, rows)
    return str(path)


def rm_config(tmp_path, out: str, *overrides):
    return tiny_config([
        "model.path=tiny", "model.tiny_num_layers=1", "model.tiny_hidden_size=32",
        "model.tiny_intermediate_size=64", f"preference.train={easy_pairs(tmp_path / 'train.jsonl', 200, 0)}",
        f"preference.val={easy_pairs(tmp_path / 'val.jsonl', 16, 1)}", "preference.pairs_per_step=16",
        "reward_model.optim.lr=3e-3", "reward_model.micro_batch_size=32", f"trainer.steps={STEPS}",
        "trainer.eval_every=3", "trainer.save_every=3", "trainer.loggers=[jsonl]", "trainer.device=cpu",
        f"trainer.output_dir={tmp_path / out}", *overrides])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ray_local):
    """One run of STEPS steps (checkpoints after 3 and 6), exported; its trainer kept up for scoring."""
    tmp_path = tmp_path_factory.mktemp("rm")
    trainer = RMTrainer(rm_config(tmp_path, "a"))
    history = trainer.fit()
    exported = trainer.export()
    yield tmp_path, trainer, history, exported
    trainer.shutdown()


def metrics_rows(path) -> list[dict]:
    return [json.loads(line) for line in (run_dir(path) / "metrics.jsonl").read_text().splitlines()]


def test_reward_model_learns_and_resumes_exactly(trained):
    tmp_path, trainer, history, _ = trained
    accuracy = history["val/pair_accuracy"]
    assert sorted(accuracy) == [0, 3, 6]
    assert accuracy[0] == 0.5  # a zero-initialised head scores every side 0: a tie, half right
    assert accuracy[6] >= 0.9 and history["val/margin"][6] > history["val/margin"][3] > 0, history
    logged = [row["step"] for row in metrics_rows(tmp_path / "a")]
    first = {row["step"]: row for row in metrics_rows(tmp_path / "a")}
    assert first[0]["data/train_pairs"] == 200 and first[0]["data/skipped_pairs"] == 0
    assert first[6]["rm/loss"] < first[1]["rm/loss"]
    scores = trainer.score_pairs(trainer.data.val)
    # resumed after step 3, on the same ranks: every piece of state they held after step 6 (weights, optimizer,
    # LR schedule, RNG, data position) must come back from the checkpoint, or steps 4-6 would differ
    trainer.cfg.trainer.resume = str(tmp_path / "a" / "checkpoints" / "step_00000003")
    assert trainer.fit()["val/pair_accuracy"] == accuracy
    rows = metrics_rows(tmp_path / "a")  # the rows of steps 4-6 replaced by the resumed run's (Tracker.rewind)
    assert [row["step"] for row in rows] == logged
    second = {row["step"]: row for row in rows}
    for step in (4, 5, 6):
        assert {k: second[step][k] for k in ("rm/loss", "rm/grad_norm", "rm/lr", "rm/accuracy")} == \
               {k: first[step][k] for k in ("rm/loss", "rm/grad_norm", "rm/lr", "rm/accuracy")}
    assert torch.equal(trainer.score_pairs(trainer.data.val), scores)


def test_reward_model_resumes_at_another_layout(trained):
    """Saved at TP=1 on one rank, resumed at TP=2 on two: steps 4-6 continue the TP=1 run (float tolerance: TP
    changes the reduction order), so the weights, the optimizer's moments and step count, the LR schedule and the
    data position all came back (a reset optimizer or data position would train other steps)."""
    tmp_path, _, history, _ = trained
    first = {}
    for row in metrics_rows(tmp_path / "a"):
        first.setdefault(row["step"], row)
    cfg = rm_config(tmp_path, "b", "reward_model.parallel.world_size=2", "reward_model.parallel.tp=2",
                    f"trainer.resume={tmp_path / 'a' / 'checkpoints' / 'step_00000003'}")
    second = RMTrainer(cfg)
    try:
        resumed = second.fit()
    finally:
        second.shutdown()
    assert resumed["val/pair_accuracy"] == history["val/pair_accuracy"]
    torch.testing.assert_close(resumed["val/margin"], history["val/margin"], rtol=0, atol=1e-5)
    rows = {row["step"]: row for row in metrics_rows(tmp_path / "b")}
    assert sorted(rows) == [4, 5, 6]
    keys = ("rm/loss", "rm/grad_norm", "rm/lr", "rm/accuracy")
    for step in (4, 5, 6):
        torch.testing.assert_close({k: rows[step][k] for k in keys}, {k: first[step][k] for k in keys},
                                   rtol=0, atol=1e-5)


def test_export_scores_as_trained_in_transformers_and_in_rl(trained):
    from transformers import AutoModelForSequenceClassification

    tmp_path, trainer, _, exported = trained
    pairs = trainer.data.val
    scores = trainer.score_pairs(pairs)
    model = AutoModelForSequenceClassification.from_pretrained(exported).eval()
    assert type(model).__name__ == "Qwen2ForSequenceClassification" and model.config.num_labels == 1
    rows = pair_batch(pairs, trainer.pad_id)  # right-padded: transformers reads the last token that is not padding
    with torch.no_grad():
        hf = model(input_ids=rows["tokens"], attention_mask=rows["attention_mask"]).logits[:, 0]
    torch.testing.assert_close(hf, scores, rtol=0, atol=1e-5)
    # RL takes it as reward_model.path (its dry run reads the model's config and layout; the engine reading a
    # directory's score.weight in RL: tests/test_ppo_e2e.py)
    assert train_main(["--config", str(QUICKSTART), "--dry-run", f"reward_model.path={exported}"]) == 0
    # an earlier export of train_rm at reward_model.path may be replaced; anything else there is refused before training
    assert main(["--dry-run", *TINY_ARGS, f"trainer.output_dir={tmp_path / 'a'}", "preference.task_pairs=10"]) == 0
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "weights.bin").write_text("x")
    assert main(["--dry-run", *TINY_ARGS, f"reward_model.path={tmp_path / 'other'}", "preference.task_pairs=10"]) == 2
