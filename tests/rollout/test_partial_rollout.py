"""Partial rollouts on the transformers engine (megarl.rollout.partial): a generation interrupted by a weight update
and continued keeps, per token, the version and the log-probs of the policy that produced it, and continues with
the draws the uninterrupted generation would have made."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoTokenizer

from megarl.config import AgentConfig
from megarl.models.tiny import build_tiny_model
from megarl.rollout.agent import AgentLoop, trajectories_to_batch
from megarl.rollout.base import SamplingParams
from megarl.rollout.hf import HFRolloutEngine
from megarl.rollout.tools import build_tools
from megarl.rollout.tools.parsers import TOOL_PARSERS, ToolCall

PROMPTS = ["abcd>", "x>", "hello world>"]
PARAMS = SamplingParams(max_new_tokens=10, temperature=1.0, n=2, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=1))


@pytest.fixture(scope="module")
def prompts(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def new_weights(model_dir):
    engine = HFRolloutEngine(model_dir)
    gen = torch.Generator().manual_seed(0)
    return {n: t + 0.3 * torch.randn(t.shape, generator=gen) for n, t in engine.named_weights().items()}


def interrupted(engine, prompts, params, after_forwards, partial, weights=None, call=None, versions=(0, 1)):
    """generate() (or `call()`) in a thread; at its `after_forwards`-th model forward, the test pauses the engine
    (partial), loads `weights` (if any) and resumes it as versions[1] (it began as versions[0]). Returns what the
    call returned and the pause's report."""
    reached, calls = threading.Event(), [0]
    forward = engine.model.forward

    def counting(*args, **kwargs):
        calls[0] += 1
        if calls[0] == after_forwards:
            reached.set()
            if partial != "finish":  # the decode loop sees the stop flag right after this step's token
                assert engine.gate.stop.wait(10)
        return forward(*args, **kwargs)

    engine.model.forward = counting
    engine.resume_generation(versions[0])
    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(call or (lambda: engine.generate(prompts, params)))
        assert reached.wait(10)
        report = engine.pause_generation(partial)
        if weights is not None:
            engine.update_weights(list(weights.items()))
        engine.resume_generation(versions[1])
        return result.result(timeout=30), report


def teacher_forced(engine, prompt, response):
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_resume_with_the_same_weights_equals_the_uninterrupted_generation(model_dir, prompts, temperature):
    params = SamplingParams(**vars(PARAMS) | {"temperature": temperature})
    whole = HFRolloutEngine(model_dir).generate(prompts, params)
    engine = HFRolloutEngine(model_dir)
    gens, report = interrupted(engine, prompts, params, after_forwards=4, partial="resume",
                               weights=engine.named_weights())
    assert report["rollout/interrupted_rows"] == 6
    for g, w in zip(gens, whole):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
        assert g.versions == [0] * 4 + [1] * 6 and g.interruptions == 1


def test_resume_with_new_weights_keeps_each_tokens_policy(model_dir, prompts, new_weights):
    params = SamplingParams(**vars(PARAMS) | {"n": 1})
    old = HFRolloutEngine(model_dir)
    engine = HFRolloutEngine(model_dir)
    gens, _ = interrupted(engine, prompts, params, after_forwards=3, partial="resume", weights=new_weights)
    uninterrupted = old.generate(prompts, params)
    # what the new policy draws after each row's first 3 tokens (row k keeps its seed: prompt k's)
    continued = engine.generate([prompts[k] + g.token_ids[:3] for k, g in enumerate(gens)],
                                SamplingParams(**vars(params) | {"max_new_tokens": 7}))
    for k, g in enumerate(gens):
        prompt = prompts[g.prompt_index]
        assert g.versions == [0] * 3 + [1] * 7
        assert g.token_ids[:3] == uninterrupted[k].token_ids[:3]
        assert g.token_ids[3:] == continued[k].token_ids
        assert g.token_ids != uninterrupted[k].token_ids  # the new policy did write the rest
        # log-probs: the old policy's on its tokens, the new policy's on the rest
        torch.testing.assert_close(torch.tensor(g.logprobs[:3]), teacher_forced(old, prompt, g.token_ids)[:3],
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(g.logprobs[3:]), teacher_forced(engine, prompt, g.token_ids)[3:],
                                   atol=1e-5, rtol=0)


def test_restart_finish_and_the_interruption_bound(model_dir, prompts, new_weights):
    fresh = HFRolloutEngine(model_dir)
    fresh.update_weights(list(new_weights.items()))
    new_policy = fresh.generate(prompts, PARAMS)
    old_policy = HFRolloutEngine(model_dir).generate(prompts, PARAMS)

    restarted, _ = interrupted(HFRolloutEngine(model_dir), prompts, PARAMS, 3, "restart", new_weights)
    assert [g.token_ids for g in restarted] == [g.token_ids for g in new_policy]
    assert all(g.versions == [1] * 10 and g.interruptions == 1 for g in restarted)

    finished, report = interrupted(HFRolloutEngine(model_dir), prompts, PARAMS, 3, "finish", new_weights)
    assert report["rollout/interrupted_rows"] == 0  # the pause waited for the rows to end
    assert [g.token_ids for g in finished] == [g.token_ids for g in old_policy]
    assert all(g.versions == [0] * 10 and g.interruptions == 0 for g in finished)

    bounded, _ = interrupted(HFRolloutEngine(model_dir), prompts,
                             SamplingParams(**vars(PARAMS) | {"max_interruptions": 0}), 3, "resume", new_weights)
    assert all(g.finish_reason == "abort" and g.versions == [0] * 3 and g.interruptions == 1 for g in bounded)


