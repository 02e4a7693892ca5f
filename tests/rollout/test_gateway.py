"""The OpenAI-compatible gateway (megarl/rollout/gateway*.py) through the real `openai` client: what it records is
what the engine generated, token for token, and what training reads of it."""

import json
import threading
import time

import openai
import pytest
from transformers import AutoTokenizer

from megarl.config import AgentConfig
from megarl.models.tiny import build_tiny_model
from megarl.rollout.agent import Trajectory, agent_metrics, agent_rewards, trajectories_to_batch
from megarl.rollout.base import Generation, RolloutEngine, SamplingParams
from megarl.rollout.gateway_agents import GatewayAgents, final_segments
from megarl.rollout.hf import HFRolloutEngine

# a chat template in Qwen2.5's manner (tools in a system message, <eos> closing each message), short enough for the
# tiny model's 128 positions
TEMPLATE = (
    "{% if tools %}{{ 'S:' + (tools | map(attribute='function') | map(attribute='name') | join(',')) + '<eos>' }}"
    "{% endif %}{% for m in messages %}{{ m.role[0] | upper + ':' + m.content + '<eos>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'A:' }}{% endif %}")
CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "arithmetic",
                                               "parameters": {"type": "object", "properties": {
                                                   "expression": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3))
    tok.chat_template = TEMPLATE
    return tok


