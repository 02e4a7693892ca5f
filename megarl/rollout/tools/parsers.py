"""Tool-call parsers: `fn(text) -> list[ToolCall]`, one per format a model family writes, chosen by name
(`agent.parser=hermes`), read off the tokenizer's chat template (`agent.parser=auto`: resolve_parser), or given as
`package.module:function`. `text` is one model turn, decoded with special tokens kept and the stop token removed (so
gpt-oss's closing <|call|>, one of its stop tokens, is usually absent). A call that is recognisably a call but cannot be
parsed comes back with `error` set, so that the model is told what was wrong instead of being silently ignored. A
call's `span` is the text it takes, its format's markers included; the gateway cuts the spans out of the answer's
content (content_without_calls), and keeps the content whole for a parser that sets none.

The formats, as SGLang's and vLLM's parsers read them:
- hermes (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`, any number.
- llama3 (Llama 3.1-3.3, JSON tool calls): `{"name": "f", "parameters": {...}}` as the whole message, or after
  <|python_tag|>; several separated by ';'.
- harmony (gpt-oss): a message to a recipient, `<|start|>assistant<|channel|>commentary to=functions.f
  <|constrain|>json<|message|>{...}<|call|>` (the recipient may also follow the role).
- deepseek (DeepSeek-V3, R1): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; V3.1's `<｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` too.
- mistral: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`, and the newer `[TOOL_CALLS]f[ARGS]{...}`.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Callable

from megarl.config import ConfigError
from megarl.utils.registry import Registry

TOOL_PARSERS = Registry("tool-call parser")
log = logging.getLogger(__name__)


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # why the call could not be parsed
    span: tuple[int, int] | None = field(default=None, compare=False)  # [start, end) of the call in the text


ToolCallParser = Callable[[str], "list[ToolCall]"]
_JSON = json.JSONDecoder()


def _not_json(e: json.JSONDecodeError, span, name: str = "") -> ToolCall:
    return ToolCall(name, error=f"the tool call is not valid JSON ({e.msg} at character {e.pos})", span=span)


def _call(name: str, arguments, span, key: str = "arguments") -> ToolCall:
    """A call from its name and arguments: a JSON object, or a JSON-encoded string of one (some models write it so)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(name, error=f'"{key}" must be a JSON object', span=span)
    return ToolCall(name, arguments, span=span)


