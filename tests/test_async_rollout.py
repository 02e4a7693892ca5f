"""The asynchronous mode's rollout side in a run on CPU (the transformers engine, a tiny model, four steps at
async.max_staleness=1): each group is scored as soon as its samples have been generated, while the rest of its
batch still generates; and weight updates land while batches generate, one per async.partial mode (resume, restart,
finish), with every token stamped with the policy version that produced it. And, without a run, the batch that
the scored groups form.

A hook in the rollout actor (installed with Ray's __ray_call__) sets the responses' lengths through the EOS logit and
holds a decode step until an event the test waits for has happened (a group scored, the trainer's pause), so every
order asserted here is forced, not raced."""

import dataclasses
import math
import threading
import time
from pathlib import Path

import ray
import torch

from megarl.async_trainer import build_trainer
from megarl.config.tiny import tiny_config
from megarl.rewards import REWARDS
from megarl.rollout.base import SamplingParams

from tests.conftest import QUICKSTART
from tests.test_async import metrics_by_step

TOKENS, HOLD_AT = 4, 2  # response length; the decode step (token) at which a generating batch is held for an update
WAIT_S = 60.0  # the most a held step waits: past it the hook goes on and its record fails the test
MODES = {1: "resume", 2: "restart", 3: "finish"}  # the partial mode of the update to version v (v = 1, 2, 3)
# in the trainer's process: the training prompts the reward scored, in call order; the file it creates on the
# first, which the rollout actor's hook waits for; the held-out prompts (not recorded)
RECORD = {"scored": [], "flag": None, "val": set()}


@REWARDS.register("test_async_recorded")
def recorded_reward(response: str, answer: str, sample: dict) -> float:
    if sample["prompt"] not in RECORD["val"]:
        RECORD["scored"].append(sample["prompt"])
        RECORD["flag"].touch()
    return len(response) / 10


class Hook:
    """Lives in the rollout actor. Counts the rollout thread's generate calls (those streaming groups), forces the
    responses' lengths (no EOS, except the first group of the first batch, which ends at its first token), holds:
    the first batch's last decode step until a group was scored, and later batches' step HOLD_AT until the trainer
    pauses generation for an update; and records every segment and every call's generations."""

    def __init__(self, engine, flag: str, n: int):
        self.engine, self.flag, self.n = engine, Path(flag), n
        self.local = threading.local()  # the generate thread's call number and forwards
        self.calls, self.holding, self.scored_while_held, self.held_until_pause = 0, None, None, {}
        self.segments, self.results = [], {}
        generate, forward, segment = engine.generate, engine.model.forward, engine._segment

        def counted(prompts, params, images=None, on_group=None):
            if on_group is not None:
                self.calls += 1
                self.local.call, self.local.forwards = self.calls, 0
            gens = generate(prompts, params, images, on_group)
            if on_group is not None:
                self.results[self.local.call] = [dataclasses.asdict(g) for g in gens]
            return gens

        def recorded(rows, limits, seeds, seg, **kwargs):
            out = segment(rows, limits, seeds, seg, **kwargs)
            if getattr(self.local, "call", None):
                self.segments.append({"call": self.local.call, "version": seg.version, "inputs": rows,
                                      "limits": limits, "outputs": [dataclasses.asdict(g) for g in out]})
            return out

        engine.generate, engine.model.forward, engine._segment = counted, self.forward(forward), recorded

    def forward(self, forward):
        def controlled(*args, **kwargs):
            out = forward(*args, **kwargs)
            call = getattr(self.local, "call", None)
            if call is None:  # evaluation
                return out
            self.local.forwards += 1
            step, eos = self.local.forwards, self.engine.eos_ids
            out.logits[:, -1, eos] = -math.inf
            if call == 1 and step == 1:
                out.logits[:self.n, -1, eos[0]] = 1e4  # group 0 ends at its first token
            if call == 1 and step == TOKENS:  # the batch's last decode step: wait for a group's rewards
                self.scored_while_held = self.wait(self.flag.exists)
            if call > 1 and step == HOLD_AT:  # wait for the update's pause (which then stops, or waits for, us)
                self.holding = call
                self.held_until_pause[call] = self.wait(lambda: self.engine.gate.paused)
                self.holding = None
            return out
        return controlled

    @staticmethod
    def wait(condition) -> bool:
        deadline = time.monotonic() + WAIT_S
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.01)
        return condition()