def test_cancelled_rows_end_and_are_not_continued(model_dir, prompts):
    engine = HFRolloutEngine(model_dir)
    forward = engine.model.forward

    def cancelling(*args, **kwargs):  # over-sampling's abort, arriving during the third decode step
        if engine.gate.running and forward_calls.append(1) is None and len(forward_calls) == 3:
            engine.abort()
        return forward(*args, **kwargs)

    forward_calls = []
    engine.model.forward = cancelling
    gens = engine.generate(prompts, PARAMS)
    assert all(g.finish_reason == "abort" and len(g.token_ids) == 3 and g.interruptions == 0 for g in gens)


def test_weights_cannot_change_under_a_running_generation(model_dir, prompts):
    engine = HFRolloutEngine(model_dir)
    engine.gate.enter(1)  # as a generate() call does while it runs
    with pytest.raises(RuntimeError, match="pause_generation first"):
        engine.update_weights(list(engine.named_weights().items()))
    engine.gate.leave(1)
    engine.update_weights(list(engine.named_weights().items()))  # idle: fine


@TOOL_PARSERS.register("test_partial_always_calls")
def always_calls(text):
    return [ToolCall("calculator", {"expression": "6*7"})]


def test_agent_turns_keep_their_tokens_versions(model_dir, prompts, new_weights):
    """A conversation's second turn interrupted after 3 of its 6 tokens: its trajectory keeps, per token, the version
    that wrote it (None on the tool's observation tokens); policy_version is its oldest token's."""
    engine = HFRolloutEngine(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    config = AgentConfig(max_turns=2, max_new_tokens_per_turn=6, max_response_tokens=200,
                         parser="test_partial_always_calls")
    agent = AgentLoop(engine, tok, build_tools(["calculator"]), config)
    params = SamplingParams(n=1, seed=3, ignore_eos=True)
    try:  # turn 1: forwards 1-6; turn 2: its prefill is forward 7, so forward 9 writes its third token
        (traj,), _ = interrupted(engine, None, None, 9, "resume", new_weights, versions=(3, 4),
                                 call=lambda: agent.run([prompts[0]], params, policy_version=2))
    finally:
        agent.close()
    observation = traj.turns[1]["span"]
    assert traj.finish_reason == "max_turns" and traj.turns[0]["span"] == [0, 6]
    assert traj.versions == [3] * 6 + [None] * (observation[1] - observation[0]) + [3] * 3 + [4] * 3
    assert traj.policy_version == 3  # created under version 2, its first token written by version 3
    assert trajectories_to_batch([{"prompt": "", "answer": ""}], [traj], tok.pad_token_id, tok)["policy_version"] \
        .tolist() == [3]


# ---- SGLang: the same partial rollouts against fake_sglang.py (real HTTP, sglang 0.5.17's abort answers) ----------

def test_sglang_pause_aborts_and_resumes_from_the_tokens_so_far(tmp_path):
    from tests.rollout.test_sglang_engine import configure, engine as sglang_engine, log

    e = sglang_engine(tmp_path, deterministic=True)
    params = SamplingParams(max_new_tokens=8, n=2, seed=5)
    try:
        whole = e.generate([[1, 2, 3]], params)
        server = e.servers[0]
        configure(server, generate_delay=30.0)  # a long generation, which the pause aborts
        e.resume_generation(0)
        with ThreadPoolExecutor(1) as pool:
            result = pool.submit(e.generate, [[1, 2, 3]], params)
            while not log(server, "/generate")[1:]:
                threading.Event().wait(0.02)
            report = e.pause_generation("resume")
            configure(server, generate_delay=0.0)
            posted = len(log(server, "/generate"))
            assert posted == 2 and log(server)[-1]["path"] == "/abort_request"  # nothing re-sent while paused
            e.resume_generation(1)
            gens = result.result(timeout=30)
        first, again = log(server, "/generate")[1:]  # aborted after 4 tokens: re-sent from them, with the rest
    finally:
        e.shutdown()
    assert report["rollout/interrupted_rows"] == 2
    assert [g.token_ids for g in gens] == [g.token_ids for g in whole]
    assert all(g.versions == [0] * 4 + [1] * 4 and g.interruptions == 1 and g.finish_reason == "length" for g in gens)
    assert again["body"]["input_ids"] == [[1, 2, 3] + g.token_ids[:4] for g in gens]
    assert [sp["max_new_tokens"] for sp in again["body"]["sampling_params"]] == [4, 4]
    assert [sp["sampling_seed"] for sp in again["body"]["sampling_params"]] == \
        [sp["sampling_seed"] for sp in first["body"]["sampling_params"]]
