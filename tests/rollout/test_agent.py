import asyncio
import json
import time

import pytest
import torch
from transformers import AutoTokenizer

from megarl.data.dataset import sft_batch
from megarl.models.tiny import build_tiny_model
from megarl.rollout.agent import (AgentConfig, AgentLoop, ChatTemplateObservations, TextObservations, Trajectory,
                                  trajectories_to_batch)
from megarl.rollout.base import Generation, ImageInputs, RolloutEngine, SamplingParams
from megarl.rollout.hf import HFRolloutEngine
from megarl.rollout.tools import Tool, ToolResult, build_tools
from megarl.rollout.tools.parsers import TOOL_PARSERS, ToolCall


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3))


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def call(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class ScriptedEngine(RolloutEngine):
    """Test double: answers turn k of the conversation whose prompt is P with script[P][k] + EOS,
    cut at max_new_tokens like a real engine. Log-probs are distinct made-up numbers (token t of a
    turn gets -(k + 1) - t / 100) so their positions can be checked; turn k is the number of EOS
    tokens already in the context after the prompt."""

    def __init__(self, tok, script: dict[str, list[str]]):
        self.tok, self.script, self.calls = tok, script, []

    def generate(self, prompts, params):
        self.calls.append(len(prompts))
        gens = []
        for i, context in enumerate(prompts):
            prompt = next(p for p in self.script if context[:len(ids(self.tok, p))] == ids(self.tok, p))
            turn = context[len(ids(self.tok, prompt)):].count(self.tok.eos_token_id)
            tokens = ids(self.tok, self.script[prompt][turn]) + [self.tok.eos_token_id]
            logprobs = [-(turn + 1) - t / 100 for t in range(len(tokens))]
            cut = len(tokens) > params.max_new_tokens
            gens.append(Generation(i, tokens[:params.max_new_tokens], logprobs[:params.max_new_tokens],
                                   "length" if cut else "stop"))
        return gens

    def update_weights(self, named_tensors):
        raise NotImplementedError

    def named_weights(self):
        raise NotImplementedError


def obs(tok, *results):
    return TextObservations(tok).render(list(results), None)


def run_agent(engine, tok, prompts, config, tools=None, n=1):
    agent = AgentLoop(engine, tok, build_tools(["calculator"]) if tools is None else tools, config)
    try:
        trajectories = agent.run([ids(tok, p) for p in prompts], SamplingParams(n=n), policy_version=5)
    finally:
        agent.close()
    rows = [{"prompt": p, "answer": ""} for p in prompts]
    return trajectories, trajectories_to_batch(rows, trajectories, tok.pad_token_id, tokenizer=tok)


def test_layout_interleaves_model_turns_and_observations_exactly(tok):
    turn1 = "let me compute " + call("calculator", expression="6*7")
    script = {"Q1:": [turn1, "42"],
              "Q2:": [call("calculator", expression="1/0") + call("nope") + "<tool_call>{bad</tool_call>", "ok"],
              "Q3:": ["7"]}
    trajectories, batch = run_agent(ScriptedEngine(tok, script), tok, list(script), AgentConfig())
    eos = tok.eos_token_id

    observation = obs(tok, "42")
    model_1, model_2 = ids(tok, turn1) + [eos], ids(tok, "42") + [eos]
    row = ids(tok, "Q1:") + model_1 + observation + model_2
    assert batch["tokens"][0, :len(row)].tolist() == row
    expected_mask = [0] * 3 + [1] * len(model_1) + [0] * len(observation) + [1] * len(model_2)
    assert batch["loss_mask"][0, :len(row)].tolist() == expected_mask and batch["loss_mask"][0, len(row):].sum() == 0
    expected_lp = [0.0] * 3 + [-1 - t / 100 for t in range(len(model_1))] + [0.0] * len(observation) \
        + [-2 - t / 100 for t in range(len(model_2))]
    torch.testing.assert_close(batch["rollout_logprobs"][0, :len(row)], torch.tensor(expected_lp))
    assert batch["attention_mask"][0].tolist() == [1] * len(row) + [0] * (batch["tokens"].shape[1] - len(row))
    assert batch["response"] == ["42", "ok", "7"] and batch["policy_version"].tolist() == [5, 5, 5]

    t1, t2, t3 = (b for b in batch["trajectory"])
    assert [t["finish_reason"] for t in (t1, t2, t3)] == ["stop", "stop", "stop"]
    assert (t1["num_turns"], t1["num_tool_calls"], t3["num_tool_calls"]) == (2, 1, 0)
    assert t1["turns"][1]["calls"][0]["result"] == "42"
    results = [c["result"] for c in t2["turns"][1]["calls"]]  # errors are observations; the run went on
    assert results[0] == "error: division by zero"
    assert results[1].startswith("error: unknown tool 'nope'")
    assert results[2].startswith("error: the tool call is not valid JSON")
    assert all(c["error"] for c in t2["turns"][1]["calls"])
    observation_2 = obs(tok, *results)
    span = t2["turns"][1]["span"]
    assert trajectories[1].response_ids[span[0]:span[1]] == observation_2


def test_token_budget_truncates_the_observation_and_marks_length(tok):
    turn1 = call("calculator", expression="2**10")
    script = {"Q:": [turn1, "1024"]}
    first = len(ids(tok, turn1)) + 1
    budget = first + 10  # room for only 10 of the observation's tokens
    trajectories, batch = run_agent(ScriptedEngine(tok, script), tok, ["Q:"], AgentConfig(max_response_tokens=budget))
    t = trajectories[0]
    assert t.finish_reason == "length" and len(t.response_ids) == budget
    assert t.response_ids[first:] == obs(tok, "1024")[:10]
    assert t.loss_mask == [1] * first + [0] * 10
    assert batch["attention_mask"][0].sum() == len(ids(tok, "Q:")) + budget


def test_token_budget_cuts_a_model_turn(tok):
    script = {"Q:": [call("calculator", expression="1+1"), "the answer is two"]}
    first = len(ids(tok, script["Q:"][0])) + 1
    budget = first + len(obs(tok, "2")) + 5
    trajectories, _ = run_agent(ScriptedEngine(tok, script), tok, ["Q:"], AgentConfig(max_response_tokens=budget))
    t = trajectories[0]
    assert t.finish_reason == "length" and len(t.response_ids) == budget
    assert t.response_ids[-5:] == ids(tok, "the a") and t.loss_mask[-5:] == [1] * 5


def test_turn_limit_and_per_turn_limit(tok):
    script = {"A:": [call("calculator", expression="1")] * 5, "B:": ["an answer longer than ten tokens"]}
    (a,), _ = run_agent(ScriptedEngine(tok, script), tok, ["A:"], AgentConfig(max_turns=3))
    assert a.finish_reason == "max_turns" and a.summary()["num_turns"] == 3 and a.summary()["num_tool_calls"] == 2
    (b,), batch = run_agent(ScriptedEngine(tok, script), tok, ["B:"], AgentConfig(max_new_tokens_per_turn=10))
    assert b.finish_reason == "length" and b.response_ids == ids(tok, "an answer ") and batch["response"] == ["an answer "]


class Sleep(Tool):
    name = "sleep"

    def run(self, seconds: float) -> str:
        time.sleep(seconds)
        return f"slept {seconds}"


def test_a_slow_tool_stalls_only_its_own_conversation(tok):
    script = {"slow:": [call("sleep", seconds=2.0), "done"],
              **{f"fast{i}:": [call("sleep", seconds=0.01)] * 3 + ["done"] for i in range(4)},
              "stuck:": [call("sleep", seconds=5.0), "gave up"]}
    start = time.monotonic()
    trajectories, batch = run_agent(ScriptedEngine(tok, script), tok, list(script),
                                    AgentConfig(max_turns=5, tool_timeout_s=2.5), tools={"sleep": Sleep()})
    elapsed = time.monotonic() - start
    slow, *fast, stuck = trajectories
    assert all(t.finish_reason == "stop" and t.summary()["num_tool_calls"] == 3 for t in fast)
    assert max(t.seconds for t in fast) < 1.5 < 2.0 <= slow.seconds  # the fast ones did not wait for it
    assert stuck.turns[1]["calls"][0]["result"] == "error: no answer within 2.5 s"
    assert stuck.finish_reason == "stop" and batch["response"][-1] == "gave up"
    assert elapsed < 4.5  # the stuck tool's thread is abandoned at the timeout, not waited for


def test_concurrent_turns_share_engine_calls(tok):
    script = {f"p{i}:": [call("calculator", expression=f"{i}+1"), "x"] for i in range(6)}
    engine = ScriptedEngine(tok, script)
    run_agent(engine, tok, list(script), AgentConfig(max_concurrent=3), n=2)
    assert sum(engine.calls) == 24 and max(engine.calls) == 3  # 12 conversations x 2 turns, 3 at a time
    assert len(engine.calls) < 24


def test_python_tool_violation_is_an_observation_and_the_conversation_continues(tok):
    script = {"Q:": [call("python", code="while True: pass"), call("python", code="print(6 * 7)"), "42"]}
    tools = build_tools([{"name": "python", "timeout_s": 2.0}])
    trajectories, batch = run_agent(ScriptedEngine(tok, script), tok, ["Q:"], AgentConfig(max_turns=4), tools)
    results = [turn["calls"][0]["result"] for turn in trajectories[0].turns if turn["role"] == "tool"]
    assert results[0].startswith("error: the code ran longer than 2 s") and results[1] == "42\n"
    assert batch["response"] == ["42"] and trajectories[0].finish_reason == "stop"


def test_chat_template_observations_follow_the_template_and_skip_the_stop_token(tok):
    tok = AutoTokenizer.from_pretrained(tok.name_or_path)
    tok.chat_template = (  # Qwen2.5's layout of tool messages, with <eos> closing each message
        "{% for m in messages %}{% if m.role == 'tool' %}{% if loop.previtem.role != 'tool' %}"
        "{{ '<|im_start|>user' }}{% endif %}{{ '\n<tool_response>\n' + m.content + '\n</tool_response>' }}"
        "{% if loop.last or loop.nextitem.role != 'tool' %}{{ '<eos>\n' }}{% endif %}"
        "{% else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<eos>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    rendered = ChatTemplateObservations(tok).render(["42", "7"], stop_text="<eos>")
    expected = "\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n7\n</tool_response>" \
               "<eos>\n<|im_start|>assistant\n"
    assert rendered == ids(tok, expected) and rendered.count(tok.eos_token_id) == 1
    assert ChatTemplateObservations(tok).render(["1"], stop_text=None)[:len(ids(tok, "<eos>\n"))] == ids(tok, "<eos>\n")


@TOOL_PARSERS.register("test_vowel_or_digit")
def call_when_vowel_or_digit(text):
    """Stands in for a trained model's tool calls: the random tiny model calls the calculator
    whenever its turn contains a vowel or a digit (most turns), so real generations go multi-turn."""
    return [ToolCall("calculator", {"expression": "6*7"})] if any(c in text for c in "aeiou0123456789") else []


@pytest.mark.parametrize("budget", [120, 60])
def test_real_engine_multi_turn_masks_and_logprobs_match_a_fresh_forward(model_dir, tok, budget):
    engine = HFRolloutEngine(model_dir, seed=0)
    config = AgentConfig(max_turns=4, max_response_tokens=budget, max_new_tokens_per_turn=12,
                         parser="test_vowel_or_digit")
    prompts = ["abc>", "hello world>", "12+3="]
    trajectories, batch = run_agent(engine, tok, prompts, config, n=3)
    observation = obs(tok, "42")

    multi_turn = 0
    for i, t in enumerate(trajectories):
        assert len(t.response_ids) <= budget
        if len(t.response_ids) == budget:
            assert t.finish_reason == "length"
        if t.finish_reason == "stop":
            assert t.turns[-1]["stopped"] and not t.turns[-1]["tool_calls"]
        model_positions, tool_positions = [], []
        for turn in t.turns:
            span = range(len(t.prompt_ids) + turn["span"][0], len(t.prompt_ids) + turn["span"][1])
            (model_positions if turn["role"] == "assistant" else tool_positions).extend(span)
            if turn["role"] == "tool":
                assert t.response_ids[turn["span"][0]:turn["span"][1]] == observation[:len(span)]
        assert batch["loss_mask"][i].nonzero()[:, 0].tolist() == model_positions  # exactly the model's tokens
        assert batch["rollout_logprobs"][i, tool_positions].abs().sum() == 0
        multi_turn += t.summary()["num_turns"] >= 2
    assert multi_turn >= 3  # several conversations had an observation and a later model turn
    assert sum(len(t.response_ids) == budget for t in trajectories) >= 3  # and several were cut at the budget

    with torch.no_grad():
        logits = engine.model(input_ids=batch["tokens"], attention_mask=batch["attention_mask"]).logits.float()
    fresh = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["tokens"][:, 1:, None])[..., 0]
    mask = batch["loss_mask"][:, 1:].bool()
    torch.testing.assert_close(batch["rollout_logprobs"][:, 1:][mask], fresh[mask], atol=1e-5, rtol=0)


def test_async_tools_and_tools_from_a_module_path(tok):
    class AsyncEcho(Tool):
        name = "echo"

        async def run(self, text: str) -> str:
            await asyncio.sleep(0.01)
            return text.upper()

    tools = build_tools(["megarl.rollout.tools.calculator:Calculator"]) | {"echo": AsyncEcho()}
    assert set(tools) == {"calculator", "echo"}
    script = {"Q:": [call("echo", text="hi") + call("calculator", expression="2*(3+4)"), "done"]}
    trajectories, _ = run_agent(ScriptedEngine(tok, script), tok, ["Q:"], AgentConfig(), tools)
    assert [c["result"] for c in trajectories[0].turns[1]["calls"]] == ["HI", "14"]


def test_over_sampling_aborts_the_rest_and_resumed_conversations_keep_their_version(model_dir, tok):
    """Real HF engine: 6 groups started, 2 needed; the others are aborted part-way (their finished
    turns kept), then continued under a newer policy version without losing a token."""
    engine = HFRolloutEngine(model_dir, seed=0)
    config = AgentConfig(max_turns=4, max_response_tokens=100, max_new_tokens_per_turn=12,
                         parser="test_vowel_or_digit", max_concurrent=4)  # groups move in staggered waves
    agent = AgentLoop(engine, tok, build_tools(["calculator"]), config)
    prompts = ["abc>", "hello>", "12+3=", "xyz>", "q>", "zz top>"]
    groups = [[Trajectory(i, ids(tok, p), policy_version=3) for _ in range(2)] for i, p in enumerate(prompts)]
    seen = []
    try:
        finished, unfinished, rejected = agent.run_groups(groups, SamplingParams(n=2, seed=1), needed=2,
                                                          accept=lambda g: seen.append(g) or True)
        assert rejected == 0 and len(seen) == 2 and len(finished) + len(unfinished) == 6 and len(unfinished) >= 2
        # the accepted groups first, in the order given
        assert finished[:2] == [g for g in groups if any(g is s for s in seen)]
        assert all(t.finish_reason for g in finished for t in g)
        assert all(any(not t.finish_reason for t in g) for g in unfinished)  # really cut short
        partial = [t for g in unfinished for t in g if not t.finish_reason and t.turns]
        assert partial, "some aborted conversations had finished turns"
        before = {id(t): (list(t.response_ids), len(t.turns)) for g in unfinished for t in g}

        fresh = [[Trajectory(4, ids(tok, "new>"), policy_version=4) for _ in range(2)]]
        done, still, _ = agent.run_groups(unfinished + fresh, SamplingParams(n=2, seed=2))
    finally:
        agent.close()
    resumed = len(unfinished)
    assert not still and len(done) == resumed + 1 and all(t.finish_reason for g in done for t in g)
    for g in done[:resumed]:
        for t in g:
            response, turns = before[id(t)]
            assert t.policy_version == 3 and t.response_ids[:len(response)] == response and len(t.turns) >= turns
    assert {t.policy_version for t in done[resumed]} == {4}
    rows = [{"prompt": p, "answer": ""} for p in prompts]
    batch = trajectories_to_batch(rows, [t for g in done[:resumed] for t in g], tok.pad_token_id, tok)
    assert batch["policy_version"].tolist() == [3] * 2 * resumed
    # the resumed rows' log-probs (earlier turns from the old call, later ones from the new) still line up
    with torch.no_grad():
        logits = engine.model(input_ids=batch["tokens"], attention_mask=batch["attention_mask"]).logits.float()
    fresh_lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["tokens"][:, 1:, None])[..., 0]
    mask = batch["loss_mask"][:, 1:].bool()
    torch.testing.assert_close(batch["rollout_logprobs"][:, 1:][mask], fresh_lp[mask], atol=1e-5, rtol=0)


