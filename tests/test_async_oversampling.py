"""Over-sampling (agent.oversample_groups) in the asynchronous modes' rollout thread: each group is scored as soon as
it is accepted, while the call's other conversations still run, and the batch is the synchronous loop's (the accepted
groups in prompt order, rewards and reward failures as scoring it whole, the unfinished group carried; with dynamic
sampling turning every group down, the finished ones filling it in).

The rollout thread's AsyncSampler runs over a RolloutWorker in this process (its streaming generator iterated directly,
as Ray would) whose agent loop talks to a scripted engine (tests/rollout/test_agent.py): three groups of two
conversations for two wanted. A answers at once; B and C call a tool that returns only once A was scored; B then
answers, while C calls it again, to return only once B was scored: every order asserted here is forced, not raced."""

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from megarl import sampler as sampler_module
from megarl.async_trainer import PromptSource
from megarl.config.tiny import tiny_config
from megarl.models.tiny import build_tiny_model
from megarl.rewards import REWARDS, build_reward, score
from megarl.rollout.agent import AgentLoop
from megarl.rollout.tools import Tool
from megarl.rollout_buffer import RolloutBuffer
from megarl.sampler import AsyncSampler
from megarl.utils.timers import Timers
from megarl.workers.rollout_worker import RolloutWorker

from tests.rollout.test_agent import ScriptedEngine, call, ids

RECIPE = Path(__file__).resolve().parent.parent / "configs" / "tool_calculator.yaml"
WAIT_S = 60.0  # the most the tool waits: past it, it returns and its record fails the test
SCORED: list[str] = []  # the prompts the reward scored, in call order


@REWARDS.register("test_oversampling_recorded")
def recorded_reward(response: str, answer: str, sample: dict) -> float:
    SCORED.append(sample["prompt"])
    if sample["prompt"] == "B:":
        raise ValueError("B's reward fails: counted, scored 0")
    return 1.0


class Hold(Tool):
    """Returns once the prompt `until` was scored and `calls` calls have come in (this one included); records
    whether `until` was scored, per call."""
    name = "hold"

    def __init__(self):
        self.released, self.calls, self.lock = [], 0, threading.Lock()

    def run(self, until: str, calls: int = 0) -> str:
        with self.lock:
            self.calls += 1
        deadline = time.monotonic() + WAIT_S
        while (until not in SCORED or self.calls < calls) and time.monotonic() < deadline:
            time.sleep(0.01)
        with self.lock:
            self.released.append((until, until in SCORED))
        return "ok"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3))


def sample_oversampled(tok, monkeypatch, script: dict, tools: dict, *overrides: str):
    """One rollout batch of the rollout thread (AsyncSampler.sample_batch): two groups wanted, of two conversations
    each, with one group over-sampled; the prompts are `script`'s. Returns the sampler, the batch and its metrics."""
    SCORED.clear()
    cfg = tiny_config([
        "trainer.mode=async", "async.max_staleness=1", "agent.oversample_groups=1", "data.prompts_per_step=2",
        "rollout.n_samples=2", "agent.max_response_tokens=400", "agent.max_new_tokens_per_turn=200",
        "reward.name=test_oversampling_recorded", "reward.isolation=none", *overrides], path=RECIPE)
    worker = RolloutWorker.__new__(RolloutWorker)  # its engine: the scripted one, in this process
    worker.cfg, worker.reward_fn = cfg, None
    worker.agent = AgentLoop(ScriptedEngine(tok, script), tok, tools, cfg.agent)
    prompts = [{"prompt": p, "prompt_ids": ids(tok, p), "answer": ""} for p in script]
    data = SimpleNamespace(batch_size=2, next_batch=lambda size: prompts[:size])
    buffer = RolloutBuffer(groups_per_step=2, max_staleness=1, buffer_batches=0, stale="drop", steps=1)
    sampler = AsyncSampler(cfg, tok, worker, PromptSource(data, buffer), build_reward(cfg.reward, cfg.data.task),
                           Timers(0.0))
    # the actor's calls run here: a streaming one's items as its generator yields them
    monkeypatch.setattr(sampler_module, "stream_rollout", lambda rollout, method, *args, timeout: getattr(
        rollout, method)(*args))
    sampler.rollout_call = lambda method, *args: getattr(worker, method)(*args)
    try:
        return (sampler, *sampler.sample_batch())
    finally:
        worker.agent.close()


def test_oversampled_groups_are_scored_as_they_are_accepted(tok, monkeypatch):
    hold = Hold()
    # B goes on only once C's conversations are in their second call (all six calls came in): on a loaded machine
    # a thread of C's could otherwise still be in its first turn or call when B is accepted
    script = {"A:": ["a"], "B:": [call("hold", until="A:", calls=6), "b"],
              "C:": [call("hold", until="A:"), call("hold", until="B:"), "c"]}
    sampler, batch, metrics = sample_oversampled(tok, monkeypatch, script, {"hold": hold})

    # A was scored while B's and C's conversations were still in their first tool call (each waited for it); B when
    # it was accepted, while C's were in their second; then the call ended, C aborted
    released = [until for until, _ in hold.released]
    assert sorted(released[:4]) == ["A:"] * 4 and set(released) <= {"A:", "B:"} and all(ok for _, ok in hold.released)
    assert SCORED == ["A:", "A:", "B:", "B:"]
    assert metrics == {"agent/groups_started": 3, "agent/groups_resumed": 0, "agent/groups_aborted": 1,
                       "agent/groups_rejected": 0, "agent/stale_samples": 0}

    # the batch of scoring it whole: the accepted groups in prompt order, B's failed rewards 0 and counted
    assert batch["prompt"] == ["A:", "A:", "B:", "B:"] and batch["group"] == [0, 0, 1, 1]
    assert batch["response"] == ["a", "a", "b", "b"]
    whole = score(batch, sampler.reward_fn)
    assert batch["rewards"].tolist() == whole.rewards == [1.0, 1.0, 0.0, 0.0]
    assert batch.meta["reward_failures"] == whole.failed == 2 == sampler.reward_failures.failed

    # C, cut short in its second turn (generated with B's last, or before it: then in the tool call waiting for B's
    # score), goes on in the next rollout batch from where it stands
    (prompt, group), = sampler.partial_groups
    assert prompt["prompt"] == "C:" and len(group) == 2
    for t in group:
        roles = [turn["role"] for turn in t.turns]
        assert not t.finish_reason and roles in (["assistant", "tool"], ["assistant", "tool", "assistant"]), roles


def test_with_dynamic_sampling_finished_groups_fill_the_batch_in_prompt_order(tok, monkeypatch):
    """Every group's rewards are equal: each is turned down (scored in the actor), none counts, all run to their end;
    the first two in prompt order fill the batch in, streamed and scored after the call, as the synchronous loop."""
    script = {"A:": ["a"], "B:": ["b"], "C:": ["c"]}
    sampler, batch, metrics = sample_oversampled(tok, monkeypatch, script, {}, "algorithm.dynamic_sampling=true")
    assert metrics["agent/groups_rejected"] == 3 and metrics["agent/groups_aborted"] == 0
    assert len(SCORED) == 10 and SCORED[6:] == ["A:", "A:", "B:", "B:"]  # the actor's judging, then the fillers
    assert batch["prompt"] == ["A:", "A:", "B:", "B:"] and batch["rewards"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert batch.meta["reward_failures"] == 2 and sampler.partial_groups == []
