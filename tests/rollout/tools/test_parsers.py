"""Tool-call parsers (megarl/rollout/tools/parsers.py) on turns as each model family writes them (special tokens kept,
the stop token removed, as the agent loop and the gateway decode a turn), and `auto`'s choice from chat templates
that carry each family's markers."""

import logging
from types import SimpleNamespace

import pytest

from megarl.config import ConfigError
from megarl.rollout.tools.parsers import (TOOL_PARSERS, ToolCall, content_without_calls, detect_parser, resolve_parser)

WEATHER = ToolCall("get_weather", {"city": "Paris"})
CALC = ToolCall("calculator", {"expression": "6*7"})


def parse(parser, text):
    calls = TOOL_PARSERS.get(parser)(text)
    return calls, content_without_calls(text, calls)


def test_hermes_qwen3_turns():
    think = "<think>\nWeather and a product: two tools.\n</think>"
    text = (f'{think}\n\n<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n</tool_call>\n'
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>')
    assert parse("hermes", text) == ([WEATHER, CALC], think)
    one = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\nDone.'
    assert parse("hermes", one) == ([WEATHER], "Let me check.\n\nDone.")
    [bad], content = parse("hermes", 'x <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>')
    assert bad.error.startswith("the tool call is not valid JSON") and bad.name == ""
    assert parse("hermes", "The answer is 42.") == ([], "The answer is 42.")


def test_llama3_json_calls():
    bare = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parse("llama3", bare) == ([WEATHER], "")
    assert parse("llama3", "\n " + bare + "\n") == ([WEATHER], "")
    tagged = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
              '{"name": "calculator", "arguments": {"expression": "6*7"}}')
    assert parse("llama3", "I will look both up. " + tagged) == ([WEATHER, CALC], "I will look both up.")
    assert parse("llama3", tagged + "\nwait for it") == ([WEATHER, CALC], "wait for it")
    # an answer is not a call: text around JSON, JSON without a name, JSON that does not parse
    for answer in ['The call would be {"name": "f", "parameters": {}}', '{"answer": 42}', '{"name": "f", "param',
                   bare + " and more text", '{"name": "f", "parameters": [1]}']:
        assert parse("llama3", answer) == ([], answer)
    # after the tag it is a call: what does not parse is a malformed one
    [bad], _ = parse("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Par')
    assert bad.error.startswith("the tool call is not valid JSON")
    [bad], _ = parse("llama3", '<|python_tag|>brave_search.call(query="paris")')
    assert bad.error.startswith("the tool call is not valid JSON")
    [bad], _ = parse("llama3", '<|python_tag|>{"name": "f", "parameters": "x"}')
    assert bad == ToolCall("f", error='"parameters" must be a JSON object')
    [ok, bad], _ = parse("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {oops')
    assert ok == WEATHER and bad.error.startswith("the tool call is not valid JSON")


def test_harmony_gpt_oss_turns():
    analysis = "<|channel|>analysis<|message|>Need the weather: call get_weather.<|end|>"
    call = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
    # the turn as decoded: its closing <|call|> is gpt-oss's stop token, removed
    assert parse("harmony", analysis + call) == ([WEATHER], analysis)
    assert parse("harmony", analysis + call + "<|call|>") == ([WEATHER], analysis)
    # the first message follows the generation prompt's <|start|>assistant; the recipient may follow the role
    first = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
    assert parse("harmony", first) == ([WEATHER], "")
    two = (call + "<|call|>" + '<|start|>assistant<|channel|>commentary to=functions.calculator <|constrain|>json'
           '<|message|>{"expression": "6*7"}<|call|>')
    assert parse("harmony", two) == ([WEATHER, CALC], "")
    final = analysis + "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."
    assert parse("harmony", final) == ([], final)
    [bad], content = parse("harmony", analysis + call[:-3])
    assert bad.name == "get_weather" and bad.error.startswith("the tool call is not valid JSON")
    [browser], _ = parse("harmony", '<|channel|>analysis to=browser.search code<|message|>{"query": "paris"}')
    assert browser == ToolCall("browser.search", {"query": "paris"})


def test_deepseek_v3_and_v31_turns():
    def v3(name, args):
        return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"
    text = ("Let me check.<｜tool▁calls▁begin｜>" + v3("get_weather", '{"city": "Paris"}') + "\n"
            + v3("calculator", '{"expression": "6*7"}') + "<｜tool▁calls▁end｜>")
    assert parse("deepseek", text) == ([WEATHER, CALC], "Let me check.")
    one = "<｜tool▁calls▁begin｜>" + v3("get_weather", '{"city": "Paris"}') + "<｜tool▁calls▁end｜>"
    assert parse("deepseek", one) == ([WEATHER], "")
    v31 = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
           '<｜tool▁call▁begin｜>calculator<｜tool▁sep｜>{"expression": "6*7"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    assert parse("deepseek", "</think>" + v31) == ([WEATHER, CALC], "</think>")
    [bad], _ = parse("deepseek", "<｜tool▁calls▁begin｜>" + v3("get_weather", '{"city": Paris}') + "<｜tool▁calls▁end｜>")
    assert bad.name == "get_weather" and bad.error.startswith("the tool call is not valid JSON")
    cut = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"ci"
    assert parse("deepseek", cut) == ([], cut)


def test_mistral_turns():
    array = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
             '{"name": "calculator", "arguments": {"expression": "6*7"}}]')
    assert parse("mistral", array) == ([WEATHER, CALC], "")
    assert parse("mistral", "Sure. " + array.replace("]", "] ", 1)) == ([WEATHER, CALC], "Sure.")
    compact = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]calculator[ARGS]{"expression": "6*7"}'
    assert parse("mistral", compact) == ([WEATHER, CALC], "")
    [bad], content = parse("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa')
    assert bad.error.startswith("the tool call is not valid JSON")
    assert parse("mistral", "It is sunny.") == ([], "It is sunny.")


def test_a_malformed_call_keeps_the_text_in_the_gateways_content():
    """The gateway keeps the whole text as content when a call is malformed (no tool_calls are returned), and when
    a parser gives no spans (a user's parser)."""
    assert content_without_calls("a <x> b", [ToolCall("f", span=None)]) == "a <x> b"
    assert content_without_calls("a <x> b", [ToolCall("f", span=(2, 5))]) == "a  b"


# chat templates cut to the markers that tell each family's format apart (the real ones are tokenizer_config.json's
# chat_template); each also carries the others' generic parts where the real one does
TEMPLATES = {
    "qwen2.5": ('{%- if tools %}<|im_start|>system\n# Tools\n<tools>{{ tools | tojson }}</tools>\nFor each function call,'
                ' return a json object within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>,'
                ' "arguments": <args-json-object>}\n</tool_call><|im_end|>{%- endif %}'),
    "qwen3": ('{%- if message.tool_calls %}{{- "<tool_call>\\n{\\"name\\": \\"" }}{{- tool_call.name }}'
              '{{- "</tool_call>" }}{%- endif %}<|im_start|>assistant\n<think>\n\n</think>\n\n'),
    "llama3.1": ('<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n{%- if builtin_tools %}'
                 '{{- "<|python_tag|>" + tool_call.name + ".call(" }}{%- else %}{{- \'{"name": "\' + tool_call.name'
                 ' + \'", \' }}{{- \'"parameters": \' }}{%- endif %}<|eot_id|>'),
    "llama3.2": ('<|start_header_id|>user<|end_header_id|>\n\nRespond in the format {"name": function name, '
                 '"parameters": dictionary of argument name and its value}.<|eot_id|>'),
    "gpt-oss": ('{{- "<|start|>assistant<|channel|>commentary to=" + "functions." + tool_call.name + '
                '" <|constrain|>json<|message|>" + tool_call.arguments|tojson + "<|call|>" }}'
                '{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}'),
    "deepseek-v3": ("{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>'"
                    " + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' "
                    "+ '```' + '<｜tool▁call▁end｜>'}}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}"),
    "mistral": ('{%- if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{%- endif %}[INST]{{ m.content }}'
                '[/INST]{%- if message.tool_calls %}[TOOL_CALLS][{{ tool_calls|tojson }}]</s>{%- endif %}'),
}


@pytest.mark.parametrize("family, parser", [("qwen2.5", "hermes"), ("qwen3", "hermes"), ("llama3.1", "llama3"),
                                             ("llama3.2", "llama3"), ("gpt-oss", "harmony"),
                                             ("deepseek-v3", "deepseek"), ("mistral", "mistral")])
def test_auto_reads_the_format_off_the_chat_template(family, parser):
    tokenizer = SimpleNamespace(chat_template=TEMPLATES[family])
    assert resolve_parser("auto", tokenizer) == (parser, TOOL_PARSERS.get(parser))
    assert detect_parser(TEMPLATES[family]) == parser
    # a tokenizer may hold its templates by name (e.g. default and tool_use)
    named = SimpleNamespace(chat_template={"default": "{{ messages }}", "tool_use": TEMPLATES[family]})
    assert resolve_parser("auto", named)[0] == parser


def test_auto_falls_back_to_hermes_saying_so(caplog):
    plain = SimpleNamespace(chat_template=None)  # the plain layout writes hermes calls
    assert resolve_parser("auto", plain)[0] == "hermes"
    llama3_0 = "<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    qwen3_coder = "<tool_call>\n<function={{ tool_call.name }}>\n<parameter={{ name }}>\n"  # XML calls: no parser
    for template in (llama3_0, qwen3_coder):
        assert detect_parser(template) is None
        with caplog.at_level(logging.WARNING, logger="megarl.rollout.tools.parsers"):
            caplog.clear()
            assert resolve_parser("auto", SimpleNamespace(chat_template=template))[0] == "hermes"
        assert "agent.parser=auto" in caplog.text and "none of the known formats" in caplog.text


def test_a_named_parser_is_taken_and_an_unknown_one_refused():
    qwen = SimpleNamespace(chat_template=TEMPLATES["qwen3"])
    assert resolve_parser("mistral", qwen)[0] == "mistral"  # a name is taken whatever the template shows
    name, fn = resolve_parser("megarl.rollout.tools.parsers:parse_llama3", qwen)
    assert fn is TOOL_PARSERS.get("llama3")
    with pytest.raises(ConfigError, match=r"agent.parser='gpt-oss': not a tool-call parser; the choices are auto, "
                                          r"deepseek, harmony, hermes, llama3, mistral"):
        resolve_parser("gpt-oss", qwen)
