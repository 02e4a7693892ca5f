"""What the gateway (megarl/rollout/gateway.py) records behind the OpenAI API: per agent run (one API key), the token
ids the engine was fed and produced and their log-probs, in segments that megarl trains on as rows.

A segment is a Trajectory (megarl/rollout/agent.py): its prompt is the first request's context, rendered and
tokenised once; every later request that extends the recorded conversation (the same messages, the assistant's
answers as the gateway returned them, then new ones) extends it token by token: the new messages' tokens (the chat
layout's text after an assistant message: text_after_assistant) are appended as context (loss mask 0), then the
model's tokens exactly as generated (loss mask 1, their log-probs and policy versions). Nothing already recorded is
tokenised again. A request whose history is not the recorded one (a message edited, dropped or reordered, a
summarised context) starts a new segment from its whole rendered history, marked "edited".

/v1/completions records the same way: a prompt (token ids, or text) that starts with the segment's whole context
continues it, any other starts a new segment.
"""

from __future__ import annotations

import asyncio
import json
import uuid

from megarl.rollout.agent import Trajectory, text_after_assistant
from megarl.rollout.base import Generation
from megarl.rollout.tools.parsers import ToolCall

_HERMES_CALL = "<tool_call>{}</tool_call>"


def text_content(content) -> str:
    """A message's content as text: a string, None, or OpenAI's list of parts ({"type": "text", "text": ...})."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise ValueError("only text content parts are supported")
        return "".join(p.get("text", "") for p in content)
    raise ValueError(f"a message's content must be a string or a list of parts, not {type(content).__name__}")


def _arguments(text: str):
    try:
        return json.loads(text)
    except (TypeError, json.JSONDecodeError):
        return text


def normalize(message: dict) -> dict:
    """What of a message the history comparison and the chat template read: role, text, tool calls (arguments
    parsed), tool_call_id and name. Fields a client adds or leaves out (refusal, annotations, None values) do not
    make an edit."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError("each message must be an object with a string 'role'")
    out = {"role": message["role"], "content": text_content(message.get("content"))}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": _arguments(c["function"].get("arguments", "{}"))}}
                             for c in calls]
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


class ChatLayout:
    """Messages to the policy's text: the tokenizer's chat template (tools as its `tools=`), or, for a tokenizer
    without one (the tiny character tokenizer), the agent loop's plain layout: system and user text as is, an
    assistant message's text and tool calls (hermes: <tool_call>{...}</tool_call>) then the stop token, each tool
    result as agent.observation_template renders it."""

    def __init__(self, tokenizer, observation_template: str = ""):
        self.tokenizer = tokenizer
        self.template = getattr(tokenizer, "chat_template", None)
        self.observation = observation_template or "\n<tool_response>\n{result}\n</tool_response>\n"
        self.eos_text = tokenizer.decode([tokenizer.eos_token_id])

    def text(self, messages: list[dict], tools: list | None = None) -> str:
        """The conversation up to the opening of the next assistant turn."""
        if self.template:
            return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                      add_generation_prompt=True)
        parts = []
        for m in messages:
            if m["role"] == "assistant":
                calls = "".join(_HERMES_CALL.format(json.dumps(c["function"], separators=(",", ":")))
                                for c in m.get("tool_calls", []))
                parts.append(m["content"] + calls + self.eos_text)
            elif m["role"] == "tool":
                parts.append(self.observation.format(result=m["content"]))
            else:
                parts.append(m["content"])
        return "".join(parts)

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


class Segment:
    """One segment being recorded: its Trajectory and, for chat requests, the messages it holds (normalized), the
    last one the assistant's answer as returned."""

    def __init__(self, trajectory: Trajectory, messages: list[dict] | None):
        self.trajectory, self.messages = trajectory, messages

    def context(self) -> list[int]:
        return self.trajectory.prompt_ids + self.trajectory.response_ids

    def stop_text(self, tokenizer) -> str | None:
        """The model's stop token ending the segment (already in the context), as text; None if it did not stop."""
        last = self.trajectory.turns[-1] if self.trajectory.turns else None
        if last is None or last["role"] != "assistant" or not last["stopped"]:
            return None
        return tokenizer.decode(self.trajectory.response_ids[-1:])


