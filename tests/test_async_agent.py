"""The agent loop (multi-turn tool use) in trainer.mode=async on CPU: the calculator-tool recipe, shrunk (a tiny
one-layer model, two steps of two groups of two conversations, async.max_staleness=1, async.partial=resume). Each
group is scored as soon as its conversations have all ended, while the other group's conversations still call tools
and generate; and a weight update lands in the middle of an episode's second turn: the turn goes on from its tokens
under the new weights, every token keeping the policy version that produced it, the episode's staleness counted from
its oldest token.

A hook in the rollout actor (installed with Ray's __ray_call__) plays the model's part: it forces every token
(batch 1: group 0 answers at once, group 1 calls the calculator, then answers; batch 2: both call it), and holds a
batch's first engine call of second turns at decode step HOLD_AT until an event the test waits for has happened (group
0 scored; the trainer's pause for the update), so every order asserted here is forced, not raced (which second turns
join that call depends on when their tool results came in: both outcomes are checked)."""

import json
import threading
import time
from pathlib import Path

import pytest
import ray

from megarl import sampler
from megarl.async_trainer import build_trainer
from megarl.config.tiny import tiny_config

from tests.test_async import metrics_by_step
from tests.test_async_rollout import RECORD, WAIT_S, Hook, hook_state  # RECORD: what reward test_async_recorded scored

RECIPE = Path(__file__).resolve().parent.parent / "configs" / "tool_calculator.yaml"
TOOL_CALL = '<tool_call>{"name":"calculator","arguments":{"expression":"2*3"}}</tool_call>'
ANSWER = "6789"  # the second turn (and group 0's only turn): longer than HOLD_AT
HOLD_AT = 2  # the second turn's decode step at which it is held


class AgentHook:
    """Lives in the rollout actor: numbers the rollout thread's streaming agent calls (rollout batches), forces each
    conversation's tokens (held-out ones end at once) and holds second turns (module docstring)."""

    def __init__(self, worker, flag: str):
        self.engine, self.flag = worker.engine, Path(flag)
        agent = worker.agent_loop()
        tokenizer = agent.tokenizer
        self.eos = tokenizer.eos_token_id
        self.call_ids, self.answer_ids, self.result_end = (tokenizer(t, add_special_tokens=False)["input_ids"]
                                                           for t in (TOOL_CALL, ANSWER, "</result>"))
        self.prompts, self.direct = {}, None  # training prompt -> its rollout batch; batch 1's first group's prompt
        self.batches, self.holding, self.held = 0, None, {}
        self.local = threading.local()  # the engine thread's segment: each row's forced tokens, the decode step
        run_groups, segment, forward = agent.run_groups, self.engine._segment, self.engine.model.forward

        def numbered(groups, params, needed=None, accept=None, on_group=None, images=None):
            if on_group is not None:  # the rollout thread's (evaluation's calls have none)
                self.batches += 1
                self.prompts |= {tuple(g[0].prompt_ids): self.batches for g in groups}
                self.direct = self.direct or tuple(groups[0][0].prompt_ids)
            return run_groups(groups, params, needed, accept, on_group, images)

        def planned(rows, limits, seeds, seg, **kwargs):
            self.local.plans, self.local.step = [self.plan(row) for row in rows], 0
            return segment(rows, limits, seeds, seg, **kwargs)

        agent.run_groups, self.engine._segment, self.engine.model.forward = numbered, planned, self.forward(forward)

    def plan(self, row: list[int]) -> dict:
        """What the row generates in this segment: its batch, its turn, whether the turn begins here, its tokens."""
        prompt = next((p for p in self.prompts if tuple(row[:len(p)]) == p), None)
        if prompt is None:  # a held-out prompt: it answers nothing
            return {"batch": 0, "turn": 1, "begins": True, "tokens": [self.eos]}
        response = row[len(prompt):]
        if self.eos not in response:  # the first turn
            script, done = (self.answer_ids if prompt == self.direct else self.call_ids) + [self.eos], len(response)
            turn = 1
        else:  # the second: after the calculator's result
            end = max(i + len(self.result_end) for i in range(len(response))
                      if response[i:i + len(self.result_end)] == self.result_end)
            script, done, turn = self.answer_ids + [self.eos], len(response) - end, 2
        return {"batch": self.prompts[prompt], "turn": turn, "begins": done == 0, "tokens": script[done:]}

    def forward(self, forward):
        def forced(*args, **kwargs):
            out = forward(*args, **kwargs)
            plans, step = self.local.plans, self.local.step
            self.local.step += 1
            for k, plan in enumerate(plans):
                out.logits[k, -1, :] = -1e4
                out.logits[k, -1, plan["tokens"][step] if step < len(plan["tokens"]) else self.eos] = 0.0
            held = [p["batch"] for p in plans if p["turn"] == 2 and p["begins"] and p["batch"] not in self.held]
            if held and step + 1 == HOLD_AT:
                batch = held[0]
                self.holding = batch
                # batch 1: until group 0 was scored; batch 2: until the trainer pauses generation for its update
                self.held[batch] = Hook.wait(self.flag.exists if batch == 1 else lambda: self.engine.gate.paused)
                self.holding = None
            return out
        return forced


