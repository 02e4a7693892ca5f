"""The reward model's Bradley-Terry training (train_rm's engine calls) at other parallel layouts, on 2 gloo ranks.

One job: a step at PP=2 equals one at PP=1 (DP=2) in loss, pair accuracy and gradient norm, with pairs packed
as padded rows and as one row per micro-batch (a token budget that splits the step into several micro-batches);
a run at TP=2 saved after step 2 resumes at PP=2 and takes steps 3-4 as the TP=2 run did, its optimizer (Adam's
moments, the LR schedule, the step count) resumed with the weights.
"""

import math
from pathlib import Path

import pytest
import torch

from megarl.config import AlgorithmConfig, OptimConfig, ParallelConfig, RewardModelConfig
from megarl.engine.checkpoint_dir import Checkpoints
from tests.dist_utils import run_distributed
from tests.engine.hf_models import make_qwen2_dir
from tests.engine.test_checkpoint import dp_share, relayout, save
from tests.engine.test_roles import preference_pairs

SAVE_AFTER, STEPS = 2, 4
TOKEN_BUDGET = 24  # one_row: a row holds a few pairs, so a step of 8 pairs takes several micro-batches


def rm_engine(model_dir, tp: int, pp: int, packing: str = "rows", max_tokens: int = 0, cp: int = 1):
    from megarl.engine import MegatronEngine

    relayout(tp, pp, cp)
    cfg = RewardModelConfig(parallel=ParallelConfig(world_size=2, tp=tp, pp=pp, cp=cp), micro_batch_size=4,
                            packing=packing, max_tokens_per_micro_batch=max_tokens,
                            attention="sdpa" if cp > 1 else "auto",
                            optim=OptimConfig(lr=1e-2, warmup_steps=3, decay_style="linear", clip_grad=1.0))
    return MegatronEngine(model_dir, cfg, AlgorithmConfig(), "cpu", 1, total_steps=10, head="value")


def bt_step(engine, step: int) -> dict[str, float]:
    metrics = engine.train(dp_share(preference_pairs(8, seed=step)), loss="bradley_terry")
    return {k: metrics[k] for k in ("loss", "accuracy", "grad_norm", "lr")}


def held_out_scores(engine) -> torch.Tensor:
    """Rewards of 16 held-out pairs' rows (a layout without data parallelism: every rank scores all)."""
    return engine.compute_rewards(preference_pairs(16, seed=99))["rewards"]


def _rm_layouts_rank(rank, model_dir, root):
    root = Path(root)
    out = {}
    for packing, max_tokens in (("rows", 0), ("one_row", TOKEN_BUDGET)):
        for tp, pp in ((1, 1), (1, 2)):  # PP=1 is DP=2: each rank takes 4 whole pairs
            engine = rm_engine(model_dir, tp, pp, packing, max_tokens)
            out[(packing, pp)] = [bt_step(engine, step) for step in (1, 2)]
    engine = rm_engine(model_dir, 1, 1, cp=2)  # each rank holds two of each row's four chunks
    out["cp2"] = [bt_step(engine, step) for step in (1, 2)]
    engine = rm_engine(model_dir, 2, 1)
    out["tp2"] = []
    for step in range(1, STEPS + 1):
        out["tp2"].append(bt_step(engine, step))
        if step == SAVE_AFTER:
            save(engine, root, step)
    out["tp2 scores"] = held_out_scores(engine)
    engine = rm_engine(model_dir, 1, 2)
    engine.load_checkpoint(str(Checkpoints(root).latest() / "actor"))
    out["pp2 resumed version"] = engine.version
    out["pp2 resumed"] = [bt_step(engine, step) for step in range(SAVE_AFTER + 1, STEPS + 1)]
    out["pp2 resumed scores"] = held_out_scores(engine)
    return out


@pytest.fixture(scope="module")
def rm_layouts(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("rm_layouts")
    model_dir = make_qwen2_dir(tmp_path / "qwen2", tied=True)
    return run_distributed(_rm_layouts_rank, 2, model_dir, str(tmp_path / "ckpt"))


def assert_steps_close(got: list[dict], want: list[dict]) -> None:
    assert [m.keys() for m in got] == [m.keys() for m in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


@pytest.mark.parametrize("packing", ["rows", "one_row"])
def test_bradley_terry_step_at_pp2_equals_pp1(rm_layouts, packing):
    pp1, pp2 = rm_layouts[(packing, 1)], rm_layouts[(packing, 2)]
    assert pp1[1]["loss"] < pp1[0]["loss"] and pp1[1]["grad_norm"] > 0  # it trains
    assert abs(pp1[0]["loss"] - math.log(2)) < 1e-6  # the zero-initialised head ties every pair
    assert_steps_close(pp2, pp1)
    # one row per micro-batch splits pairs nowhere: the same step as padded rows
    assert_steps_close(pp1, rm_layouts[("rows", 1)])


def test_bradley_terry_step_at_cp2_equals_pp1(rm_layouts):
    assert_steps_close(rm_layouts["cp2"], rm_layouts[("rows", 1)])


def test_rm_saved_at_tp2_resumes_at_pp2(rm_layouts):
    tp2, resumed = rm_layouts["tp2"], rm_layouts["pp2 resumed"]
    assert rm_layouts["pp2 resumed version"] == SAVE_AFTER  # the optimizer's step count came back
    # steps 3-4 as at TP=2: the weights, and step 4's update (Adam's moments, the warmup's LR) resumed, not reset
    assert_steps_close(resumed, tp2[SAVE_AFTER:])
    torch.testing.assert_close(rm_layouts["pp2 resumed scores"], rm_layouts["tp2 scores"], rtol=0, atol=1e-5)
    assert len({m["loss"] for m in tp2}) == STEPS
