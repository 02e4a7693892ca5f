import json
import time

import pytest

from megarl.rollout.tools import TOOLS, Tool, ToolError, build_tools, tool_schemas
from megarl.rollout.tools.calculator import Calculator
from megarl.rollout.tools.parsers import ToolCall, get_parser, parse_hermes
from megarl.rollout.tools.retrieval import BM25Index, Retrieval
from megarl.utils.registry import UnknownNameError


@pytest.mark.parametrize("expression, expected", [
    ("1 + 2 * 3", "7"), ("(1 + 2) * 3", "9"), ("7 / 2", "3.5"), ("6 / 3", "2"), ("7 // 2", "3"), ("-7 % 3", "2"),
    ("2 ** 10", "1024"), ("2 ** -1", "0.5"), ("sqrt(16) + abs(-2)", "6"), ("max(1, 5, 3) - min(4, 2)", "3"),
    ("round(pi, 3)", "3.142"), ("123456789 * 987654321", "121932631112635269"), ("0.1 + 0.2", "0.30000000000000004"),
])
def test_calculator_evaluates_arithmetic(expression, expected):
    assert Calculator().run(expression=expression) == expected


@pytest.mark.parametrize("expression, error", [
    ("__import__('os').system('true')", "not allowed"), ("(1).__class__", "not allowed"), ("x + 1", "not allowed"),
    ("'a' * 3", "not allowed"), ("[i for i in range(9)]", "not allowed"), ("2 ^ 3", "write powers as"),
    ("1 / 0", "division by zero"), ("sqrt(-1)", "math error"), ("9 ** 9 ** 9", "too large"),
    ("10 ** 2000", "too large"), ("1e308 * 10 ** 300", "not finite"), ("10 ** 400 * 1.0", "math error"), ("1 +", "cannot parse"),
    ("1" * 300, "longer than"), ("max()", "math error"),
])
def test_calculator_rejects_what_is_not_bounded_arithmetic(expression, error):
    start = time.monotonic()
    with pytest.raises(ToolError, match=error):
        Calculator().run(expression=expression)
    assert time.monotonic() - start < 0.5  # bounded: nothing is computed at full size first


def test_bm25_scores_match_the_formula_by_hand():
    index = BM25Index(["the cat sat", "the dog sat on the mat", "cats and dogs"])
    # N = 3, avgdl = 4, idf(cat) = idf(mat) = ln(1 + 2.5 / 1.5) = 0.98083; k1 = 1.5, b = 0.75
    # doc 0: 0.98083 * 2.5 / (1 + 1.5 * (0.25 + 0.75 * 3 / 4)) = 1.10516
    # doc 1: 0.98083 * 2.5 / (1 + 1.5 * (0.25 + 0.75 * 6 / 4)) = 0.80068
    hits = index.search("cat mat", top_k=5)
    assert [d for d, _ in hits] == [0, 1]
    assert [s for _, s in hits] == pytest.approx([1.1051597, 0.8006769], abs=1e-6)
    # "the": n = 2, idf = ln(1 + 1.5 / 2.5) = 0.47000; doc 1 has it twice:
    # 0.47 * 2 * 2.5 / (2 + 2.0625) = 0.57847 beats doc 0's 0.47 * 2.5 / 2.21875 = 0.52958
    assert index.search("THE", top_k=1) == [(1, pytest.approx(0.5784660, abs=1e-6))]
    assert index.search("zebra", top_k=3) == []


def test_retrieval_tool_reads_jsonl_and_text_corpora(tmp_path):
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("\n".join(json.dumps(d) for d in [
        {"id": "paris", "title": "Paris", "text": "Paris is the capital of France."},
        {"id": "rome", "text": "Rome is the capital of Italy."},
        {"id": "cheese", "contents": "France makes many cheeses."}]) + "\n")
    tool = build_tools([{"name": "retrieval", "corpus": str(jsonl), "top_k": 2}])["retrieval"]
    # both mention France once; the shorter document scores higher
    assert tool.run(query="France").splitlines() == [
        "[1] (cheese) France makes many cheeses.", "[2] (paris) Paris", "Paris is the capital of France."]
    assert tool.run(query="Italy", top_k=5) == "[1] (rome) Rome is the capital of Italy."
    assert tool.run(query="volcano") == "no matching documents"
    with pytest.raises(ToolError, match="top_k"):
        tool.run(query="x", top_k=0)

    text = tmp_path / "corpus.txt"
    text.write_text("first line about apples\n\nsecond line about pears\n")
    assert Retrieval(str(text)).run(query="pears") == "[1] (1) second line about pears"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Retrieval(str(tmp_path / "missing.jsonl"))


def test_hermes_parser_finds_every_call_and_names_malformed_ones():
    text = ('think <tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>\n'
            '<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n</tool_call>'
            '<tool_call>{"name": "f"}</tool_call><tool_call>{oops}</tool_call><tool_call>[1]</tool_call>'
            '<tool_call>{"name": "g", "arguments": [1]}</tool_call> <tool_call>{"name": "unterminated"')
    calls = get_parser("hermes")(text)
    assert calls[:3] == [ToolCall("calculator", {"expression": "1+1"}), ToolCall("python", {"code": "print(1)"}),
                         ToolCall("f", {})]
    assert calls[3].error.startswith("the tool call is not valid JSON")
    assert "string \"name\"" in calls[4].error and calls[5] == ToolCall("g", error='"arguments" must be a JSON object')
    assert len(calls) == 6  # the unterminated call is not a call
    assert parse_hermes("no tools here") == []


def test_build_tools_by_name_module_path_and_errors():
    tools = build_tools([{"name": "calculator"}])
    assert list(tools) == ["calculator"] and isinstance(tools["calculator"], Tool)
    assert tool_schemas(tools)[0]["function"]["parameters"]["required"] == ["expression"]
    assert {"calculator", "python", "retrieval"} <= set(TOOLS.names())
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        build_tools(["calculator", "megarl.rollout.tools.calculator:Calculator"])
    with pytest.raises(UnknownNameError, match="did you mean 'calculator'"):
        build_tools(["calculater"])
    with pytest.raises(TypeError, match="not a megarl.rollout.tools.Tool"):
        build_tools(["collections:OrderedDict"])
