"""Where the rollout actor puts its SGLang servers: the training ranks' GPUs (colocated) or the GPUs Ray gave the
actor itself (rollout.sglang_gpus, disaggregated). The servers are recorded, not started (no SGLang on CPU)."""

import pytest
import ray

import megarl.rollout.sglang
from megarl.config import load_config
from megarl.workers.rollout_worker import make_engine


@pytest.fixture
def built(monkeypatch):
    """The SGLangRolloutEngine arguments make_engine passes, with Ray having given this actor GPUs 3 and 5."""
    calls = []
    monkeypatch.setattr(megarl.rollout.sglang, "SGLangRolloutEngine", lambda path, **kwargs: calls.append(kwargs))
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [3, 5])
    return calls


def test_disaggregated_servers_go_on_the_actors_own_gpus_without_the_memory_saver(built, tmp_path):
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang_gpus=2", "rollout.sglang_tp=2",
                             f"trainer.output_dir={tmp_path}"])
    make_engine(cfg, "model", "cuda", gpus=None)
    (kwargs,) = built
    assert kwargs["gpus"] == ["3", "5"] and kwargs["tp"] == 2 and kwargs["colocated"] is False


def test_colocated_servers_go_on_the_training_ranks_gpus(built, tmp_path):
    cfg = load_config(None, ["rollout.engine=sglang", f"trainer.output_dir={tmp_path}"])
    make_engine(cfg, "model", "cuda", gpus=["0", "1"])
    (kwargs,) = built
    assert kwargs["gpus"] == ["0", "1"] and kwargs["colocated"] is True