def _object_call(obj, span, keys: tuple[str, ...] = ("arguments",)) -> ToolCall:
    """A call from a JSON object {"name": ..., <one of keys>: {...}} (the arguments may be absent)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", error='a tool call must be a JSON object with a string "name"', span=span)
    key = next((k for k in keys if k in obj), keys[0])
    return _call(obj["name"], obj.get(key, {}), span, key)


def _json_body(body: str, name: str, span) -> ToolCall:
    """A call whose name the markers gave and whose arguments are `body` (empty: none)."""
    try:
        arguments = json.loads(body) if body.strip() else {}
    except json.JSONDecodeError as e:
        return _not_json(e, span, name)
    return _call(name, arguments, span)


def _skip(text: str, pos: int, chars: str = "") -> int:
    """The first position from `pos` that is neither whitespace nor one of `chars`."""
    while pos < len(text) and (text[pos].isspace() or text[pos] in chars):
        pos += 1
    return pos


# --- hermes ------------------------------------------------------------------------------------------------------

HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@TOOL_PARSERS.register("hermes")
def parse_hermes(text: str) -> list[ToolCall]:
    """Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`, any number.
    A call without its closing tag (a turn cut short) is not a call."""
    calls = []
    for match in HERMES_CALL.finditer(text):
        try:
            obj = json.loads(match[1])
        except json.JSONDecodeError as e:
            calls.append(_not_json(e, match.span()))
            continue
        calls.append(_object_call(obj, match.span()))
    return calls


# --- llama3 ------------------------------------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"


@TOOL_PARSERS.register("llama3")
def parse_llama3(text: str) -> list[ToolCall]:
    """Llama 3.x JSON tool calls: `{"name": "f", "parameters": {...}}` ("arguments" is read too) after <|python_tag|>,
    or as the whole message; several separated by ';'. A bare message is a call only when it is nothing but such
    objects (else it is an answer); after the tag, JSON that does not parse is a malformed call, and text after the
    last object is the turn's content."""
    tag = text.find(PYTHON_TAG)
    start = tag if tag >= 0 else _skip(text, 0)
    pos = tag + len(PYTHON_TAG) if tag >= 0 else start
    if tag < 0 and not text.startswith("{", start):
        return []
    calls, begin = [], start
    while True:
        pos = _skip(text, pos, ";" if calls else "")
        if pos == len(text) or (calls and text[pos] != "{"):
            break
        try:
            obj, end = _JSON.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if tag < 0:
                return []
            calls.append(_not_json(e, (begin, len(text))))
            break
        calls.append(_object_call(obj, (begin, end), ("parameters", "arguments")))
        pos = begin = end
    if tag < 0 and (pos < len(text) or any(c.error for c in calls)):
        return []
    return calls


# --- harmony (gpt-oss) -------------------------------------------------------------------------------------------

# one message: from <|start|> (or the turn's beginning: the generation prompt ends with `<|start|>assistant`) through
# its header to <|message|>, then its body up to the token that ends it, the next message or the end of the text
HARMONY_MESSAGE = re.compile(r"(?:<\|start\|>|^)(?P<header>(?:(?!<\|start\|>|<\|message\|>).)*)<\|message\|>"
                             r"(?P<body>(?:(?!<\|start\|>|<\|end\|>|<\|call\|>|<\|return\|>).)*)"
                             r"(?:<\|end\|>|<\|call\|>|<\|return\|>)?", re.DOTALL)
HARMONY_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@TOOL_PARSERS.register("harmony")
def parse_harmony(text: str) -> list[ToolCall]:
    """gpt-oss's harmony format: every message with a recipient (`to=functions.f`, in its header before or after the
    channel) is a call of `f`, its body the JSON arguments (`<|constrain|>json`); a recipient outside `functions`
    (gpt-oss's built-in browser / python) is called by its whole name. Messages without one (analysis, final) are
    the turn's content."""
    calls = []
    for match in HARMONY_MESSAGE.finditer(text):
        recipient = HARMONY_RECIPIENT.search(match["header"])
        if recipient is None or recipient[1] == "assistant":
            continue
        name = recipient[1].removeprefix("functions.")
        calls.append(_json_body(match["body"], name, match.span()))
    return calls


# --- deepseek ----------------------------------------------------------------------------------------------------

DEEPSEEK_BEGIN, DEEPSEEK_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL = re.compile(r"<｜tool▁call▁begin｜>((?:(?!<｜tool▁call▁end｜>).)*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>",
                           re.DOTALL)
DEEPSEEK_FENCED = re.compile(r"([^\n]*)\n```(?:json)?[ \t]*\n(.*?)\n?```\s*", re.DOTALL)  # V3: name, then ```json


@TOOL_PARSERS.register("deepseek")
def parse_deepseek(text: str) -> list[ToolCall]:
    """DeepSeek-V3 / R1: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`
    inside <｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>; V3.1's `<｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}
    <｜tool▁call▁end｜>` too. A call without <｜tool▁call▁end｜> (a turn cut short) is not a call."""
    calls = []
    for match in DEEPSEEK_CALL.finditer(text):
        fenced = DEEPSEEK_FENCED.fullmatch(match[2])
        name, body = (fenced[1].strip(), fenced[2]) if fenced else (match[1].strip(), match[2])
        call = _json_body(body, name, match.span())
        calls.append(call if name or call.error else ToolCall("", error="a tool call must name its function",
                                                              span=call.span))
    if calls:  # the section's markers belong to its first and last calls
        begin = text.rfind(DEEPSEEK_BEGIN, 0, calls[0].span[0])
        if begin >= 0 and not text[begin + len(DEEPSEEK_BEGIN):calls[0].span[0]].strip():
            calls[0].span = (begin, calls[0].span[1])
        end = calls[-1].span[1]
        if text[end:].lstrip().startswith(DEEPSEEK_END):
            calls[-1].span = (calls[-1].span[0], text.index(DEEPSEEK_END, end) + len(DEEPSEEK_END))
    return calls


# --- mistral -----------------------------------------------------------------------------------------------------

MISTRAL_TAG = "[TOOL_CALLS]"
MISTRAL_COMPACT = re.compile(r"([^\s\[\]{}]+)\s*(?:\[CALL_ID\]\s*[^\s\[]*\s*)?\[ARGS\]\s*")