def test_a_multi_turn_trace_lays_out_like_a_rollout(tok):
    """SFT traces (sft.data) get the agent's layout: assistant turns + eos trained on, tool results not."""
    call_text = call("calculator", expression="6*7")
    messages = [{"role": "assistant", "content": call_text}, {"role": "tool", "content": "42"},
                {"role": "assistant", "content": "42"}]
    renderer = TextObservations(tok, "<r>{result}</r>")
    batch = sft_batch(tok, [{"prompt": "6*7=", "answer": "42", "messages": messages}], renderer)
    eos = tok.eos_token_id
    expected = ids(tok, "6*7=") + ids(tok, call_text) + [eos] + ids(tok, "<r>42</r>") + ids(tok, "42") + [eos]
    assert batch["tokens"][0].tolist() == expected
    mask = [0] * 4 + [1] * (len(ids(tok, call_text)) + 1) + [0] * len(ids(tok, "<r>42</r>")) + [1] * 3
    assert batch["loss_mask"][0].tolist() == mask
    with pytest.raises(ValueError, match="message 0 has role 'user'"):
        sft_batch(tok, [{"prompt": "x", "answer": "", "messages": [{"role": "user", "content": "?"}]}], renderer)


def test_over_sampling_counts_rejected_groups_and_puts_accepted_ones_first(tok):
    """A group the accept test turns down (e.g. all rewards equal) does not count towards `needed`."""
    script = {"A:": ["a"], "B:": [call("calculator", expression="1+1"), "2"], "C:": ["c"] * 2}
    agent = AgentLoop(ScriptedEngine(tok, script), tok, build_tools(["calculator"]), AgentConfig())
    groups = [[Trajectory(i, ids(tok, p)) for _ in range(2)] for i, p in enumerate(script)]
    try:
        finished, unfinished, rejected = agent.run_groups(groups, SamplingParams(), needed=1,
                                                          accept=lambda g: g[0].prompt_index != 0)
    finally:
        agent.close()
    # A and C finish on the first call; A is turned down, C accepted: B (mid-conversation) is aborted
    assert rejected == 1 and [g[0].prompt_index for g in finished] == [2, 0]
    assert unfinished == [groups[1]] and all(t.turns and not t.finish_reason for t in groups[1])


