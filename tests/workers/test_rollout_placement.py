"""Where the rollout actor puts its SGLang servers: the training ranks' GPUs (colocated) or the GPUs Ray gave the
actor itself (rollout.sglang_gpus, disaggregated). The servers are recorded, not started (no SGLang on CPU)."""

import pytest
import ray

import megarl.rollout.sglang
from megarl.config.tiny import tiny_config
from megarl.workers.rollout_worker import make_engine


@pytest.fixture
def built(monkeypatch):
    """The SGLangRolloutEngine arguments make_engine passes, with Ray having given this actor GPUs 3 and 5."""
    calls = []
    monkeypatch.setattr(megarl.rollout.sglang, "SGLangRolloutEngine", lambda path, **kwargs: calls.append(kwargs))
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [3, 5])
    return calls


def test_disaggregated_servers_go_on_the_actors_own_gpus_without_the_memory_saver(built, tmp_path):
    cfg = tiny_config(["rollout.engine=sglang", "rollout.sglang_gpus=2", "rollout.sglang_tp=2",
                             f"trainer.output_dir={tmp_path}"])
    make_engine(cfg, "model", "cuda", gpus=None)
    (kwargs,) = built
    assert kwargs["gpus"] == ["3", "5"] and kwargs["tp"] == 2 and kwargs["colocated"] is False


def test_colocated_servers_go_on_the_training_ranks_gpus(built, tmp_path):
    cfg = tiny_config(["rollout.engine=sglang", f"trainer.output_dir={tmp_path}"])
    make_engine(cfg, "model", "cuda", gpus=["0", "1"])
    (kwargs,) = built
    assert kwargs["gpus"] == ["0", "1"] and kwargs["colocated"] is True


def test_disaggregated_servers_larger_than_any_node_are_refused_before_the_actor_waits_forever(monkeypatch, tmp_path):
    from megarl.workers import group

    # two nodes of 4 GPUs, 1 of them taken by training on each: 6 left in all, but at most 3 on one node
    monkeypatch.setattr(group.ray, "available_resources", lambda: {"GPU": 6.0})
    monkeypatch.setattr(group.ray, "nodes", lambda: [{"Alive": True, "Resources": {"GPU": 4.0}},
                                                     {"Alive": True, "Resources": {"GPU": 4.0}},
                                                     {"Alive": False, "Resources": {"GPU": 8.0}}])
    cfg = tiny_config(["rollout.engine=sglang", "rollout.sglang_gpus=6", "rollout.sglang_tp=2",
                             f"trainer.output_dir={tmp_path}"])
    with pytest.raises(RuntimeError, match=r"rollout.sglang_gpus=6: the SGLang servers run on the rollout actor's "
                                           r"node, and the largest node of this Ray cluster has 4 GPU"):
        group.start_rollout(cfg, "model", "cuda")


def test_training_gpus_by_node_in_rank_order():
    """What colocated servers are placed by: each node's GPUs of the training ranks, rank 0's node first (its rank
    sends the weights), a GPU shared by two ranks (roles) once."""
    from megarl.workers.group import TrainGroup

    group = TrainGroup.__new__(TrainGroup)
    group.info = [{"node_id": "b", "gpus": ["1"]}, {"node_id": "a", "gpus": ["0"]}, {"node_id": "b", "gpus": ["0"]},
                  {"node_id": "a", "gpus": ["0"]}]
    assert group.gpus() == [("b", ["1", "0"]), ("a", ["0"])]