class Recorded(RolloutEngine):
    """The engine as the gateway sees it, keeping every (context, generation) it produced."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, params):
        gens = self.engine.generate(prompts, params)
        self.calls += list(zip(prompts, gens))
        return gens

    def update_weights(self, named_tensors):
        raise NotImplementedError

    def named_weights(self):
        raise NotImplementedError


@pytest.fixture(scope="module")
def hf(tok):
    return HFRolloutEngine(tok.name_or_path, seed=0)


class Scripted(Recorded):
    """Answers the k-th call of a run (by context) with script[k] + <eos>, log-probs -1, -2, ..."""

    def __init__(self, tok, script):
        super().__init__(None)
        self.tok, self.script = tok, script

    def generate(self, prompts, params):
        gens = []
        for i, context in enumerate(prompts):
            turn = sum(1 for c, _ in self.calls if context[:len(c)] == c)
            ids = self.tok(self.script[min(turn, len(self.script) - 1)], add_special_tokens=False)["input_ids"]
            ids = ids[:params.max_new_tokens - 1] + [self.tok.eos_token_id]
            gens.append(Generation(i, ids, [-1.0 - k for k in range(len(ids))], "stop", versions=[7] * len(ids)))
            self.calls.append((list(context), gens[-1]))
        return gens


def make(engine, tok, agent, turn_tokens=12, **gateway) -> GatewayAgents:
    cfg = AgentConfig(enabled=True, max_new_tokens_per_turn=turn_tokens, max_response_tokens=100)
    cfg.gateway.function = "tests.rollout.test_gateway:noop"
    for k, v in gateway.items():
        setattr(cfg.gateway, k, v)
    agents = GatewayAgents(engine, tok, cfg)
    agents.fn = agent
    return agents


def noop(base_url, api_key, row):
    return None


def rollout(agents, rows, n=1, version=3, close=True):
    groups = [[Trajectory(i, [1], policy_version=version) for _ in range(n)] for i in range(len(rows))]
    try:
        finished, unfinished, rejected = agents.run_groups(groups, SamplingParams(seed=5), rows=rows)
        assert unfinished == [] and rejected == 0
        return finished, agents.take_counts()
    finally:
        if close:
            agents.close()


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_single_turn_records_the_engines_tokens_and_log_probs(tok, hf):
    engine, seen = Recorded(hf), {}

    def agent(base_url, api_key, row):
        client = openai.OpenAI(base_url=base_url, api_key=api_key)
        seen["r"] = client.chat.completions.create(model="m", messages=[{"role": "user", "content": row["prompt"]}],
                                                   logprobs=True, max_tokens=8)
        return 0.5

    [[seg]], counts = rollout(make(engine, tok, agent), [{"prompt": "12+7=", "answer": "19"}])
    [(context, gen)] = engine.calls
    assert seg.prompt_ids == context == ids(tok, tok.apply_chat_template(
        [{"role": "user", "content": "12+7="}], tokenize=False, add_generation_prompt=True))
    assert seg.response_ids == gen.token_ids and seg.logprobs == gen.logprobs and len(gen.token_ids) <= 8
    assert seg.loss_mask == [1] * len(gen.token_ids) and seg.policy_version == 3
    r = seen["r"]
    assert [c.logprob for c in r.choices[0].logprobs.content] == gen.logprobs
    stopped = gen.finish_reason == "stop"
    assert r.choices[0].message.content == tok.decode(gen.token_ids[:-1] if stopped else gen.token_ids)
    assert r.usage.prompt_tokens == len(context) and r.usage.completion_tokens == len(gen.token_ids)
    assert seg.summary()["agent_reward"] == 0.5 and seg.summary()["new_segment"] == "first"
    assert counts == {"agents": 1, "agents_crashed": 0, "agents_timed_out": 0, "agents_empty": 0, "requests": 1,
                      "segments": 1, "segments_edited": 0}


def test_multi_turn_extends_the_context_token_by_token_and_an_edit_starts_a_segment(tok, hf):
    engine = Recorded(hf)

    def agent(base_url, api_key, row):
        client = openai.OpenAI(base_url=base_url, api_key=api_key)
        messages = [{"role": "user", "content": row["prompt"]}]
        for result in ("42", "7"):
            reply = client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR])
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": "x", "content": result}]
        client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR])
        messages[0]["content"] = "edited"  # a history the gateway did not record: a new segment
        client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR])
        return None

    [[seg, edited]], counts = rollout(make(engine, tok, agent), [{"prompt": "6*7=", "answer": "42"}])
    (c1, g1), (c2, g2), (c3, g3), (c4, g4) = engine.calls
    observation = [ids(tok, "T:" + r + "<eos>A:") for r in ("42", "7")]
    # each turn's context is exactly the last one's plus its tokens (a stop token is not repeated)
    for (context, gen), (later, _), obs in zip(engine.calls, engine.calls[1:3], observation):
        closing = [] if gen.finish_reason == "stop" else ids(tok, "<eos>")
        assert later == context + gen.token_ids + closing + obs
    assert seg.prompt_ids == c1 and seg.prompt_ids + seg.response_ids == c3 + g3.token_ids
    model = [1] * len(g1.token_ids), [1] * len(g2.token_ids), [1] * len(g3.token_ids)
    masked = [0] * (len(c2) - len(c1) - len(g1.token_ids)), [0] * (len(c3) - len(c2) - len(g2.token_ids))
    assert seg.loss_mask == model[0] + masked[0] + model[1] + masked[1] + model[2]
    assert [lp for lp, m in zip(seg.logprobs, seg.loss_mask) if m] == g1.logprobs + g2.logprobs + g3.logprobs
    assert edited.summary()["new_segment"] == "edited"
    assert edited.prompt_ids == c4 and edited.response_ids == g4.token_ids
    assert c4[:len(c1)] != c1 and c4[-len(c3) + len(c1):] == c3[len(c1):]  # the same turns after another question
    batch = trajectories_to_batch([{"prompt": "6*7=", "answer": "42"}], [seg, edited], tok.pad_token_id, tok)
    row = batch["loss_mask"][0, len(c1):len(c1) + len(seg.response_ids)].tolist()
    assert row == seg.loss_mask and batch["loss_mask"][0, :len(c1)].sum() == 0
    assert batch["loss_mask"].sum() == sum(seg.loss_mask) + len(g4.token_ids)
    assert agent_rewards(batch) == [None, None]
    assert final_segments(batch)["trajectory"] == [batch["trajectory"][1]]  # held-out scores read the final answer
    assert counts["segments"] == 2 and counts["segments_edited"] == 1 and counts["requests"] == 4


def test_streaming_chat_and_completions(tok, hf):
    engine, seen = Recorded(hf), {}

    def agent(base_url, api_key, row):
        client = openai.OpenAI(base_url=base_url, api_key=api_key)
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        seen["chat"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        seen["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        seen["usage"] = chunks[-1].usage.completion_tokens
        first = client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=5)
        prompt = [5, 6, 7] + engine.calls[-1][1].token_ids + [8]  # continues the completion segment by ids
        seen["text"] = "".join(c.choices[0].text for c in client.completions.create(
            model="m", prompt=prompt, max_tokens=5, stream=True))
        seen["first"] = first.choices[0].text
        return 1.0

    [segments], _ = rollout(make(engine, tok, agent), [{"prompt": "x", "answer": ""}])
    (_, chat), (_, first), (context, second) = engine.calls
    stopped = chat.finish_reason == "stop"
    assert seen["chat"] == tok.decode(chat.token_ids[:-1] if stopped else chat.token_ids)
    assert seen["finish"] == ("stop" if stopped else "length") and seen["usage"] == len(chat.token_ids)
    assert context == [5, 6, 7] + first.token_ids + [8]
    assert seen["text"] == tok.decode(second.token_ids[:-1] if second.finish_reason == "stop" else second.token_ids)
    completion = segments[1]
    assert completion.prompt_ids == [5, 6, 7] and completion.response_ids == first.token_ids + [8] + second.token_ids
    assert completion.loss_mask == [1] * len(first.token_ids) + [0] + [1] * len(second.token_ids)


def test_tool_calls_come_back_in_openai_format(tok):
    call = '<tool_call>{"name":"calculator","arguments":{"expression":"6*7"}}</tool_call>'
    engine, seen = Scripted(tok, ["so" + call, "42"]), {}

    def agent(base_url, api_key, row):
        client = openai.OpenAI(base_url=base_url, api_key=api_key)
        messages = [{"role": "user", "content": row["prompt"]}]
        reply = client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR])
        seen["first"] = reply.choices[0]
        [tool_call] = reply.choices[0].message.tool_calls
        result = str(eval(json.loads(tool_call.function.arguments)["expression"]))
        messages += [reply.choices[0].message, {"role": "tool", "tool_call_id": tool_call.id, "content": result}]
        seen["answer"] = client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR]).choices[0]
        return float(seen["answer"].message.content == row["answer"])

    [[seg]], counts = rollout(make(engine, tok, agent, turn_tokens=80), [{"prompt": "6*7=", "answer": "42"}])
    first = seen["first"]
    assert first.finish_reason == "tool_calls" and first.message.content == "so"
    assert first.message.tool_calls[0].function.name == "calculator"
    assert json.loads(first.message.tool_calls[0].function.arguments) == {"expression": "6*7"}
    assert seen["answer"].message.content == "42" and seen["answer"].finish_reason == "stop"
    # the assistant's message sent back as the client holds it (a pydantic object) continues the segment
    assert counts["segments"] == 1 and seg.summary()["agent_reward"] == 1.0
    assert seg.turns[0]["tool_calls"] == [{"name": "calculator", "arguments": {"expression": "6*7"}, "error": None}]
    assert seg.versions == [7] * len(engine.calls[0][1].token_ids) + [None] * (len(seg.response_ids) - len(
        engine.calls[0][1].token_ids) - len(engine.calls[1][1].token_ids)) + [7] * len(engine.calls[1][1].token_ids)
    assert seg.policy_version == 7
    batch = trajectories_to_batch([{"prompt": "6*7=", "answer": "42"}], [seg], tok.pad_token_id, tok)
    assert agent_metrics(batch, "agent")["agent/tool_calls"] == 1 and batch["response"] == ["42"]


def test_a_stop_string_ends_the_answer_and_its_record_and_the_next_turn_continues_it(tok):
    """A ReAct agent stops the model at "Obs:" and writes the observation itself: the answer ends before the stop
    string, the record keeps the model's tokens through the one that completed it (not the rest, not the stop token),
    and the next request continues the same segment after them."""
    engine, seen = Scripted(tok, ["go Obs: made up", "19"]), {}

    def agent(base_url, api_key, row):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": row["prompt"]}]
        first = client.chat.completions.create(model="m", messages=messages, stop=["Obs:", "never"]).choices[0]
        seen["first"] = first.finish_reason, first.message.content
        messages += [first.message, {"role": "user", "content": "Obs: 19"}]
        seen["second"] = client.chat.completions.create(model="m", messages=messages, stop="Obs:").choices[0]
        text = client.completions.create(model="m", prompt="12+7=", stop=["Obs"]).choices[0]
        seen["completion"] = text.finish_reason, text.text
        with pytest.raises(openai.BadRequestError, match="stop must be"):
            client.chat.completions.create(model="m", messages=messages, stop=["a", "b", "c", "d", "e"])
        with pytest.raises(openai.BadRequestError, match="stop must be"):
            client.chat.completions.create(model="m", messages=messages, stop=[""])
        return 1.0

    finished, counts = rollout(make(engine, tok, agent, turn_tokens=40), [{"prompt": "12+7=", "answer": "19"}])
    assert seen["first"] == ("stop", "go ") and seen["completion"] == ("stop", "go ")
    assert seen["second"].message.content == "19" and seen["second"].finish_reason == "stop"
    [seg, _] = [s for group in finished for s in group]  # the chat run's segment and the completion's
    generated = engine.calls[0][1].token_ids
    cut = next(k for k in range(1, len(generated) + 1) if "Obs:" in tok.decode(generated[:k]))
    first_turn = seg.turns[0]
    assert seg.response_ids[slice(*first_turn["span"])] == generated[:cut] < generated
    assert seg.logprobs[:cut] == engine.calls[0][1].logprobs[:cut] and not first_turn["stopped"]
    # the second call's context: the first's, the kept tokens, then the user message after them
    assert engine.calls[1][0][:len(engine.calls[0][0]) + cut] == engine.calls[0][0] + generated[:cut]
    # both chat turns in one segment; the completion's own prompt is a segment of its own; refusals record nothing
    assert [t["role"] for t in seg.turns] == ["assistant", "context", "assistant"]
    assert counts["segments"] == 2 and counts["requests"] == 3 and counts["agents_crashed"] == 0


def test_crashing_hanging_and_idle_agents_are_counted_and_dropped(tok):
    release, revoked = threading.Event(), threading.Event()
    engine = Scripted(tok, ["ok"])

    def agent(base_url, api_key, row):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": row["prompt"]}])
        if row["prompt"] == "crash":
            raise RuntimeError("the agent's bug")
        if row["prompt"] == "hang":
            release.wait(30)
            try:  # its key was revoked when it timed out
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}])
            except openai.AuthenticationError:
                revoked.set()
        return {"nan": float("nan")}.get(row["prompt"])

    rows = [{"prompt": p, "answer": ""} for p in ("good", "crash", "hang", "nan")]
    start = time.monotonic()
    openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="-")  # the first client loads its certificates: slow
    agents = make(engine, tok, agent, timeout_s=3.0, max_concurrent=4)
    finished, counts = rollout(agents, rows, n=2, close=False)
    assert time.monotonic() - start < 15
    assert [len(g) for g in finished] == [2] and finished[0][0].prompt_index == 0, counts
    assert counts["agents"] == 8 and counts["agents_crashed"] == 4 and counts["agents_timed_out"] == 2
    release.set()
    assert revoked.wait(10)
    agents.close()
    batch = trajectories_to_batch(rows, finished[0], tok.pad_token_id, tok)
    batch.meta["agent_counts"] = counts
    assert agent_metrics(batch, "agent")["agent/agents_timed_out"] == 2


def test_a_spent_budget_answers_empty_and_bad_requests_are_refused(tok):
    engine, seen = Scripted(tok, ["a long answer"]), {}

    def agent(base_url, api_key, row):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": "q"}]
        client.chat.completions.create(model="m", messages=messages)
        spent = client.chat.completions.create(model="m", messages=messages).choices[0]
        seen["spent"] = spent.finish_reason, spent.message.content
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base_url, api_key="megarl-nope", max_retries=0).chat.completions.create(
                model="m", messages=messages)
        with pytest.raises(openai.BadRequestError, match="n must be 1"):
            client.chat.completions.create(model="m", messages=messages, n=2)
        seen["ok"] = True
        return 0.0

    [[seg]], counts = rollout(make(engine, tok, agent, max_tokens=12), [{"prompt": "q", "answer": ""}])
    assert seen["ok"] and seen["spent"] == ("length", "") and len(engine.calls) == 1
    assert len(seg.response_ids) == 12 and counts["agents_crashed"] == 0 and counts["requests"] == 2


@pytest.mark.parametrize("keys, refusal", [
    (["agent.gateway.function=my.mod:agent"], "needs agent.enabled=true"),
    (["agent.enabled=true", "agent.gateway.function=my.mod:agent", "agent.tools=[calculator]"], "leave agent.tools"),
    (["agent.enabled=true", "agent.gateway.function=my.mod:agent", "agent.oversample_groups=2"], "oversample"),
    (["agent.gateway.timeout_s=0"], "agent.gateway.timeout_s"),
])
def test_config_refusals(keys, refusal):
    from megarl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=refusal):
        load_config(overrides=["model.path=tiny", "data.task=reverse", "trainer.steps=1", *keys])


def test_the_recipes_calculator_agent_in_the_plain_layout_of_the_warm_start(tok):
    """configs/gateway_calculator.yaml's agent on a tokenizer without a chat template: the context it builds is the
    SFT traces' layout (prompt, the call and <eos>, <result>...</result>, the answer), and its reward is full."""
    plain = AutoTokenizer.from_pretrained(tok.name_or_path)
    call = '<tool_call>{"name":"calculator","arguments":{"expression":"37*58"}}</tool_call>'
    engine = Scripted(plain, [call, "2146"])
    cfg = AgentConfig(enabled=True, max_new_tokens_per_turn=90, max_response_tokens=118,
                      observation_template="<result>{result}</result>")
    cfg.gateway.function = "megarl.recipes.calculator_agent:agent"
    [[seg]], counts = rollout(GatewayAgents(engine, plain, cfg), [{"prompt": "37*58=", "answer": "2146"}])
    assert plain.decode(seg.prompt_ids + seg.response_ids) == "37*58=" + call + "<eos><result>2146</result>2146<eos>"
    assert seg.summary()["agent_reward"] == 1.0 and counts["requests"] == 2