class RoutedEngine(ScriptedEngine):
    """An engine with SGLang's extras: conversation ids per prompt (sticky routing) and abort()."""

    def __init__(self, tok, script, seconds=0.0):
        super().__init__(tok, script)
        self.routed, self.aborts, self.seconds = [], 0, seconds

    def generate(self, prompts, params, conversations=None):
        self.routed.append(list(conversations))
        time.sleep(self.seconds)
        return super().generate(prompts, params)

    def abort(self):
        self.aborts += 1


def test_conversation_ids_reach_the_engine(tok):
    script = {"A:": ["a"], "B:": [call("calculator", expression="1+1"), call("calculator", expression="2"), "2"]}
    engine = RoutedEngine(tok, script)
    agent = AgentLoop(engine, tok, build_tools(["calculator"]), AgentConfig())
    groups = [[Trajectory(i, ids(tok, p)) for _ in range(2)] for i, p in enumerate(script)]
    try:
        done, _, _ = agent.run_groups([[Trajectory(1, ids(tok, "B:"))]], SamplingParams())
        (b,), = done
        assert engine.routed == [[b.conversation]] * 3  # every turn of the conversation under its own id
        engine.routed.clear()
        agent.run_groups(groups, SamplingParams())
    finally:
        agent.close()
    first = engine.routed[0]
    assert sorted(first) == sorted(t.conversation for g in groups for t in g) and len(set(first)) == 4