@TOOL_PARSERS.register("mistral")
def parse_mistral(text: str) -> list[ToolCall]:
    """Mistral: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` (a JSON list, or one object), or the newer
    `[TOOL_CALLS]f[ARGS]{...}` (each call after its own tag). JSON that does not parse after the tag is a malformed
    call; text after a call's JSON is the turn's content."""
    calls = []
    for tag in (m.start() for m in re.finditer(re.escape(MISTRAL_TAG), text)):
        pos = _skip(text, tag + len(MISTRAL_TAG))
        compact = MISTRAL_COMPACT.match(text, pos)
        if compact:
            pos = compact.end()
        try:
            value, end = _JSON.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            calls.append(_not_json(e, (tag, len(text))))
            continue
        if compact:
            calls.append(_call(compact[1], value, (tag, end)))
        else:
            items = value if isinstance(value, list) else [value]
            calls += [_object_call(item, (tag, end)) for item in items]
            if not items:
                calls.append(ToolCall("", error="the list of tool calls is empty", span=(tag, end)))
    return calls


# --- choosing a parser ---------------------------------------------------------------------------------------------

def content_without_calls(text: str, calls: list[ToolCall]) -> str:
    """The turn's text without its calls' spans and the whitespace between adjacent ones, stripped; the text whole
    where a call has no span (a parser that sets none)."""
    if any(c.span is None for c in calls):
        return text
    out, pos = [], 0
    for start, end in sorted(c.span for c in calls):
        if start > pos and text[pos:start].strip():
            out.append(text[pos:start])
        pos = max(pos, end)
    out.append(text[pos:])
    return "".join(out).strip()


def _llama3_template(t: str) -> bool:  # 3.2's template writes calls as '"parameters": ...' without <|python_tag|>
    return "<|start_header_id|>" in t and (PYTHON_TAG in t or '"parameters"' in t)


# (parser, whether a chat template shows its format), most specific first: a template may hold another's markers
TEMPLATE_FORMATS: list[tuple[str, Callable[[str], bool]]] = [
    ("harmony", lambda t: "<|channel|>" in t and "<|message|>" in t),
    ("deepseek", lambda t: "<｜tool▁call▁begin｜>" in t),
    ("mistral", lambda t: MISTRAL_TAG in t),
    ("llama3", _llama3_template),
    ("hermes", lambda t: "<tool_call>" in t and "<function=" not in t),  # <function=: Qwen3-Coder's XML calls
]


def chat_template_text(tokenizer) -> str:
    """The tokenizer's chat template(s) as one text ('' without one); a tokenizer may hold several by name."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def detect_parser(template: str) -> str | None:
    """The parser whose format `template` (a chat template's text) writes tool calls in; None if none is known."""
    return next((name for name, shows in TEMPLATE_FORMATS if shows(template)), None)


def resolve_parser(name: str, tokenizer, key: str = "agent.parser") -> tuple[str, ToolCallParser]:
    """The parser `name` (the value of config `key`) chooses for `tokenizer`, and its name: `auto` reads it off the
    chat template (hermes where the template shows no known format, with a warning; hermes without a template, whose
    plain layout writes hermes calls), else a registered name or a `module:function` path."""
    if name == "auto":
        template = chat_template_text(tokenizer)
        detected = detect_parser(template) if template else "hermes"
        if detected is None:
            log.warning("%s=auto: the chat template writes tool calls in none of the known formats (%s); reading "
                        "them as hermes <tool_call>{...}</tool_call>. Set %s to the model's format or to a "
                        "package.module:function parser.", key, ", ".join(n for n, _ in TEMPLATE_FORMATS), key)
            detected = "hermes"
        else:
            log.info("%s=auto: %s tool calls (%s)", key, detected,
                     "read off the chat template" if template else "no chat template: the plain layout's")
        return detected, TOOL_PARSERS.get(detected)
    if name not in TOOL_PARSERS and ":" not in name:
        choices = ", ".join(["auto", *TOOL_PARSERS.names()])
        raise ConfigError(f"{key}={name!r}: not a tool-call parser; the choices are {choices}, or a "
                         "package.module:function path")
    return name, TOOL_PARSERS.get(name)


def get_parser(name: str) -> ToolCallParser:
    return TOOL_PARSERS.get(name)
