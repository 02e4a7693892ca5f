"""The gateway's streaming (megarl/rollout/gateway_stream.py) through the real `openai` client: text goes out while the
engine still generates, joins to the answer the gateway records and returns unstreamed, and never passes a stop
string."""

import threading

import openai
import pytest
from transformers import AutoTokenizer

from megarl.config import AgentConfig
from megarl.models.tiny import build_tiny_model
from megarl.rollout.agent import Trajectory
from megarl.rollout.base import Generation, RolloutEngine, SamplingParams
from megarl.rollout.gateway_agents import GatewayAgents
from megarl.rollout.gateway_stream import sendable
from megarl.rollout.hf import HFRolloutEngine
from tests.rollout.test_partial_rollout import PARAMS, PROMPTS, interrupted

TEMPLATE = "{% for m in messages %}{{ m.role[0] | upper + ':' + m.content + '<eos>' }}{% endfor %}" \
           "{% if add_generation_prompt %}{{ 'A:' }}{% endif %}"
WAIT_S = 20  # the most the engine's hook waits for the client's first chunk (streaming that works: milliseconds)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3))
    tok.chat_template = TEMPLATE
    return tok


class Hooked(RolloutEngine):
    """The hf engine, its tokens heard as it samples them: the first call waits, at its `pause_at`-th token, until the
    client has a chunk of text (or WAIT_S), and notes whether it had one before the engine produced its last token."""

    def __init__(self, engine, pause_at: int):
        self.engine, self.pause_at, self.calls = engine, pause_at, []
        self.first_chunk, self.chunk_before_last_token = threading.Event(), None

    def generate(self, prompts, params, on_tokens=None):
        produced = []

        def hook(row, offset, token_ids):
            if on_tokens is not None:
                on_tokens(row, offset, token_ids)
            produced.extend(token_ids)
            if not self.calls and offset == self.pause_at:
                self.first_chunk.wait(WAIT_S)
            if not self.calls and offset == params.max_new_tokens - 1:
                self.chunk_before_last_token = self.first_chunk.is_set()

        gens = self.engine.generate(prompts, params, on_tokens=hook)
        self.calls.append((prompts, gens, produced))
        return gens

    def update_weights(self, named_tensors):
        raise NotImplementedError

    def named_weights(self):
        raise NotImplementedError


def make(engine, tok, agent, turn_tokens=12):
    cfg = AgentConfig(enabled=True, max_new_tokens_per_turn=turn_tokens, max_response_tokens=100)
    cfg.gateway.function = "tests.rollout.test_gateway:noop"
    agents = GatewayAgents(engine, tok, cfg)
    agents.fn = agent
    return agents


def rollout(agents, rows, params):
    groups = [[Trajectory(i, [1], policy_version=0)] for i in range(len(rows))]
    try:
        finished, _, _ = agents.run_groups(groups, params, rows=rows)
        return finished, agents.take_counts()
    finally:
        agents.close()