def test_turns_batched_into_one_call_keep_their_own_token_limits(tok):
    """Engines that take a limit per prompt (SGLang) get each turn's own, not the largest of the call."""
    limits = []

    class LimitedEngine(ScriptedEngine):
        def generate(self, prompts, params, max_new_tokens=None):
            limits.append(list(max_new_tokens))
            return super().generate(prompts, params)

    script = {"A:": ["a"], "B:": ["b"]}
    agent = AgentLoop(LimitedEngine(tok, script), tok, build_tools(["calculator"]),
                      AgentConfig(max_response_tokens=40, max_new_tokens_per_turn=30))
    prompts = {"A:": ids(tok, "A:"), "B:": ids(tok, "B:")}
    groups = [[Trajectory(0, prompts["A:"])], [Trajectory(1, prompts["B:"])]]
    groups[1][0].append(ids(tok, "x" * 25), None)  # B is further into its budget: 15 tokens left
    try:
        agent.run_groups(groups, SamplingParams())
    finally:
        agent.close()
    assert limits == [[30, 15]]


def test_an_abort_reaches_the_engine_call_in_flight_and_waits_for_it(tok):
    from concurrent.futures import ThreadPoolExecutor

    from megarl.rollout.agent import GenerationBatcher

    engine = RoutedEngine(tok, {"A:": ["a"]}, seconds=0.5)

    async def scenario():
        batcher = GenerationBatcher(engine, SamplingParams(), ThreadPoolExecutor(1))
        turn = asyncio.create_task(batcher.generate(ids(tok, "A:"), 8, "c1"))
        await asyncio.sleep(0.1)
        batcher.abort()  # the call is in flight: the engine is told
        turn.cancel()
        start = time.monotonic()
        await batcher.settle()  # returns only once the engine's call has ended
        waited = time.monotonic() - start
        batcher.abort()  # nothing in flight: the engine is not told again
        return waited

    waited = asyncio.run(scenario())
    assert engine.aborts == 1 and waited > 0.2