def install(worker, flag: str, n: int) -> None:
    worker.test_hook = Hook(worker.engine, flag, n)


def hook_state(worker, *fields: str):
    return {f: getattr(worker.test_hook, f) for f in fields}


def test_groups_scored_as_they_end_and_updates_land_mid_generation(tmp_path, ray_local):
    RECORD.update(scored=[], flag=tmp_path / "scored")
    cfg = tiny_config([
        f"trainer.output_dir={tmp_path}", "actor.parallel.world_size=1", "actor.parallel.tp=1",
        "model.tiny_num_layers=1", "data.prompts_per_step=2", "rollout.n_samples=2", "data.val_size=2",
        "rollout.eval_n_samples=1", "sft.steps=0", "trainer.steps=4", "trainer.eval_every=0",
        f"rollout.max_new_tokens={TOKENS}", "reward.name=test_async_recorded", "reward.isolation=none",
        "trainer.save_every=0", "trainer.loggers=[jsonl]", "trainer.mode=async", "async.max_staleness=1",
        "async.partial=resume", "async.batches_at_once=1"], path=QUICKSTART)  # one step-batch a call: each update holds the next
    trainer = build_trainer(cfg)
    RECORD["val"] = {p["prompt"] for p in trainer.val}
    try:
        ray.get(trainer.rollout.__ray_call__.remote(install, str(RECORD["flag"]), 2))
        publish = trainer.publish_policy

        def publish_while_generating():
            """The update to version v (1, 2, 3) waits until batch v+1 is held mid-generation, then pauses it in
            MODES[v]."""
            if trainer.version in MODES:
                deadline = time.monotonic() + WAIT_S
                while ray.get(trainer.rollout.__ray_call__.remote(hook_state, "holding"))["holding"] \
                        != trainer.version + 1:
                    assert time.monotonic() < deadline, f"batch {trainer.version + 1} never held"
                    time.sleep(0.01)
                partial = dataclasses.replace(trainer.cfg.async_, partial=MODES[trainer.version])
                trainer.cfg = dataclasses.replace(trainer.cfg, async_=partial)
            return publish()

        trainer.publish_policy = publish_while_generating
        trainer.fit()
        hook = ray.get(trainer.rollout.__ray_call__.remote(
            hook_state, "scored_while_held", "held_until_pause", "segments", "results"))
    finally:
        trainer.shutdown()
    rows = metrics_by_step(tmp_path)
    segments = {call: [s for s in hook["segments"] if s["call"] == call] for call in (1, 2, 3, 4)}
    results = hook["results"]

    # batch 1: group 0 ended at its first token; its rewards were computed while the batch's last decode step was held
    assert hook["scored_while_held"]
    assert [len(g["token_ids"]) for g in results[1]] == [1, 1, TOKENS, TOKENS]
    scored = RECORD["scored"]
    assert scored[1] == scored[0] != scored[2]  # group 0's two samples first

    # every later batch was held at its token HOLD_AT until the update's pause: the update landed mid-generation
    assert hook["held_until_pause"] == {2: True, 3: True, 4: True}
    assert [rows[s]["rollout/interrupted_rows"] for s in (1, 2, 3)] == [4, 4, 0]  # resume, restart stop; finish not

    # resume (batch 2, begun at version 0, updated to 1): the prefix's tokens and log-probs kept, the rest version 1
    first, rest = segments[2]
    assert (first["version"], rest["version"]) == (0, 1)
    for k, gen in enumerate(results[2]):
        prefix = first["outputs"][k]
        assert len(prefix["token_ids"]) == HOLD_AT and prefix["finish_reason"] == "abort"
        assert gen["token_ids"][:HOLD_AT] == prefix["token_ids"] and gen["logprobs"][:HOLD_AT] == prefix["logprobs"]
        assert rest["inputs"][k] == first["inputs"][k] + prefix["token_ids"] and rest["limits"][k] == TOKENS - HOLD_AT
        assert gen["versions"] == [0] * HOLD_AT + [1] * (TOKENS - HOLD_AT) and gen["interruptions"] == 1

    # restart (batch 3, begun at version 1, updated to 2): generated again from the prompt, all version 2
    first, again = segments[3]
    assert (first["version"], again["version"]) == (1, 2)
    assert again["inputs"] == first["inputs"] and again["limits"] == [TOKENS] * 4
    assert [g["token_ids"] for g in results[3]] == [o["token_ids"] for o in again["outputs"]]
    assert all(g["versions"] == [2] * TOKENS and g["interruptions"] == 1 for g in results[3])

    # finish (batch 4, begun at version 2): the update waited for it; one segment, all version 2
    assert [s["version"] for s in segments[4]] == [2]
    assert all(g["versions"] == [2] * TOKENS and g["interruptions"] == 0 for g in results[4])

    # staleness from each row's oldest token: batch 2 (versions 0 and 1) trained at version 1 is 1 old, batch 3
    # (restarted at version 2) trained at 2 is fresh, batch 4 (version 2) trained at 3 is 1 old; the bound held
    assert [rows[s]["async/staleness_1"] for s in (1, 2, 3, 4)] == [0, 4, 0, 4]
    assert all(rows[s]["async/staleness_max"] <= 1 and rows[s]["async/stale_dropped"] == 0 for s in (1, 2, 3, 4))