class Record:
    """One agent run's record (one API key): its segments in order, the tokens the model generated for it. Requests
    of one key are recorded one after another (`lock`): an agent that sends several at once gets them answered in
    turn, each in the context the earlier ones left."""

    def __init__(self, prompt_index: int, policy_version: int, max_tokens: int):
        self.key = "megarl-" + uuid.uuid4().hex
        self.prompt_index, self.policy_version, self.max_tokens = prompt_index, policy_version, max_tokens
        self.segments: list[Segment] = []
        self.generated = 0  # model tokens over every segment
        self.requests = 0
        self.lock = asyncio.Lock()
        self.closed = False  # the run ended (returned, crashed or timed out): its key is refused from then on

    def chat_context(self, layout: ChatLayout, messages: list[dict], tools: list | None) -> Segment:
        """The segment a chat request continues, its new messages' tokens appended as context; or a new segment."""
        seg = self.segments[-1] if self.segments else None
        if seg is not None and seg.messages is not None and len(messages) > len(seg.messages) \
                and messages[:len(seg.messages)] == seg.messages:
            new = messages[len(seg.messages):]
            tail = text_after_assistant(lambda m: layout.text(m, tools), new, seg.stop_text(layout.tokenizer))
            seg.trajectory.turns.append({"role": "context", "span": seg.trajectory.append(layout.ids(tail), None)})
            seg.messages = list(messages)
            return seg
        return self._new_segment(layout.ids(layout.text(messages, tools)), list(messages))

    def completion_context(self, tokenizer, prompt: str | list[int]) -> Segment:
        """The segment a completion request continues (its prompt starts with the whole context), the rest of the
        prompt appended as context; or a new segment."""
        seg = self.segments[-1] if self.segments else None
        if seg is not None and seg.messages is None:
            context = seg.context()
            if isinstance(prompt, list):
                rest = prompt[len(context):] if prompt[:len(context)] == context else None
            else:
                done = tokenizer.decode(context, skip_special_tokens=False)
                rest = tokenizer(prompt[len(done):], add_special_tokens=False)["input_ids"] \
                    if prompt.startswith(done) else None
            if rest is not None:
                seg.trajectory.turns.append({"role": "context", "span": seg.trajectory.append(rest, None)})
                return seg
        ids = prompt if isinstance(prompt, list) else tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return self._new_segment(list(ids), None)

    def _new_segment(self, prompt_ids: list[int], messages: list[dict] | None) -> Segment:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        origin = {"segment": len(self.segments), "new_segment": "edited" if self.segments else "first",
                  "agent": self.key}
        self.segments.append(Segment(Trajectory(self.prompt_index, prompt_ids, policy_version=self.policy_version,
                                                origin=origin), messages))
        return self.segments[-1]

    def room(self) -> int:
        return self.max_tokens - self.generated

    def record_turn(self, seg: Segment, gen: Generation, text: str, calls: list[ToolCall], stop_token: bool) -> None:
        """The model's tokens as generated: loss mask 1, their log-probs and policy versions. `stop_token`: the last
        one is the model's stop token (not so for an answer a stop string ended)."""
        t = seg.trajectory
        t.turns.append({"role": "assistant", "text": text, "stopped": stop_token,
                        "span": t.append(gen.token_ids, gen.logprobs, gen.versions),
                        "tool_calls": [{"name": c.name, "arguments": c.arguments, "error": c.error} for c in calls]})
        t.finish_reason = gen.finish_reason
        self.generated += len(gen.token_ids)

    def trajectories(self, reward: float | None) -> list[Trajectory]:
        """The segments that hold model tokens, each carrying the agent's reward (None: megarl's reward scores it)."""
        out = []
        for seg in self.segments:
            if any(seg.trajectory.loss_mask):
                seg.trajectory.origin["agent_reward"] = reward
                out.append(seg.trajectory)
        return out