def test_every_model_turn_goes_with_its_prompts_images_and_the_rows_carry_them(tok):
    """A vision-language policy's conversations: each turn's request carries its prompt's images (None for a text-only
    prompt), the turns after a tool result too, and every row of an image prompt gets the prompt's image fields; a
    tool that answers with images for a text policy gets an error observation."""
    picture = ImageInputs(torch.randn(4, 6), torch.tensor([[1, 2, 2]]))

    class RecordingEngine(ScriptedEngine):
        def generate(self, prompts, params, images=None):
            self.seen += [(context[:3], None if images is None else images[i]) for i, context in enumerate(prompts)]
            return super().generate(prompts, params)

    engine = RecordingEngine(tok, {"Q1:": [call("calculator", expression="6*7"), "42"], "Q2:": ["7"]})
    engine.seen = []
    agent = AgentLoop(engine, tok, build_tools(["calculator"]), AgentConfig())
    try:
        trajectories = agent.run([ids(tok, "Q1:"), ids(tok, "Q2:")], SamplingParams(n=2), images=[picture, None])
    finally:
        agent.close()
    assert [t.finish_reason for t in trajectories] == ["stop"] * 4 and len(trajectories[0].turns) == 3
    assert len(engine.seen) == 6  # Q1's two turns and Q2's one, twice each
    for prefix, image in engine.seen:
        assert image is (picture if prefix == ids(tok, "Q1:") else None), prefix
    rows = [{"prompt": "Q1:", "answer": "", "pixel_values": picture.pixel_values,
             "image_grid_thw": picture.image_grid_thw}, {"prompt": "Q2:", "answer": "", "pixel_values": None,
                                                          "image_grid_thw": None}]
    batch = trajectories_to_batch(rows, trajectories, tok.pad_token_id, tok)
    assert [p is picture.pixel_values for p in batch["pixel_values"]] == [True, True, False, False]
    assert batch["image_grid_thw"][2] is None and batch["image_grid_thw"][0] is picture.image_grid_thw
    for t in trajectories:
        t.images = None
    assert "pixel_values" not in trajectories_to_batch(rows, trajectories, tok.pad_token_id, tok).non_tensors

    class Picture(Tool):
        name = "picture"

        def run(self):
            return ToolResult("here it is", [b"not even an image"])

    script = {"Q:": [call("picture"), "ok"]}
    trajectories, _ = run_agent(ScriptedEngine(tok, script), tok, ["Q:"], AgentConfig(), tools={"picture": Picture()})
    record = trajectories[0].turns[1]["calls"][0]
    assert record["error"] and "this policy takes no images" in record["result"] and "images" not in record