def install(worker, flag: str) -> None:
    worker.test_hook = AgentHook(worker, flag)


def shrunk_recipe(tmp_path: Path, *overrides: str):
    """The calculator-tool recipe in trainer.mode=async at async.max_staleness=1, shrunk: a tiny one-layer model, two
    steps of two groups of two conversations."""
    traces = tmp_path / "traces.jsonl"  # the recipe's warm start is off; its file must still be readable
    traces.write_text(json.dumps({"prompt": "12*34=", "answer": "408",
                                  "messages": [{"role": "assistant", "content": "408"}]}) + "\n")
    return tiny_config([
        f"trainer.output_dir={tmp_path}", f"sft.data={traces}", "sft.steps=0", "model.tiny_num_layers=1",
        "data.prompts_per_step=2", "rollout.n_samples=2", "data.val_size=2", "rollout.eval_n_samples=1",
        "trainer.steps=2", "trainer.eval_every=0", "trainer.loggers=[jsonl]", "trainer.mode=async",
        "async.max_staleness=1", *overrides], path=RECIPE)


def test_agent_groups_scored_as_they_end_and_an_update_lands_mid_episode(tmp_path, ray_local, monkeypatch):
    RECORD.update(scored=[], flag=tmp_path / "scored")
    # one step-batch a call: the update lands in the episode of the batch it holds
    cfg = shrunk_recipe(tmp_path, "reward.name=test_async_recorded", "reward.isolation=none", "async.partial=resume",
                        "async.batches_at_once=1")
    streamed = []  # (method, (group index, its conversations)) as the rollout thread received them
    stream = sampler.stream_rollout

    def recorded_stream(rollout, method, *args, **kwargs):
        for item in stream(rollout, method, *args, **kwargs):
            streamed.append((method, item))
            yield item
    monkeypatch.setattr(sampler, "stream_rollout", recorded_stream)
    trainer = build_trainer(cfg)
    RECORD["val"] = {p["prompt"] for p in trainer.val}
    try:
        ray.get(trainer.rollout.__ray_call__.remote(install, str(RECORD["flag"])))
        publish = trainer.publish_policy

        def publish_mid_episode():
            """The update to version 1 waits until batch 2 is held in its second turns."""
            deadline = time.monotonic() + WAIT_S
            while trainer.version == 1 and ray.get(trainer.rollout.__ray_call__.remote(hook_state, "holding"))[
                    "holding"] != 2:
                assert time.monotonic() < deadline, "batch 2 never held"
                time.sleep(0.01)
            return publish()

        trainer.publish_policy = publish_mid_episode
        trainer.fit()
        held = ray.get(trainer.rollout.__ray_call__.remote(hook_state, "held"))["held"]
    finally:
        trainer.shutdown()
    rows = metrics_by_step(tmp_path)

    # batch 1: group 0 (answered at once) was scored while group 1's second turn was held, and streamed first
    assert held == {1: True, 2: True}
    assert {method for method, _ in streamed} == {"rollout_agent_groups"} and len(streamed) == 4
    assert [index for _, (index, _) in streamed[:2]] == [0, 1]
    scored = RECORD["scored"]
    assert scored[0] == scored[1] != scored[2] == scored[3]
    assert rows[1]["train/reward"] == pytest.approx(len(ANSWER) / 10)  # all answered ANSWER (test_async_recorded)

    # batch 2: begun under version 0; the update to version 1 interrupted the second turns in flight at token HOLD_AT
    # (those whose tool results were in when the held engine call began), which went on from their tokens: the first
    # turn and HOLD_AT tokens of the second from version 0, the rest from version 1; a second turn begun after the
    # update is all version 1
    interrupted = 0
    for _, (_, group) in streamed[2:]:
        for t in group:
            assert [turn["role"] for turn in t.turns] == ["assistant", "tool", "assistant"]
            assert t.finish_reason == "stop"
            (call, call_end), (tool, tool_end), (answer, answer_end) = (turn["span"] for turn in t.turns)
            assert t.turns[1]["calls"][0]["result"] == "6" and t.turns[2]["text"] == ANSWER
            assert t.versions[call:call_end] == [0] * (call_end - call) and t.policy_version == 0
            assert t.versions[tool:tool_end] == [None] * (tool_end - tool)
            second = t.versions[answer:answer_end]
            assert second in ([0] * HOLD_AT + [1] * (len(ANSWER) + 1 - HOLD_AT), [1] * (len(ANSWER) + 1)), second
            interrupted += second[0] == 0
    assert interrupted == rows[1]["rollout/interrupted_rows"] >= 1
    # staleness from each episode's oldest token: batch 2, trained at version 1, is one version old; the bound held
    assert (rows[1]["async/staleness_0"], rows[2]["async/staleness_1"]) == (4, 4)
    assert rows[2]["async/staleness_max"] == 1 and rows[2]["async/stale_dropped"] == 0
