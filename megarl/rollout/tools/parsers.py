"""Tool-call parsers: `fn(text) -> list[ToolCall]`, chosen by name (`agent.parser=hermes`) or given
as `package.module:function`. `text` is one model turn, decoded with special tokens kept and the
stop token removed. A call that is recognisably a call but cannot be parsed comes back with
`error` set, so that the model is told what was wrong instead of being silently ignored.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable

from megarl.utils.registry import Registry

TOOL_PARSERS = Registry("tool-call parser")


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # why the call could not be parsed


ToolCallParser = Callable[[str], "list[ToolCall]"]
HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@TOOL_PARSERS.register("hermes")
def parse_hermes(text: str) -> list[ToolCall]:
    """Hermes / Qwen2.5 format: `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`, any number.

    `arguments` may also be a JSON-encoded string of an object (some models write it so) or absent.
    """
    calls = []
    for body in HERMES_CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", error=f"the tool call is not valid JSON ({e.msg} at character {e.pos})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall("", error='a tool call must be a JSON object with a string "name"'))
            continue
        arguments = obj.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(ToolCall(obj["name"], error='"arguments" must be a JSON object'))
            continue
        calls.append(ToolCall(obj["name"], arguments))
    return calls


def get_parser(name: str) -> ToolCallParser:
    return TOOL_PARSERS.get(name)