def test_a_tools_images_join_the_row_or_leave_the_observation_out_whole(tmp_path):
    """A vision-language policy's tool answers with an image: the observation shows its expanded placeholders after
    the text, the next turn's request and the row carry it; where the budget cannot hold the whole observation it is
    left out (an image is never cut) and the conversation ends with `length`."""
    from PIL import Image

    from megarl.data.images import ImagePrompts
    from megarl.models.tiny_vl import build_tiny_vl_model

    model = build_tiny_vl_model(tmp_path / "vl")
    vl_tok = AutoTokenizer.from_pretrained(model)
    image_pad = vl_tok.convert_tokens_to_ids("<|image_pad|>")

    class Picture(Tool):
        name = "picture"

        def run(self):
            return ToolResult("seen:", [Image.new("RGB", (16, 16), (0, 0, 255))])

    class RecordingEngine(ScriptedEngine):
        def generate(self, prompts, params, images=None):
            self.seen.append(images)
            return super().generate(prompts, params)

    first = len(ids(vl_tok, call("picture"))) + 1  # the tool call's turn
    for budget, finish in ((first + 100, "stop"), (first + 10, "length")):
        engine = RecordingEngine(vl_tok, {"Q:": [call("picture"), "ok"]})
        engine.seen = []
        agent = AgentLoop(engine, vl_tok, {"picture": Picture()}, AgentConfig(max_response_tokens=budget),
                          image_prompts=ImagePrompts(model, vl_tok))
        try:
            [t] = agent.run([ids(vl_tok, "Q:")], SamplingParams(n=1))
        finally:
            agent.close()
        assert t.finish_reason == finish
        observation = t.response_ids[slice(*t.turns[1]["span"])]
        if finish == "length":  # left out whole; no image in the row
            assert observation == [] and t.images is None and engine.seen == [None]
            continue
        assert observation.count(image_pad) == 16 and t.turns[1]["calls"][0]["images"] == 1
        assert t.images.image_grid_thw.tolist() == [[1, 8, 8]] and t.images.pixel_values.shape[0] == 64
        assert engine.seen[0] is None and engine.seen[1][0] is t.images  # the second turn saw the image
        batch = trajectories_to_batch([{"prompt": "Q:", "answer": ""}], [t], vl_tok.pad_token_id, vl_tok)
        assert batch["image_grid_thw"][0] is t.images.image_grid_thw
        assert batch["loss_mask"][0][batch["tokens"][0] == image_pad].sum() == 0


def test_the_loop_reads_calls_in_the_format_the_chat_template_writes(model_dir):
    """agent.parser=auto on a template in gpt-oss's harmony format: the model's message to functions.calculator is
    the call the loop runs."""
    harmony = AutoTokenizer.from_pretrained(model_dir)
    harmony.chat_template = ("{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>{{ m.content }}"
                             "<|end|>{% endfor %}")
    turn = '<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression": "6*7"}'
    config = AgentConfig(observation_template="<r>{result}</r>")
    loop = AgentLoop(None, harmony, {}, config)
    loop.close()
    assert loop.parser_name == "harmony"
    trajectories, batch = run_agent(ScriptedEngine(harmony, {"Q:": [turn, "42"]}), harmony, ["Q:"], config)
    [summary] = batch["trajectory"]
    assert summary["turns"][0]["tool_calls"] == [{"name": "calculator", "arguments": {"expression": "6*7"},
                                                  "error": None}]
    assert summary["turns"][1]["calls"][0]["result"] == "42" and batch["response"] == ["42"]