def test_chunks_arrive_while_the_engine_generates_and_join_to_the_recorded_answer(tok):
    engine, seen = Hooked(HFRolloutEngine(tok.name_or_path, seed=0), pause_at=4), {}

    def agent(base_url, api_key, row):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": row["prompt"]}]
        pieces, finish, usage = [], [], None
        for chunk in client.chat.completions.create(model="m", messages=messages, max_tokens=12, stream=True,
                                                    stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                engine.first_chunk.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                finish.append(chunk.choices[0].finish_reason)
            usage = chunk.usage or usage
        seen["streamed"], seen["finish"], seen["usage"] = pieces, finish, usage
        # the same question unstreamed (a segment of its own): greedy decoding answers alike
        seen["whole"] = client.chat.completions.create(model="m", messages=messages, max_tokens=12).choices[0]
        seen["completion"] = "".join(c.choices[0].text for c in client.completions.create(
            model="m", prompt=[5, 6, 7], max_tokens=6, stream=True))
        return 1.0

    [segments], counts = rollout(make(engine, tok, agent), [{"prompt": "hi", "answer": ""}],
                                 SamplingParams(temperature=0.0))
    assert engine.chunk_before_last_token is True  # the hook saw the client's chunk before the last token
    (context, [gen], produced), _, (_, [completion], _) = engine.calls
    assert produced == gen.token_ids and len(gen.token_ids) == 12 and gen.finish_reason == "length"
    assert len(seen["streamed"]) > 1 and "".join(seen["streamed"]) == seen["whole"].message.content
    assert "".join(seen["streamed"]) == tok.decode(gen.token_ids)
    assert seen["finish"] == ["length"] and seen["usage"].completion_tokens == 12
    assert seen["completion"] == tok.decode(completion.token_ids)
    streamed = segments[0]  # the record is the engine's, token for token
    assert streamed.prompt_ids == context[0] and streamed.response_ids == gen.token_ids
    assert streamed.logprobs == gen.logprobs and streamed.loss_mask == [1] * 12
    assert counts["segments"] == 3 and counts["agents_crashed"] == 0


class ScriptedStream(RolloutEngine):
    """Answers each call with `text` + <eos>, handing its tokens over one at a time as they are 'generated'."""

    def __init__(self, tok, text):
        self.ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    def generate(self, prompts, params, on_tokens=None):
        ids = self.ids[:params.max_new_tokens]
        for k, token in enumerate(ids):
            if on_tokens is not None:
                on_tokens(0, k, [token])
        return [Generation(0, ids, [-0.5] * len(ids), "stop" if ids[-1] == self.ids[-1] else "length")]

    def update_weights(self, named_tensors):
        raise NotImplementedError

    def named_weights(self):
        raise NotImplementedError


def test_a_streamed_answer_never_passes_a_stop_string(tok):
    engine, seen = ScriptedStream(tok, "go Obs: made up"), {}

    def agent(base_url, api_key, row):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        for stops in (["Obs:", "never"], ["go Obs"], ["zz"]):
            chunks = list(client.completions.create(model="m", prompt="q", stop=stops, max_tokens=30, stream=True))
            seen[stops[0]] = ([c.choices[0].text for c in chunks if c.choices[0].text],
                              [c.choices[0].finish_reason for c in chunks][-1])
        return 1.0

    finished, counts = rollout(make(engine, tok, agent, turn_tokens=30), [{"prompt": "q", "answer": ""}],
                               SamplingParams(seed=1))
    assert "".join(seen["Obs:"][0]) == "go " and seen["Obs:"][1] == "stop"
    assert seen["go Obs"] == ([], "stop")  # the whole answer began with the stop string: nothing to send
    assert "".join(seen["zz"][0]) == "go Obs: made up" and seen["zz"][1] == "stop"
    assert counts["requests"] == 3 and counts["agents_crashed"] == 0


@pytest.mark.parametrize("text, stops, expected", [
    ("go Obs: x", ["Obs:"], ("go ", True)),
    ("go Ob", ["Obs:"], ("go ", False)),  # "Ob" may begin the stop string: held back
    ("go Ox", ["Obs:"], ("go Ox", False)),
    ("a\ufffd", [], ("a", False)),  # a character whose bytes are not all there yet
    ("abc", ["bcd", "c"], ("ab", True)),
    ("xab", ["abc", "b"], ("xa", True)),  # the stop string whose end comes first
])
def test_what_of_a_partial_answer_may_be_sent(text, stops, expected):
    assert sendable(text, stops) == expected


class Restarting(ScriptedStream):
    """Hands over "abcd", waits until the client has a chunk of it, then starts the row again (a weight update under
    async.partial=restart) and answers "xyz"."""

    def __init__(self, tok):
        self.tok, self.client_has_text = tok, threading.Event()

    def generate(self, prompts, params, on_tokens=None):
        on_tokens(0, 0, self.tok("abcd", add_special_tokens=False)["input_ids"])
        self.client_has_text.wait(WAIT_S)
        ids = self.tok("xyz", add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        on_tokens(0, 0, ids)
        return [Generation(0, ids, [-0.5] * len(ids), "stop")]


def test_a_stream_whose_answer_was_generated_again_ends_with_an_error_and_records_nothing(tok):
    engine, seen = Restarting(tok), {"text": ""}

    def agent(base_url, api_key, row):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        with pytest.raises(openai.APIError, match="generated again") as error:
            for chunk in client.completions.create(model="m", prompt="q", max_tokens=10, stream=True):
                seen["text"] += chunk.choices[0].text
                engine.client_has_text.set()
        seen["error"] = error.value
        return 1.0

    finished, counts = rollout(make(engine, tok, agent), [{"prompt": "q", "answer": ""}], SamplingParams(seed=1))
    assert seen["text"] == "abc" and "error" in seen  # "d" waited for the next token, which never came
    assert finished == [] and counts["agents_empty"] == 1 and counts["requests"] == 1


@pytest.mark.parametrize("partial", ["resume", "restart"])
def test_the_hf_engine_hands_over_each_token_at_its_place_across_a_weight_update(tok, partial):
    """on_tokens across an interruption (megarl.rollout.partial): resumed rows go on at their offsets; restarted rows
    begin again at offset 0, so a listener knows the tokens it heard last are dropped."""
    engine, heard = HFRolloutEngine(tok.name_or_path, seed=0), {}
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    gens, _ = interrupted(engine, prompts, PARAMS, 3, partial, engine.named_weights(), call=lambda: engine.generate(
        prompts, PARAMS, on_tokens=lambda row, offset, ids: heard.setdefault(row, []).append((offset, ids))))
    assert sorted(heard) == list(range(len(gens)))
    for row, g in enumerate(gens):
        offsets = [offset for offset, _ in heard[row]]
        again = 3 if partial == "restart" else 0  # the first segment's 3 tokens, then all 10 from offset 0
        assert offsets == list(range(again)) + list(range(10)) and g.interruptions == 1
        assert [t for _, ids in heard[row][again:] for t in ids] == g.token_ids


def test_without_tools_a_calls_text_is_content_streamed_or_not(tok):
    """As OpenAI's API: a request that offers no tools gets no tool_calls, the model's whole text as content, streamed
    as it comes; with tools, the same turn comes back as a call, its content sent when the turn has ended."""
    call = '<tool_call>{"name":"calculator","arguments":{"expression":"6*7"}}</tool_call>'
    engine, seen = ScriptedStream(tok, "so" + call), {}
    tool = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}

    def agent(base_url, api_key, row):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": "q"}]
        seen["whole"] = client.chat.completions.create(model="m", messages=messages, max_tokens=90).choices[0]
        chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=90, stream=True))
        seen["streamed"] = "".join(c.choices[0].delta.content or "" for c in chunks)
        chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=90, stream=True,
                                                     tools=[tool]))
        seen["with_tools"] = ("".join(c.choices[0].delta.content or "" for c in chunks),
                              [c.choices[0].delta.tool_calls[0].function.name for c in chunks
                               if c.choices[0].delta.tool_calls], chunks[-1].choices[0].finish_reason)
        return 1.0

    rollout(make(engine, tok, agent, turn_tokens=90), [{"prompt": "q", "answer": ""}], SamplingParams(seed=1))
    assert seen["whole"].message.content == "so" + call and not seen["whole"].message.tool_calls
    assert seen["whole"].finish_reason == "stop" and seen["streamed"] == "so" + call
    assert seen["with_tools"] == ("so", ["calculator"], "tool_calls")
