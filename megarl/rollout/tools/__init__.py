"""Tools that the agent loop (megarl/rollout/agent.py) lets the model call, by name.

A tool is a class with a `name` (what the model calls), a `description` and a JSON-schema
`parameters` dict (what the chat template shows the model), and a `run(**arguments) -> str` method.
For a vision-language policy `run` may answer with images too: a ToolResult, whose images the model sees after
its text (megarl/rollout/agent.py; a text policy gets an error observation instead).
`run` may block (each call gets its own thread, so a slow tool holds up only its own conversation)
or be `async def`. A tool reports bad input or a failure by raising (ToolError for expected ones,
whose message is written for the model); the agent turns any exception into an "error: ..."
observation and the conversation goes on.

Built-in tools, by registry name: `calculator` (calculator.py), `python` (python_interpreter.py, runs
the code in megarl/sandbox/), `retrieval` (retrieval.py, BM25 over a local corpus). A user tool is any
such class given as `package.module:Class`. A recipe declares tools as a list of names or of
{"name": ..., <constructor arguments>} dicts, e.g.
    ["calculator", {"name": "retrieval", "corpus": "data/wiki.jsonl", "top_k": 2}]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from megarl.utils.registry import Registry

TOOLS = Registry("tool")


class ToolError(Exception):
    """An expected failure (bad arguments, a limit hit); its message goes to the model."""


@dataclass
class ToolResult:
    """A tool's answer with images: `text`, then `images`, each a path (relative to the working directory, or
    absolute), raw bytes, a data: URL, {'bytes'|'path': ...} or a PIL image (megarl.data.images.load_image)."""
    text: str
    images: list = field(default_factory=list)


class Tool:
    name: str = ""
    description: str = ""
    parameters: dict = {"type": "object", "properties": {}, "required": []}

    def run(self, **arguments: Any) -> "str | ToolResult":
        raise NotImplementedError

    def schema(self) -> dict:
        """The OpenAI-style function schema, as chat templates take it (`tools=` of apply_chat_template)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def close(self) -> None:
        """Free what the tool holds (processes, files); called when the agent loop is closed."""


def build_tools(specs: Iterable[str | dict]) -> dict[str, Tool]:
    """Tool instances by the name the model calls them, from a recipe's list of names / dicts."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        spec = {"name": spec} if isinstance(spec, str) else dict(spec)
        if "name" not in spec:
            raise ValueError(f"tool spec {spec} has no 'name' (a registered tool or 'package.module:Class')")
        key = spec.pop("name")
        tool = TOOLS.get(key)(**spec)
        if not isinstance(tool, Tool):
            raise TypeError(f"tool '{key}' built a {type(tool).__name__}, not a megarl.rollout.tools.Tool")
        name = tool.name or key
        if name in tools:
            raise ValueError(f"two tools are named '{name}'")
        tool.name = name
        tools[name] = tool
    return tools


def tool_schemas(tools: dict[str, Tool]) -> list[dict]:
    return [tool.schema() for tool in tools.values()]


from megarl.rollout.tools import calculator, python_interpreter, retrieval  # noqa: E402,F401  (register)