def test_tool_calls_in_the_format_the_chat_template_writes(tok):
    """agent.parser=auto on a template that writes Llama 3's JSON calls: the gateway reads the model's
    <|python_tag|>{...} into OpenAI tool_calls and cuts it out of the content; a malformed call comes back as text."""
    llama = AutoTokenizer.from_pretrained(tok.name_or_path)
    llama.chat_template = TEMPLATE.replace("'S:'", "'<|start_header_id|>S:<|python_tag|>'")
    call = '<|python_tag|>{"name":"calculator","parameters":{"expression":"6*7"}}'
    engine, seen = Scripted(llama, ["so" + call, "42"]), {}

    def agent(base_url, api_key, row):
        client = openai.OpenAI(base_url=base_url, api_key=api_key)
        messages = [{"role": "user", "content": row["prompt"]}]
        seen["first"] = client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR]).choices[0]
        [tool_call] = seen["first"].message.tool_calls
        messages += [seen["first"].message, {"role": "tool", "tool_call_id": tool_call.id, "content": "42"}]
        seen["answer"] = client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR]).choices[0]
        return 1.0

    agents = make(engine, llama, agent, turn_tokens=80)
    assert agents.gateway.parser_name == "llama3"
    [[seg]], counts = rollout(agents, [{"prompt": "6*7=", "answer": "42"}])
    first = seen["first"]
    assert first.finish_reason == "tool_calls" and first.message.content == "so"
    assert first.message.tool_calls[0].function.name == "calculator"
    assert json.loads(first.message.tool_calls[0].function.arguments) == {"expression": "6*7"}
    assert seen["answer"].message.content == "42" and counts["segments"] == 1

    broken = "so" + call[:-2]
    engine = Scripted(llama, [broken])

    def once(base_url, api_key, row):
        client = openai.OpenAI(base_url=base_url, api_key=api_key)
        seen["broken"] = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "q"}], tools=[CALCULATOR]).choices[0]

    rollout(make(engine, llama, once, turn_tokens=80), [{"prompt": "q", "answer": ""}])
    assert seen["broken"].message.content == broken and not seen["broken"].message.tool_calls
    assert seen["broken"].finish_reason == "stop"