def test_sglang_groups_end_with_their_own_requests(tmp_path):
    """The SGLang engine streams a prompt's group as its own request returns (against fake_sglang.py's real HTTP):
    the same generations as one generate() call, a request per group."""
    from tests.rollout.test_sglang_engine import engine as sglang_engine, log

    engine = sglang_engine(tmp_path, deterministic=True)
    prompts, params = [[1, 2, 3], [4, 5], [6]], SamplingParams(max_new_tokens=4, n=2, seed=5)
    try:
        whole = engine.generate(prompts, params)
        before = len(log(engine.servers[0], "/generate"))
        groups = dict(engine.generate_groups(prompts, params))
        requests = log(engine.servers[0], "/generate")[before:]
    finally:
        engine.shutdown()
    assert sorted(groups) == [0, 1, 2]
    for i, group in groups.items():
        assert [dataclasses.asdict(g) for g in group] == [dataclasses.asdict(g) for g in whole[2 * i:2 * i + 2]]
    assert sorted(r["body"]["input_ids"] for r in requests) == sorted([p, p] for p in prompts)


class _DigitsTokenizer:
    """decode() writes the ids out; pad 9 (not 0: the batch's concatenation pads with zeros)."""
    pad_token_id = 9

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_groups_scored_as_they_end_form_the_batch_built_whole(monkeypatch):
    """AsyncSampler.stream_scored: groups that end out of order and differ in width give the batch that
    generations_to_batch builds from all rows in prompt order (pad tokens included), with the rewards of scoring
    it whole."""
    from megarl import sampler as sampler_module
    from megarl.rewards import build_reward
    from megarl.rollout.base import Generation
    from megarl.rollout.batching import generations_to_batch
    from megarl.utils.timers import Timers

    cfg = tiny_config([], path=QUICKSTART)
    side = sampler_module.AsyncSampler(cfg, _DigitsTokenizer(), None, None, build_reward(cfg.reward, cfg.data.task),
                                       Timers(time.perf_counter()))
    side.version = 3
    prompts = [{"prompt": f"p{i}", "prompt_ids": [5] * (i + 1), "answer": "1 1"} for i in range(3)]
    groups = {i: [Generation(i, [1] * (2 * i + 1 + j), [-0.5] * (2 * i + 1 + j), "length") for j in range(2)]
              for i in range(3)}
    monkeypatch.setattr(sampler_module, "stream_rollout", lambda *_, **__: iter([(2, groups[2]), (0, groups[0]),
                                                                                  (1, groups[1])]))

    def to_batch(rows):
        return generations_to_batch(prompts, rows, side.tokenizer.pad_token_id, side.version, side.tokenizer)

    batch, end = side.stream_scored("generate_groups", (), to_batch)
    whole = to_batch([row for i in range(3) for row in groups[i]])
    assert end is None and set(batch.tensors) == set(whole.tensors) | {"rewards"}
    assert all(torch.equal(batch[k], whole[k]) for k in whole.tensors) and 9 in batch["tokens"]
    assert all(batch[k] == whole[k] for k in whole.non_tensors)
    assert batch["rewards"].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]  # only "1 1" is the answer
    assert batch.meta["group_reward_failures"] == [0, 0, 0] and batch.meta["reward_failures"] == 0
